//! The synchronization primitives of the facade ([`crate::facade::allocator`], [`crate::facade::stream_cache`]) in one
//! place: `parking_lot`'s `Mutex`, std's `Arc` and atomics in every build, loom's under `--cfg loom`, so
//! `tests/loom.rs` can model-check every interleaving of the facade's locking (see `docs/reliability.md`).
//! Nothing else in the crate locks but the simulator: its capture probe (`driver/sim/capture.rs`), which the
//! facade calls from any thread, its byte store, which a copy job reads and writes without the driver
//! (`driver/sim/copies.rs`), and the memory its processes share (`driver/sim/processes.rs`). (CUDA's
//! page-locked memory and copy jobs use std's, `driver/cuda/`.)

#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::sync::Arc;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
#[cfg(loom)]
pub(crate) use loom_mutex::Mutex;

/// Lets other threads run a moment, for a thread waiting for another's work between looks; returns how
/// long (1 ms; under loom a yield, counted as 1 ms).
#[cfg(not(loom))]
pub(crate) fn pause() -> std::time::Duration {
    let pause = std::time::Duration::from_millis(1);
    std::thread::sleep(pause);
    pause
}

/// See the non-loom `pause`.
#[cfg(loom)]
pub(crate) fn pause() -> std::time::Duration {
    loom::thread::yield_now();
    std::time::Duration::from_millis(1)
}

/// A small number for the calling thread, the same at every call from it: what spreads threads over the stream
/// caches' shards (`facade/stream_cache.rs`). Threads are numbered as they first ask, so that up to as many
/// threads as there are shards each get their own. Under loom, loom's number of the thread, which is the same
/// in every execution of a model.
#[cfg(not(loom))]
#[inline]
pub(crate) fn thread_slot() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::Ordering;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    SLOT.with(|slot| {
        if slot.get() == usize::MAX {
            slot.set(NEXT.fetch_add(1, Ordering::Relaxed) & (usize::MAX >> 1));
        }
        slot.get()
    })
}

/// See the non-loom `thread_slot`: loom's number of the thread in the model's execution (0 for the thread that
/// runs the model, then in the order threads are spawned), the same in every execution. Loom shows it only
/// through `Debug` (`ThreadId(N)`).
#[cfg(loom)]
pub(crate) fn thread_slot() -> usize {
    let id = format!("{:?}", loom::thread::current().id());
    (id.chars().filter(char::is_ascii_digit).collect::<String>())
        .parse()
        .unwrap_or(0)
}

#[cfg(loom)]
mod loom_mutex {
    /// loom's mutex with `parking_lot`'s signature: `lock` returns the guard (a poisoned lock is taken
    /// over, as `parking_lot` has no poisoning).
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }

        /// The guard if the lock is free now, else `None` (a poisoned lock is taken over).
        pub(crate) fn try_lock(&self) -> Option<loom::sync::MutexGuard<'_, T>> {
            match self.0.try_lock() {
                Ok(guard) => Some(guard),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }
    }

    impl<T: Default> Default for Mutex<T> {
        fn default() -> Self {
            Self::new(T::default())
        }
    }
}
