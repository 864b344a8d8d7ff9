//! Reading recorded traces from files, whatever their format: what `--trace FILE` accepts.
//!
//! The format is recognised from the file's first bytes: a pickle (PyTorch memory snapshot), an RMM
//! `logging_resource_adaptor` CSV log (header `Thread,Time,Action,Pointer,Size,Stream`), or cuvmm's own
//! line-oriented trace format (docs/trace-format.md), or a PyTorch profiler (Kineto) trace with memory
//! events (JSON). Each may be gzipped: the format is then that of the decompressed bytes.

use super::event::Trace;
use super::gzip;
use super::kineto::{self, KinetoError};
use super::pytorch::{self, SnapshotError};
use super::rmm::{self, RmmError};
use super::text::{self, TextError};
use std::fmt;
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
    /// PyTorch profiler (Kineto) Chrome-trace JSON.
    Kineto,
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TraceFormat::PytorchSnapshot => "a PyTorch memory snapshot",
            TraceFormat::RmmCsv => "an RMM log",
            TraceFormat::Cuvmm => "a cuvmm trace",
            TraceFormat::Kineto => "a PyTorch profiler trace",
        })
    }
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
    /// A gzipped file that cannot be decompressed.
    #[error("{path}: cannot decompress: {source}")]
    Gzip {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is empty.
    #[error("{path}: empty file, not a trace")]
    Empty {
        /// The file.
        path: PathBuf,
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
    /// An RMM log that cannot be read.
    #[error(transparent)]
    Rmm(#[from] RmmError),
    /// A cuvmm trace that cannot be read.
    #[error(transparent)]
    Text(#[from] TextError),
    /// A device other than 0 asked of a format that holds one device's trace.
    #[error("{path}: no device {device}: {format} holds the trace of one device, device 0")]
    NoSuchDevice {
        /// The file.
        path: PathBuf,
        /// The device asked for.
        device: usize,
        /// The file's format.
        format: TraceFormat,
    },
}

/// The format of the file at `path`, from its first bytes (decompressed, if it is gzipped).
///
/// # Errors
/// [`LoadError::Io`], [`LoadError::Gzip`], [`LoadError::Empty`] or [`LoadError::UnknownFormat`].
pub fn detect(path: &Path) -> Result<TraceFormat, LoadError> {
    let file = std::fs::File::open(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let head = gzip::head(file, HEAD).map_err(|source| LoadError::Gzip {
        path: path.to_path_buf(),
        source,
    })?;
    detect_plain(path, &head)
}

/// How many bytes tell a file's format.
const HEAD: usize = 64;

/// The format of a file that starts with `head` (decompressed first, if gzipped); `path` names it in errors.
///
/// # Errors
/// [`LoadError::Gzip`], [`LoadError::Empty`] or [`LoadError::UnknownFormat`].
pub fn detect_bytes(path: &Path, head: &[u8]) -> Result<TraceFormat, LoadError> {
    let plain = gzip::head(head, HEAD).map_err(|source| LoadError::Gzip {
        path: path.to_path_buf(),
        source,
    })?;
    detect_plain(path, &plain)
}

/// The format of a file whose (decompressed) bytes start with `head`.
fn detect_plain(path: &Path, head: &[u8]) -> Result<TraceFormat, LoadError> {
    if head.is_empty() {
        return Err(LoadError::Empty {
            path: path.to_path_buf(),
        });
    }
    if head.first() == Some(&0x80) {
        return Ok(TraceFormat::PytorchSnapshot);
    }
    let text = String::from_utf8_lossy(head);
    let first = text.trim_start_matches('\u{feff}').trim_start();
    if first.starts_with(rmm::HEADER) {
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
/// that has events when `device` is `None`; for the other formats, the one trace they hold (device 0).
/// Each trace is named after the file (and the device, for a device other than 0). Memory live before
/// recording began comes first, as allocations.
///
/// # Errors
/// [`LoadError`], naming the file.
pub fn load(path: &Path, device: Option<usize>) -> Result<Vec<Trace>, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    load_bytes(path, &bytes, device)
}

/// As [`load`], from the file's bytes (gzipped or not); `path` names the traces and the errors.
///
/// # Errors
/// As [`load`].
pub fn load_bytes(
    path: &Path,
    bytes: &[u8],
    device: Option<usize>,
) -> Result<Vec<Trace>, LoadError> {
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let bytes = &*gzip::decompressed(bytes).map_err(|source| LoadError::Gzip {
        path: path.to_path_buf(),
        source,
    })?;
    let format = detect_plain(path, &bytes[..bytes.len().min(HEAD)])?;
    let multi_device = matches!(format, TraceFormat::PytorchSnapshot | TraceFormat::Kineto);
    if !multi_device && device.is_some_and(|d| d != 0) {
        return Err(LoadError::NoSuchDevice {
            path: path.to_path_buf(),
            device: device.unwrap_or_default(),
            format,
        });
    }
    let mut trace = match format {
        TraceFormat::PytorchSnapshot => {
            return Ok(pytorch::parse_devices(path, bytes, device)?
                .iter()
                .map(|t| {
                    let name = match t.device {
                        0 => file.clone(),
                        d => format!("{file}:{d}"),
                    };
                    t.to_trace(name)
                })
                .collect());
        }
        TraceFormat::Kineto => return Ok(kineto::parse(path, bytes, device, &file)?),
        TraceFormat::RmmCsv => rmm::parse(path, bytes)?.trace,
        TraceFormat::Cuvmm => text::parse(path, bytes)?,
    };
    trace.name = file;
    Ok(vec![trace])
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
        // Gzipped, each format is that of the decompressed bytes.
        for (name, plain, format) in [
            (
                "a.json.gz",
                &b"{\"traceEvents\": []}"[..],
                TraceFormat::Kineto,
            ),
            (
                "a.pickle.gz",
                &[0x80, 4, 0x95][..],
                TraceFormat::PytorchSnapshot,
            ),
            (
                "a.csv.gz",
                &b"Thread,Time,Action,Pointer,Size,Stream\n"[..],
                TraceFormat::RmmCsv,
            ),
        ] {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            std::io::Write::write_all(&mut encoder, plain).unwrap();
            let gz = scratch(name, &encoder.finish().unwrap());
            assert_eq!(detect(&gz).unwrap(), format, "{name}");
        }
        let broken = scratch("broken.gz", &[0x1f, 0x8b, 8, 0]);
        assert!(matches!(detect(&broken), Err(LoadError::Gzip { .. })));
        assert!(matches!(load(&broken, None), Err(LoadError::Gzip { .. })));
        let other = scratch("a.txt", b"hello");
        let err = load(&other, None).unwrap_err();
        assert!(matches!(err, LoadError::UnknownFormat { .. }));
        assert!(err.to_string().contains("a.txt"), "{err}");
        let empty = scratch("a.csv.empty", b"");
        assert!(matches!(detect(&empty), Err(LoadError::Empty { .. })));
        let missing = std::env::temp_dir().join("cuvmm-no-such-trace");
        assert!(matches!(
            load(&missing, None).unwrap_err(),
            LoadError::Io { .. }
        ));
    }
}
