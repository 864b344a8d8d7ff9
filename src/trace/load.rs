//! Reading recorded traces from files, whatever their format: what `--trace FILE` accepts.
//!
//! The format is recognised from the file's first bytes: a pickle (PyTorch memory snapshot), an RMM
//! `logging_resource_adaptor` CSV log (header `Thread,Time,Action,Pointer,Size,Stream`), or cuvmm's own
//! line-oriented trace format (docs/trace-format.md), or a PyTorch profiler (Kineto) trace with memory
//! events (JSON, gzipped or not).

use super::event::Trace;
use super::kineto::{self, KinetoError};
use super::pytorch::{self, SnapshotError};
use std::path::{Path, PathBuf};

/// The formats [`load`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    /// `torch.cuda.memory._dump_snapshot` pickle.
    PytorchSnapshot,
    /// RMM `logging_resource_adaptor` CSV.
    RmmCsv,
    /// cuvmm's own text format.
    Cuvmm,
    /// PyTorch profiler (Kineto) Chrome-trace JSON, gzipped or not.
    Kineto,
}

/// Why a trace file cannot be replayed. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file cannot be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is in none of the formats [`load`] reads.
    #[error(
        "{path}: not a trace (expected a PyTorch memory snapshot pickle, an RMM CSV log, a cuvmm trace or a PyTorch profiler trace)"
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// A PyTorch snapshot that cannot be used.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// A PyTorch profiler trace that cannot be used.
    #[error(transparent)]
    Kineto(#[from] KinetoError),
    /// A format recognised but not read yet.
    #[error("{path}: {format:?} traces are not supported yet")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Its format.
        format: TraceFormat,
    },
}

/// The format of the file at `path`, from its first bytes.
///
/// # Errors
/// [`LoadError::Io`] or [`LoadError::UnknownFormat`].
pub fn detect(path: &Path) -> Result<TraceFormat, LoadError> {
    use std::io::Read;
    let io = |source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut head = Vec::with_capacity(64);
    std::fs::File::open(path)
        .map_err(io)?
        .take(64)
        .read_to_end(&mut head)
        .map_err(io)?;
    if head.first() == Some(&0x80) {
        return Ok(TraceFormat::PytorchSnapshot);
    }
    if head.starts_with(&[0x1f, 0x8b]) {
        return Ok(TraceFormat::Kineto);
    }
    let text = String::from_utf8_lossy(&head);
    let first = text.trim_start_matches('\u{feff}').trim_start();
    if first.starts_with("Thread,Time,Action,Pointer,Size,Stream") {
        Ok(TraceFormat::RmmCsv)
    } else if first.starts_with("# cuvmm-trace") {
        Ok(TraceFormat::Cuvmm)
    } else if first.starts_with('{') {
        Ok(TraceFormat::Kineto)
    } else {
        Err(LoadError::UnknownFormat {
            path: path.to_path_buf(),
        })
    }
}

/// Reads the traces in the file at `path`: for a PyTorch snapshot, the trace of `device`, or of each device
/// that has events when `device` is `None`; for the other formats, the one trace they hold. Each trace is
/// named after the file (and the device, for a device other than 0). Memory live before recording began
/// comes first, as allocations.
///
/// # Errors
/// [`LoadError`], naming the file.
pub fn load(path: &Path, device: Option<usize>) -> Result<Vec<Trace>, LoadError> {
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    match detect(path)? {
        TraceFormat::PytorchSnapshot => Ok(pytorch::load_devices(path, device)?
            .iter()
            .map(|t| {
                let name = match t.device {
                    0 => file.clone(),
                    d => format!("{file}:{d}"),
                };
                t.to_trace(name)
            })
            .collect()),
        TraceFormat::Kineto => Ok(kineto::load(path, device, &file)?),
        format => Err(LoadError::Unsupported {
            path: path.to_path_buf(),
            format,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cuvmm-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn the_format_comes_from_the_first_bytes() {
        let pickle = scratch("a.pickle", &[0x80, 4, 0x95]);
        assert_eq!(detect(&pickle).unwrap(), TraceFormat::PytorchSnapshot);
        let csv = scratch("a.csv", b"Thread,Time,Action,Pointer,Size,Stream\n");
        assert_eq!(detect(&csv).unwrap(), TraceFormat::RmmCsv);
        let own = scratch("a.trace", b"# cuvmm-trace v1\n");
        assert_eq!(detect(&own).unwrap(), TraceFormat::Cuvmm);
        let kineto = scratch("a.json", b"{\"traceEvents\": []}");
        assert_eq!(detect(&kineto).unwrap(), TraceFormat::Kineto);
        let gz = scratch("a.json.gz", &[0x1f, 0x8b, 8, 0]);
        assert_eq!(detect(&gz).unwrap(), TraceFormat::Kineto);
        let other = scratch("a.txt", b"hello");
        let err = load(&other, None).unwrap_err();
        assert!(matches!(err, LoadError::UnknownFormat { .. }));
        assert!(err.to_string().contains("a.txt"), "{err}");
        let missing = std::env::temp_dir().join("cuvmm-no-such-trace");
        assert!(matches!(
            load(&missing, None).unwrap_err(),
            LoadError::Io { .. }
        ));
    }
}
