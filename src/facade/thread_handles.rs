//! Per-thread handles of one allocator, which [`DeviceBuffer`](crate::DeviceBuffer)s hold: what keeps the
//! allocator alive while a buffer lives without a reference count that every thread writes at every
//! allocation and every drop (docs/library.md, "Locking").
//!
//! A buffer must keep its allocator alive, so it holds a strong reference. Had it held a clone of the
//! program's handle, every allocation and drop on every thread would change one count, and threads
//! would take turns owning its cache line. Instead each thread slot (`base::sync::thread_slot`) keeps one
//! `Arc` of an allocator handle of its own, and a buffer made on that thread clones that `Arc`: its count
//! is written by the threads of that slot only (and by another thread that drops one of their buffers).
//!
//! These handles refer to the allocator's shared state, which holds them: a cycle, broken when the
//! program's last own handle is dropped ([`ThreadHandles::take_all`]); from then on each goes when its
//! last buffer does, and the shared state with the last of them.

use crate::base::sync::{Arc, Mutex, thread_slot};

/// Number of slots (a power of two), as the stream caches' shards. Two in loom builds.
const SLOTS: usize = if cfg!(loom) { 2 } else { 64 };

/// One slot, on a cache line of its own.
#[derive(Debug)]
#[repr(align(128))]
struct Slot<H> {
    handle: Mutex<Option<Arc<H>>>,
}

/// The per-thread handles, of type `H`.
#[derive(Debug)]
pub(crate) struct ThreadHandles<H> {
    slots: Box<[Slot<H>]>,
}

impl<H> ThreadHandles<H> {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    handle: Mutex::new(None),
                })
                .collect(),
        }
    }

    /// The calling thread's handle, made with `make` if its slot has none (at its first buffer, or after
    /// [`take_all`](Self::take_all)).
    #[inline]
    pub(crate) fn get(&self, make: impl FnOnce() -> H) -> Arc<H> {
        let mut slot = self.slots[thread_slot() % SLOTS].handle.lock();
        Arc::clone(slot.get_or_insert_with(|| Arc::new(make())))
    }

    /// Empties every slot, returning their handles for the caller to drop once no slot is locked.
    pub(crate) fn take_all(&self) -> Vec<Arc<H>> {
        (self.slots.iter())
            .filter_map(|slot| slot.handle.lock().take())
            .collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_thread_gets_its_own_handle_until_they_are_taken() {
        let handles = ThreadHandles::new();
        let first = handles.get(|| 1);
        let again = handles.get(|| 2);
        assert!(Arc::ptr_eq(&first, &again));
        let (other, slot) = std::thread::scope(|scope| {
            scope
                .spawn(|| (handles.get(|| 3), thread_slot()))
                .join()
                .unwrap()
        });
        if slot % SLOTS != thread_slot() % SLOTS {
            assert_eq!(*other, 3);
        }
        assert_eq!(handles.take_all().len(), 1 + usize::from(*other == 3));
        assert_eq!(*handles.get(|| 4), 4);
    }
}
