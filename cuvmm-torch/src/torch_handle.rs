//! PyTorch's own handle strings for the memory of an expandable segment (`shareIpcHandle` of its caching
//! allocator, `c10/cuda/CUDACachingAllocator.cpp`), so that a tensor cuvmm shares opens in a process on
//! PyTorch's allocator, and one PyTorch's expandable segments share opens in a cuvmm process.
//!
//! # The layouts (little-endian, as PyTorch writes its structs on x86-64 and aarch64)
//! Byte 0 is the version, byte 1 the type: `'c'` (a `cudaIpcMemHandle_t` of `cudaMalloc` memory follows;
//! the C++ layer opens those) or `'e'` (an expandable segment). After `'e'`:
//! - **version 2** (PyTorch 2.4 to 2.12; read from 2.11's `getIpcDevPtr`): `pid` (`i32`), 4 bytes of
//!   padding, `segment_size` and `num_handles` (`u64` each), then `num_handles` descriptors (`i32`).
//! - **version 3** (PyTorch 2.13 on; read from 2.15's): the same header with a handle type (`i32`, 1 POSIX
//!   descriptor, 2 fabric handle) and 4 bytes of padding after `num_handles`, then the handles: descriptors
//!   (`i32`) for type 0 or 1, 64-byte fabric handles for type 2.
//!
//! A reader takes the exporter's descriptors with `pidfd_open` and `pidfd_getfd` and maps them back to
//! back, `segment_size` bytes each. PyTorch checks only that the version is not above its own, and reads
//! nothing after the handles; a version-3 reader misreads a version-2 header, and a version-2 reader refuses
//! version 3, so an exporter writes the layout of the PyTorch it runs under ([`set_torch_version`]), as
//! PyTorch's own processes do. cuvmm appends its own handle string after the handles (`sharing.rs`), so a
//! cuvmm importer can fetch the same descriptors over cuvmm's socket where `pidfd_getfd` is refused.
//!
//! # Who may take the descriptors
//! `pidfd_getfd` needs ptrace rights over the exporter. Under Yama's `ptrace_scope=1` (Ubuntu's default) a
//! process may take them only from its descendants, so a child could not open what its parent shared. When
//! it first writes a handle in PyTorch's layout, an exporting process therefore declares itself traceable by
//! its own descendants (`prctl(PR_SET_PTRACER, getpid())`): its children and their children may take its
//! descriptors, as a parent may take its children's. `CUVMM_IPC_PTRACER=any` declares any process of the
//! user (for siblings: workers started by a launcher), `none` declares nothing.

use crate::error::AbiError;
use cuvmm::sharing::SharedPart;
use rustix::process::{PTracer, Pid, PidfdFlags, PidfdGetfdFlags};
use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The type byte of an expandable segment's handle.
pub const EXPANDABLE: u8 = b'e';
/// The type byte of a `cudaMalloc` block's handle (a `cudaIpcMemHandle_t` follows).
pub const CUDA_MALLOC: u8 = b'c';
/// The handle type of a version-3 header for POSIX file descriptors.
const POSIX_FD: i32 = 1;
/// The handle type of a version-3 header for fabric handles (multi-node NVLink).
const FABRIC: i32 = 2;
/// Which processes an exporter lets take its descriptors: `self` (its descendants, the default), `any`,
/// `none`.
pub const PTRACER_VAR: &str = "CUVMM_IPC_PTRACER";

/// The PyTorch version handles are written for, `major * 100 + minor`; 0 until the C++ layer says.
static TORCH_VERSION: AtomicU32 = AtomicU32::new(0);

/// Tells which PyTorch this process runs under (the C++ layer does when installed): the layout of the
/// handles it writes follows (version 3 from PyTorch 2.13). Before, version 2 (PyTorch 2.11's) is written.
pub fn set_torch_version(major: u32, minor: u32) {
    TORCH_VERSION.store(major * 100 + minor, Ordering::Relaxed);
}

/// The handle version this process writes.
pub fn written_version() -> u8 {
    match TORCH_VERSION.load(Ordering::Relaxed) {
        v if v >= 213 => 3,
        _ => 2,
    }
}

/// An expandable segment's handle in PyTorch's layout, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchHandle {
    /// The layout's version (2 or 3).
    pub version: u8,
    /// The exporting process.
    pub pid: i32,
    /// Bytes of each handle.
    pub segment_size: u64,
    /// The exporter's descriptor numbers, one per handle, in address order.
    pub fds: Vec<i32>,
    /// What follows the handles (cuvmm's own handle string, from a cuvmm exporter; empty from PyTorch's).
    pub rest: Vec<u8>,
}

impl TorchHandle {
    /// The handle's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(36 + 4 * self.fds.len() + self.rest.len());
        out.extend_from_slice(&[self.version, EXPANDABLE]);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.segment_size.to_le_bytes());
        out.extend_from_slice(&(self.fds.len() as u64).to_le_bytes());
        if self.version >= 3 {
            out.extend_from_slice(&POSIX_FD.to_le_bytes());
            out.extend_from_slice(&[0; 4]);
        }
        for fd in &self.fds {
            out.extend_from_slice(&fd.to_le_bytes());
        }
        out.extend_from_slice(&self.rest);
        out
    }

    /// Whether `bytes` is in PyTorch's layout: a version byte PyTorch wrote (1 to 3) and a type byte.
    pub fn is_torch(bytes: &[u8]) -> bool {
        bytes.len() >= 2
            && (1..=3).contains(&bytes[0])
            && matches!(bytes[1], EXPANDABLE | CUDA_MALLOC)
    }

    /// Decodes an expandable segment's handle.
    ///
    /// # Errors
    /// [`AbiError::BadHandle`] for a `'c'` handle (the C++ layer opens those), a fabric handle, a version
    /// cuvmm does not know, or bytes cut short.
    pub fn decode(bytes: &[u8]) -> Result<Self, AbiError> {
        let bad = |why: &str| AbiError::BadHandle {
            why: why.to_owned(),
        };
        let (&version, &kind) = match bytes {
            [version, kind, ..] => (version, kind),
            _ => return Err(bad("it is cut short")),
        };
        if kind == CUDA_MALLOC {
            return Err(bad(
                "a cudaMalloc block's handle (PyTorch's 'c'): open it with cudaIpcOpenMemHandle",
            ));
        }
        if kind != EXPANDABLE || !(2..=3).contains(&version) {
            return Err(bad(
                "not an expandable segment's handle of PyTorch 2.4 or newer",
            ));
        }
        let header = if version >= 3 { 32 } else { 24 };
        // The bytes `at..at + n` after the version and type bytes (a count from the bytes may be any u64).
        let field = |at: usize, n: usize| {
            (2 + at)
                .checked_add(n)
                .and_then(|end| bytes.get(2 + at..end))
                .ok_or_else(|| bad("it is cut short"))
        };
        let pid = i32::from_le_bytes(field(0, 4)?.try_into().unwrap_or([0; 4]));
        let segment_size = u64::from_le_bytes(field(8, 8)?.try_into().unwrap_or([0; 8]));
        let count = u64::from_le_bytes(field(16, 8)?.try_into().unwrap_or([0; 8]));
        if version >= 3 {
            let kind = i32::from_le_bytes(field(24, 4)?.try_into().unwrap_or([0; 4]));
            if kind == FABRIC {
                return Err(bad(
                    "its handles are fabric handles (expandable_segments_handle_type:fabric), which \
                     cuvmm does not import: share with POSIX descriptors",
                ));
            }
            if kind != POSIX_FD && kind != 0 {
                return Err(bad("its handle type is unknown"));
            }
        }
        let count = usize::try_from(count).map_err(|_| bad("it is cut short"))?;
        let fds_len = count.checked_mul(4).ok_or_else(|| bad("it is cut short"))?;
        let fds_bytes = field(header, fds_len)?;
        if segment_size == 0 || count == 0 {
            return Err(bad("it shares no memory"));
        }
        let fds = (fds_bytes.chunks_exact(4))
            .map(|b| i32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
            .collect();
        Ok(Self {
            version,
            pid,
            segment_size,
            fds,
            rest: bytes[2 + header + fds_len..].to_vec(),
        })
    }

    /// The parts an importer maps: each handle whole, `segment_size` bytes.
    pub fn parts(&self) -> Vec<SharedPart<()>> {
        let part = SharedPart {
            fd: (),
            handle_size: self.segment_size,
            handle_offset: 0,
            size: self.segment_size,
        };
        vec![part; self.fds.len()]
    }

    /// Takes the exporter's descriptors with `pidfd_getfd` (PyTorch's way), in order.
    ///
    /// # Errors
    /// The first refusal: no such process (it ended, or lives in another pid namespace), no ptrace rights
    /// over it (Yama), a kernel without the calls, a descriptor it does not have.
    pub fn take_descriptors(&self) -> io::Result<Vec<OwnedFd>> {
        let pid =
            Pid::from_raw(self.pid).ok_or_else(|| io::Error::from_raw_os_error(libc_esrch()))?;
        let pidfd = rustix::process::pidfd_open(pid, PidfdFlags::empty())?;
        (self.fds.iter())
            .map(|&fd| {
                Ok(rustix::process::pidfd_getfd(
                    &pidfd,
                    fd,
                    PidfdGetfdFlags::empty(),
                )?)
            })
            .collect()
    }
}

fn libc_esrch() -> i32 {
    rustix::io::Errno::SRCH.raw_os_error()
}

/// The handle size, if `parts` can be written in PyTorch's layout: every part a whole handle, all of one
/// size (CUDA maps whole handles only; cuvmm's large pool uses 20 MiB chunks, its small pool single pages,
/// and single pages when memory is short).
pub fn uniform_size<F>(parts: &[SharedPart<F>]) -> Option<u64> {
    let size = parts.first()?.handle_size;
    (parts.iter())
        .all(|p| p.handle_offset == 0 && p.size == p.handle_size && p.handle_size == size)
        .then_some(size)
}

/// The handle in PyTorch's layout for this process's descriptors `fds` (`segment_size` bytes each), with
/// `rest` after them.
pub fn for_export(segment_size: u64, fds: &[RawFd], rest: Vec<u8>) -> TorchHandle {
    TorchHandle {
        version: written_version(),
        pid: std::process::id() as i32,
        segment_size,
        fds: fds.to_vec(),
        rest,
    }
}

/// Declares, once, which processes may take this process's descriptors with `pidfd_getfd`
/// ([`PTRACER_VAR`]; see the module's doc). A kernel without Yama refuses the call, and needs none.
pub fn let_importers_take_descriptors() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let tracer = match std::env::var(PTRACER_VAR).as_deref() {
            Ok("none") => return,
            Ok("any") => PTracer::Any,
            _ => match Pid::from_raw(std::process::id() as i32) {
                Some(me) => PTracer::ProcessID(me),
                None => return,
            },
        };
        if let Err(err) = rustix::process::set_ptracer(tracer) {
            tracing::debug!(%err, "cuvmm: PR_SET_PTRACER refused (no Yama here, or not allowed)");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(handle_size: u64, handle_offset: u64, size: u64) -> SharedPart<()> {
        SharedPart {
            fd: (),
            handle_size,
            handle_offset,
            size,
        }
    }

    #[test]
    fn only_whole_handles_of_one_size_have_pytorchs_layout() {
        let mib = 1 << 20;
        assert_eq!(
            uniform_size(&[part(20 * mib, 0, 20 * mib); 3]),
            Some(20 * mib)
        );
        assert_eq!(
            uniform_size(&[part(2 * mib, 0, 2 * mib), part(20 * mib, 0, 20 * mib)]),
            None
        );
        assert_eq!(
            uniform_size(&[part(20 * mib, 2 * mib, 2 * mib)]),
            None,
            "a lent piece"
        );
        assert_eq!(uniform_size::<()>(&[]), None);
    }

    /// The bytes PyTorch 2.11 (version 2) and 2.15 (version 3) read, byte for byte.
    #[test]
    fn both_layouts_round_trip_and_match_pytorchs_structs() {
        let mut h = TorchHandle {
            version: 2,
            pid: 0x0102_0304,
            segment_size: 2 << 20,
            fds: vec![7, 9],
            rest: b"tail".to_vec(),
        };
        let v2 = h.encode();
        assert_eq!(&v2[..2], b"\x02e");
        assert_eq!(&v2[2..6], &0x0102_0304i32.to_le_bytes());
        assert_eq!(&v2[10..18], &(2u64 << 20).to_le_bytes());
        assert_eq!(&v2[18..26], &2u64.to_le_bytes());
        assert_eq!(&v2[26..34], &[7, 0, 0, 0, 9, 0, 0, 0]);
        assert_eq!(&v2[34..], b"tail");
        assert_eq!(TorchHandle::decode(&v2).unwrap(), h);
        h.version = 3;
        let v3 = h.encode();
        assert_eq!(v3.len(), v2.len() + 8);
        assert_eq!(&v3[26..30], &1i32.to_le_bytes());
        assert_eq!(&v3[34..42], &[7, 0, 0, 0, 9, 0, 0, 0]);
        assert_eq!(TorchHandle::decode(&v3).unwrap(), h);
        assert!(TorchHandle::is_torch(&v2) && TorchHandle::is_torch(&v3));
        assert!(!TorchHandle::is_torch(b"CUVMMIPC"));
    }

    #[test]
    fn what_cuvmm_cannot_open_is_refused_saying_why() {
        let h = TorchHandle {
            version: 2,
            pid: 1,
            segment_size: 2 << 20,
            fds: vec![5],
            rest: Vec::new(),
        };
        let bytes = h.encode();
        for (bad, why) in [
            (&bytes[..20], "cut short"),
            (&b"\x02c0123"[..], "cudaIpcOpenMemHandle"),
            (&b"\x04e0123"[..], "PyTorch 2.4 or newer"),
        ] {
            let err = TorchHandle::decode(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
        let mut empty = h.clone();
        empty.fds.clear();
        assert!(
            TorchHandle::decode(&empty.encode())
                .unwrap_err()
                .to_string()
                .contains("no memory")
        );
    }

    #[test]
    fn a_count_near_the_top_of_u64_is_cut_short() {
        let mut bytes = b"\x03e".to_vec();
        bytes.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        bytes.extend_from_slice(&(2u64 << 20).to_le_bytes());
        bytes.extend_from_slice(&(u64::MAX / 4).to_le_bytes());
        bytes.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        let err = TorchHandle::decode(&bytes).unwrap_err().to_string();
        assert!(err.contains("cut short"), "{err}");
    }

    #[test]
    fn the_written_version_follows_the_pytorch_the_layer_runs_under() {
        assert_eq!(written_version(), 2, "before the C++ layer says");
        set_torch_version(2, 15);
        assert_eq!(written_version(), 3);
        set_torch_version(2, 11);
        assert_eq!(written_version(), 2);
    }
}
