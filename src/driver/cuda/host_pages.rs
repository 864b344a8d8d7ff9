//! Ordinary host memory faulted in ahead of `cuMemHostRegister` (`host.rs`): how a sleep pins its buffers
//! unless `pinned_use_cuda_host_register` is False.
//!
//! `cuMemHostAlloc` faults in and locks each 4 KiB page inside the driver, under its lock: on an H200
//! machine 16 GiB took 9.4 s from four threads, where the copies into it ran at 48 GB/s. Registering
//! memory whose pages are already there only locks them, and the faults, the costly part, run on as many
//! threads as pin. So this memory is:
//! - an anonymous private mapping, aligned to 2 MiB, advised to use transparent huge pages (one fault and
//!   one zeroing per 2 MiB instead of 512; where the host has them off the advice is refused and 4 KiB
//!   pages serve);
//! - advised `MADV_DONTFORK`: a child forked later (a data loader's workers) gets no copy of it. Otherwise
//!   the parent's next write to a page would copy it, and the device would go on copying to the page the
//!   child kept (the fork hazard of every registered buffer, which RDMA libraries avoid the same way);
//! - faulted in by writing one byte in each page, from the thread that pins it. The kernel zeroes new
//!   pages, so every byte reads zero.

use std::ptr::NonNull;

/// Bytes of a huge page on x86-64 and of the alignment of the mapping.
const HUGE_PAGE: usize = 2 << 20;
/// Bytes of a base page: one write in each faults the mapping in whichever page size backs it.
const BASE_PAGE: usize = 4 << 10;

/// An anonymous mapping of whole huge pages, faulted in, unmapped when dropped.
#[derive(Debug)]
pub(super) struct HostPages {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `HostPages` owns its mapping alone (the pointer it hands out is for `host.rs`, whose `Pinned`
// owns the `HostPages` and ties every access to itself), and a mapping may be used and unmapped from any
// thread.
unsafe impl Send for HostPages {}

impl HostPages {
    /// At least `len` bytes (rounded up to whole huge pages), every page faulted in and zero; the OS's
    /// error where it cannot map them (`len` 0 among them).
    pub(super) fn fault_in(len: usize) -> std::io::Result<Self> {
        let invalid = || std::io::Error::from(std::io::ErrorKind::InvalidInput);
        let len = len
            .checked_next_multiple_of(HUGE_PAGE)
            .filter(|&l| l > 0)
            .ok_or_else(invalid)?;
        // Room to align: the kernel aligns a large mapping to a huge page only on some versions.
        let mapped = len.checked_add(HUGE_PAGE).ok_or_else(invalid)?;
        // SAFETY: a new anonymous private mapping at an address the kernel chooses overlaps nothing that
        // exists; the arguments are valid (a nonzero length, no file).
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (aligned - start, mapped - (aligned - start) - len);
        // SAFETY: the head and the tail lie inside the mapping just made, outside `aligned .. aligned +
        // len`, and nothing refers to them; a failure leaves them mapped, which wastes at most 2 MiB.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
        }
        let pages = Self {
            ptr: NonNull::new(aligned as *mut u8).ok_or_else(invalid)?,
            len,
        };
        pages.advise();
        pages.touch();
        Ok(pages)
    }

    /// Asks for huge pages and for no copy in a child. Either may be refused (a kernel without
    /// transparent huge pages, or with them off): the memory works the same, only its faults cost more.
    fn advise(&self) {
        let ptr = self.ptr.as_ptr().cast();
        #[cfg(target_os = "linux")]
        // SAFETY: advice on the whole of this mapping, which no one else uses; it changes no byte.
        unsafe {
            libc::madvise(ptr, self.len, libc::MADV_HUGEPAGE);
        }
        // SAFETY: as above.
        unsafe {
            libc::madvise(ptr, self.len, libc::MADV_DONTFORK);
        }
    }

    /// Writes a zero in each base page, so that each is faulted in (and zeroed by the kernel) now, on this
    /// thread, rather than inside the driver's registration.
    fn touch(&self) {
        for offset in (0..self.len).step_by(BASE_PAGE) {
            // SAFETY: `offset < len`, inside the mapping, which is readable and writable and which nothing
            // else uses yet; a volatile write, so that the fault is not optimised away.
            unsafe { self.ptr.as_ptr().add(offset).write_volatile(0) };
        }
    }

    /// The first byte.
    pub(super) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// How many bytes are mapped: a whole number of huge pages.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `fault_in` and is unmapped once, here; whoever registered it has
        // unregistered it first (`host.rs`), and no borrow of its bytes outlives `self`.
        if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) } != 0 {
            let err = std::io::Error::last_os_error();
            tracing::error!(%err, bytes = self.len, "cuvmm: unmapping host memory failed: it leaks");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_aligned_whole_zero_and_writable() {
        let len = 5 * HUGE_PAGE / 2 + 3;
        let pages = HostPages::fault_in(len).expect("mapping host memory");
        assert_eq!(pages.len(), 3 * HUGE_PAGE, "rounded up to whole huge pages");
        assert_eq!(pages.ptr().as_ptr() as usize % HUGE_PAGE, 0, "aligned");
        // SAFETY: the mapping is `len()` bytes, readable and writable, and only this test uses it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(pages.ptr().as_ptr(), pages.len()) };
        assert!(bytes.iter().all(|&b| b == 0), "the kernel zeroes new pages");
        bytes[len - 1] = 7;
        bytes[0] = 9;
        assert_eq!((bytes[0], bytes[len - 1]), (9, 7));
    }

    #[test]
    fn every_page_is_resident_before_anyone_registers_it() {
        let pages = HostPages::fault_in(HUGE_PAGE + 1).expect("mapping host memory");
        let mut resident = vec![0u8; pages.len() / BASE_PAGE];
        // SAFETY: `mincore` reads the page tables of this mapping and writes one byte per base page into
        // `resident`, which holds exactly that many.
        let asked = unsafe {
            libc::mincore(
                pages.ptr().as_ptr().cast(),
                pages.len(),
                resident.as_mut_ptr().cast(),
            )
        };
        assert_eq!(asked, 0, "{}", std::io::Error::last_os_error());
        assert!(resident.iter().all(|&r| r & 1 == 1), "faulted in");
    }

    #[test]
    fn no_bytes_or_too_many_is_an_error_not_a_panic() {
        assert!(HostPages::fault_in(0).is_err());
        assert!(HostPages::fault_in(usize::MAX - 10).is_err());
    }
}
