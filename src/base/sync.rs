//! The synchronization primitives of the facade ([`crate::facade::allocator`], [`crate::facade::stream_cache`]) in one
//! place: `parking_lot`'s `Mutex`, std's `Arc` and atomics in every build, loom's under `--cfg loom`, so
//! `tests/loom.rs` can model-check every interleaving of the facade's locking (see `docs/reliability.md`).
//! Nothing else in the crate locks but the simulator's capture probe (`driver/sim/capture.rs`), which the
//! facade calls from any thread.

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
