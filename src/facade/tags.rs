//! Tagged memory through the facade: allocations that sleep and wake (docs/allocator.md, "Sleep and wake"),
//! for a strategy with [`Tags`].
//!
//! A sleep or wake runs in phases: the strategy's lock is held to wait for the tag's streams and mark it,
//! let go while its bytes are copied ([`TagCopy::run`](crate::strategy::tags::TagCopy::run)), and taken
//! again to unmap (a sleep) or to mark it awake (a wake). Meanwhile other threads allocate and free as
//! usual; what concerns the tag is refused (an allocation under it, [`Error::TagAsleep`]; a sleep or wake
//! of it, [`Error::TagBusy`]) or waits (a free of its memory takes effect once it is awake), and its pages
//! are neither unmapped nor taken by compaction, so the copies always find them.

use crate::driver::StreamId;
use crate::facade::allocator::Allocator;
use crate::strategy::Strategy;
use crate::strategy::capabilities::Tags;
use crate::strategy::error::Error;
use crate::strategy::tags::{Begun, TagCopy, TagInfo};

impl<S: Strategy + Tags> Allocator<S> {
    /// [`alloc_tagged`](Self::alloc_tagged) without a guard: the caller must pass the address to
    /// [`free_raw`](Allocator::free_raw).
    pub fn alloc_tagged_raw(&self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        self.allocate(size, stream, false, |s| s.alloc_tagged(size, stream, tag))
            .map(|(ptr, _)| ptr)
    }

    /// Puts `tag` to sleep: waits for the streams that used its memory (an event query first, a
    /// synchronization only of a stream still busy), copies its bytes to host memory if `keep` (without
    /// the allocator's lock: other threads go on allocating), then unmaps its pages and gives their physical
    /// memory back. Its virtual addresses stay reserved and no other allocation is placed in them; its
    /// memory must not be used (nor freed) until [`wake`](Self::wake). Returns the bytes given back by this
    /// call (0 if already asleep). Refused during a CUDA graph capture, and while another thread's sleep or
    /// wake of the tag copies its bytes ([`Error::TagBusy`]). See docs/allocator.md, "Sleep and wake".
    pub fn sleep(&self, tag: &str, keep: bool) -> Result<u64, Error> {
        let begun = self.with_tags(|strategy| strategy.begin_sleep(tag, keep))?;
        self.run_phases(begun, S::finish_sleep)
    }

    /// Wakes `tag`: maps memory at the same addresses and puts back the bytes its sleep kept (copied
    /// without the allocator's lock), so pointers and captured CUDA graphs that use them stay valid. Does
    /// nothing for a tag awake. Out of memory with buffers in the stream caches, they are given back to the
    /// strategy and the wake tried once more.
    pub fn wake(&self, tag: &str) -> Result<(), Error> {
        let begun = match self.with_tags(|strategy| strategy.begin_wake(tag)) {
            Err(err) if err.is_out_of_memory() && self.retries_after_drain() => {
                self.drain_caches()?;
                self.with_tags(|strategy| strategy.begin_wake(tag))
            }
            other => other,
        };
        self.run_phases(begun?, S::finish_wake)
    }

    /// The rest of a sleep, wake or preparation begun under the lock: its job run without the lock, then
    /// `finish` under it.
    fn run_phases<T>(
        &self,
        begun: Begun<T>,
        finish: fn(&mut S, TagCopy) -> Result<T, Error>,
    ) -> Result<T, Error> {
        match begun {
            Begun::Done(out) => Ok(out),
            Begun::Copy(mut copy) => {
                copy.run();
                self.with_tags(|strategy| finish(strategy, *copy))
            }
        }
    }

    /// Pins now the page-locked host memory the next sleep of `tag` with its bytes copies into, so that
    /// the sleep pins nothing and copies at the link's speed from its first cycle (a wake leaves the
    /// memory for the next sleep anyway; this is for the first, or the first after
    /// [`release_host_buffers`](Self::release_host_buffers)). Call it once the tag's memory is allocated,
    /// a model's weights loaded, say. The pinning runs without the allocator's lock, on the threads
    /// `pinned_num_register_threads` says; other threads allocate meanwhile, and the tag stays awake (a
    /// sleep of it meanwhile pins its own). Returns the bytes pinned: 0 for a tag not awake or never
    /// named, with nothing live, holding enough already, or being prepared by another thread. The memory
    /// counts in `host_kept_bytes`. Refused during a CUDA graph capture.
    pub fn prepare_sleep(&self, tag: &str) -> Result<u64, Error> {
        let begun = self.with_tags(|strategy| strategy.begin_prepare_sleep(tag))?;
        self.run_phases(begun, S::finish_prepare_sleep)
    }

    /// The tags asleep and the bytes each gave back, by name.
    pub fn asleep_tags(&self) -> Vec<(String, u64)> {
        self.with_strategy(|strategy| strategy.asleep_tags())
    }

    /// Frees the page-locked host memory tags keep for their next sleep (`tag`'s alone, or every tag's
    /// with `None`), never the bytes of a sleeping tag; returns the bytes freed
    /// ([`Tags::release_host_buffers`]). The memory is freed after the lock is let go of.
    pub fn release_host_buffers(&self, tag: Option<&str>) -> Result<u64, Error> {
        self.with_tags(|strategy| strategy.release_host_buffers(tag))
    }

    /// Copies into `out` the bytes from `addr` on that a sleeping tag kept in host memory (what they will
    /// be again at its wake), and names the tag: a sleeping model's weights read without waking it, as
    /// torch_memory_saver's `get_cpu_backup` reads them. `None` for memory of no sleeping tag (awake,
    /// untagged or not cuvmm's: read the device memory itself), `out` untouched. The range must lie inside
    /// the blocks live when the tag fell asleep, and the sleep must have kept their bytes, else
    /// [`Error::NotKept`]; [`Error::TagBusy`] while a sleep or wake copies them. The bytes are copied under
    /// the allocator's lock.
    pub fn read_kept(&self, addr: u64, out: &mut [u8]) -> Result<Option<String>, Error> {
        self.with_strategy(|strategy| strategy.read_kept(addr, out))
    }

    /// `f` under the strategy's lock; then, with the lock let go of, frees the host memory the tags let go
    /// of meanwhile ([`Tags::take_freed_host`]): `cuMemFreeHost` may wait for the device, and the threads
    /// that allocate should not wait with it.
    fn with_tags<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        let (out, freed) = self.with_strategy(|strategy| {
            let out = f(strategy);
            (out, strategy.take_freed_host())
        });
        drop(freed);
        out
    }

    /// Every tag named so far, with its state, its live bytes, the bytes its wake would map and the host
    /// memory it holds ([`Tags::tag_infos`]).
    pub fn tags(&self) -> Vec<TagInfo> {
        self.with_strategy(|strategy| strategy.tag_infos())
    }
}
