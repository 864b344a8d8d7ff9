//! The synchronization primitives of the facade ([`crate::allocator`]) in one place: `parking_lot`'s
//! `Mutex` and std's `Arc` in every build, loom's under `--cfg loom`, so `tests/loom.rs` can model-check
//! every interleaving of the facade's locking (see `docs/reliability.md`). Nothing else in the crate locks.

#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::sync::Arc;
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
    }
}
