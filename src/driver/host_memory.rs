//! Host memory that device memory is copied to and from ([`Driver::alloc_host`](super::Driver::alloc_host)):
//! what a sleeping tag's bytes are kept in.

use super::error::DriverError;
use std::any::Any;
use std::fmt;

/// The storage behind a [`HostMemory`]: an ordinary `Vec<u8>`, or a backend's own (page-locked memory on
/// CUDA, which `cuMemcpy` reaches at the link's speed instead of through a staging buffer).
///
/// A backend's copy job ([`CopyJob`](super::CopyJob)) recognises its own storage through
/// [`as_any_mut`](HostBytes::as_any_mut); an implementation whose memory an asynchronous copy may still
/// be writing makes [`bytes`](HostBytes::bytes), [`bytes_mut`](HostBytes::bytes_mut) and its drop wait
/// for that copy first.
pub trait HostBytes: Send {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// How many bytes there are (without touching them).
    fn len(&self) -> usize {
        self.bytes().len()
    }
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether the memory is page-locked (pinned).
    fn pinned(&self) -> bool {
        false
    }
    /// The storage as `Any`, for the backend that made it to recognise it.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// How a backend pins the host pieces a copy job allocates ([`CopyPlan::pinning`](super::CopyPlan)):
/// the setting `pinned_use_cuda_host_register` and `pinned_num_register_threads`, with PyTorch's names and
/// meaning, applied to a sleeping tag's buffers. The simulator only records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPinning {
    /// `true`: ordinary memory, faulted in by the pinning threads, then registered (`cuMemHostRegister`);
    /// `false`: `cuMemHostAlloc`, which faults in and locks each page inside the driver.
    pub register: bool,
    /// How many threads pin a job's pieces ahead of its copies (at least 1).
    pub threads: usize,
}

impl HostPinning {
    /// The threads of the default: enough for the host to fault in pages faster than the link copies
    /// them, as PyTorch's documentation advises for `pinned_num_register_threads` ("a good value is 8").
    pub const DEFAULT_THREADS: usize = 8;
}

impl Default for HostPinning {
    /// Registered memory, pinned by [`DEFAULT_THREADS`](Self::DEFAULT_THREADS) threads. PyTorch's own
    /// default is `cudaHostAlloc` from one thread; cuvmm pins gigabytes at once where PyTorch pins a
    /// tensor, and `cuMemHostAlloc` pins them at a small fraction of the link's speed (docs/DESIGN.md).
    fn default() -> Self {
        Self {
            register: true,
            threads: Self::DEFAULT_THREADS,
        }
    }
}

/// Host bytes for copies of device memory, owned: freed when dropped.
pub struct HostMemory(Box<dyn HostBytes>);

impl HostMemory {
    /// `len` zero bytes of ordinary (pageable) memory, or [`DriverError::HostOutOfMemory`] when the host
    /// cannot give them (a failed allocation is an error, not an abort).
    pub fn pageable(len: usize) -> Result<Self, DriverError> {
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(len)
            .map_err(|_| DriverError::HostOutOfMemory { bytes: len as u64 })?;
        bytes.resize(len, 0);
        Ok(Self(Box::new(bytes)))
    }

    /// Host memory a backend made.
    pub fn new(bytes: impl HostBytes + 'static) -> Self {
        Self(Box::new(bytes))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.bytes()
    }

    /// The bytes, to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }

    /// How many bytes it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The storage, for the backend that made it (its copy job writes and reads it directly).
    pub fn storage_mut(&mut self) -> &mut dyn HostBytes {
        &mut *self.0
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the memory is page-locked (pinned).
    pub fn is_pinned(&self) -> bool {
        self.0.pinned()
    }
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMemory")
            .field("len", &self.len())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pageable_memory_is_zeroed_and_writable() {
        let mut host = HostMemory::pageable(5).unwrap();
        assert_eq!(host.as_slice(), &[0; 5]);
        host.as_mut_slice().copy_from_slice(b"bytes");
        assert_eq!(host.as_slice(), b"bytes");
        assert!(!host.is_pinned());
        assert!(HostMemory::pageable(0).unwrap().is_empty());
    }

    #[test]
    fn memory_the_host_cannot_give_is_an_error_not_an_abort() {
        let huge = usize::MAX / 2;
        assert_eq!(
            HostMemory::pageable(huge).unwrap_err(),
            DriverError::HostOutOfMemory { bytes: huge as u64 }
        );
    }
}
