//! Tagged memory through the facade: allocations that sleep and wake (docs/allocator.md, "Sleep and wake"),
//! for a strategy with [`Tags`].

use crate::driver::StreamId;
use crate::facade::allocator::Allocator;
use crate::strategy::Strategy;
use crate::strategy::capabilities::Tags;
use crate::strategy::error::Error;

impl<S: Strategy + Tags> Allocator<S> {
    /// [`alloc_tagged`](Self::alloc_tagged) without a guard: the caller must pass the address to
    /// [`free_raw`](Allocator::free_raw).
    pub fn alloc_tagged_raw(&self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        self.allocate(size, stream, false, |s| s.alloc_tagged(size, stream, tag))
            .map(|(ptr, _)| ptr)
    }

    /// Puts `tag` to sleep: waits for the streams that used its memory (an event query first, a
    /// synchronization only of a stream still busy), copies its bytes to host memory if `keep`, then
    /// unmaps its pages and gives their physical memory back. Its virtual addresses stay reserved and no
    /// other allocation is placed in them; its memory must not be used (nor freed) until
    /// [`wake`](Self::wake). Returns the bytes given back by this call (0 if already asleep).
    /// Refused during a CUDA graph capture. See docs/allocator.md, "Sleep and wake".
    pub fn sleep(&self, tag: &str, keep: bool) -> Result<u64, Error> {
        self.with_strategy(|strategy| strategy.sleep(tag, keep))
    }

    /// Wakes `tag`: maps memory at the same addresses and puts back the bytes its sleep kept, so pointers
    /// and captured CUDA graphs that use them stay valid. Does nothing for a tag awake. Out of memory with
    /// buffers in the stream caches, they are given back to the strategy and the wake tried once more.
    pub fn wake(&self, tag: &str) -> Result<(), Error> {
        let result = self.with_strategy(|strategy| strategy.wake(tag));
        match result {
            Err(err) if err.is_out_of_memory() && self.retries_after_drain() => {
                self.drain_caches()?;
                self.with_strategy(|strategy| strategy.wake(tag))
            }
            other => other,
        }
    }

    /// The tags asleep and the bytes each gave back, by name.
    pub fn asleep_tags(&self) -> Vec<(String, u64)> {
        self.with_strategy(|strategy| strategy.asleep_tags())
    }
}
