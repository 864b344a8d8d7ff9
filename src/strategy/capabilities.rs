//! What only some strategies can do, a trait each: a [`Strategy`](super::Strategy) implements the ones it
//! has, and the facade's methods for each ask for it by bound (`impl<S: Strategy + GraphPools>
//! Allocator<S>`), so no strategy answers "unsupported" at run time for something it never had. cuvmm's [`Expandable`](crate::expandable::Expandable)
//! has them all; the laboratory's models of PyTorch's allocators have [`Snapshots`] and [`DeviceBytes`];
//! CUDA's own pool has none. Code that holds a `dyn Strategy` asks for the three it may need through
//! [`Strategy::stream_uses`](super::Strategy::stream_uses), [`Strategy::snapshots`](super::Strategy::snapshots)
//! and [`Strategy::device_bytes`](super::Strategy::device_bytes). (They are not subtraits of `Strategy`,
//! which names them in those methods: each file reads only the other's names, never back.)

use crate::driver::{HostMemory, StreamId};
use crate::strategy::error::Error;
use crate::strategy::graph_pool::{GraphPool, StreamFilter};
use crate::strategy::history::{TraceAction, TraceTracker};
use crate::strategy::sharing::{SharedMemory, SharedPart};
use crate::strategy::snapshot::MemorySnapshot;
use crate::strategy::tags::{Begun, TagCopy, TagInfo};
use std::os::fd::BorrowedFd;

/// Blocks used on more streams than their own.
pub trait StreamUses {
    /// Records that the live allocation at `addr` is also used by work queued on `stream` (PyTorch's
    /// `recordStream`): when it is freed, its memory is reused only once that work has completed.
    fn record_stream(&mut self, addr: u64, stream: StreamId) -> Result<(), Error>;
}

/// CUDA graphs' private pools (PyTorch's `beginAllocateToPool` and the rest). See
/// [`crate::strategy::graph_pool`].
pub trait GraphPools {
    /// From now on, allocations on the streams `filter` accepts come from the private pool `pool` (called
    /// before a CUDA graph capture begins). Refused as [`ready_to_begin_pool`](GraphPools::ready_to_begin_pool)
    /// says.
    fn begin_allocate_to_pool(
        &mut self,
        pool: GraphPool,
        filter: StreamFilter,
    ) -> Result<(), Error>;

    /// Whether a pool may begin now. Not while a sleep's or a wake's copies, or a preparation's pinning,
    /// run without the caller's lock ([`Error::TagBusy`], [`Tags`]): they pin host memory, which a global-mode capture forbids on every
    /// thread (a capture begun meanwhile would be invalidated), and then wait for an event. The facade waits
    /// for them to end. `Ok` for a strategy without tags.
    fn ready_to_begin_pool(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Allocations stop going to `pool` (after the capture ended); its memory stays the pool's.
    fn end_allocate_to_pool(&mut self, pool: GraphPool) -> Result<(), Error>;

    /// From now on the caller marks every capture ([`mark_capture`](GraphPools::mark_capture)), so a pool
    /// begun without a mark is not a capture: its allocations may wait for events, release the cache and
    /// compact (PyTorch's `use_mem_pool`, and cudagraph trees' warm-up runs). Until then every pool being
    /// allocated to counts as a capture. Idempotent.
    fn mark_captures(&mut self);

    /// A capture begins (`begun`: after its pool was begun and the capture began) or ends (after the
    /// capture ended, before its pool ends): PyTorch's `markCaptureBegin` / `markCaptureEnd`. Marks
    /// captures from now on ([`mark_captures`](GraphPools::mark_captures)).
    fn mark_capture(&mut self, begun: bool);

    /// A graph that used `pool` is gone (PyTorch's `releasePool`, once per begin): once none is left, the
    /// pool's memory goes back to common use as its blocks are freed. A pool released while still being
    /// allocated to goes at its end.
    fn release_pool(&mut self, pool: GraphPool) -> Result<(), Error>;

    /// One more user of `pool` without allocating to it (PyTorch's `createOrIncrefPool`): it stays live
    /// until [`release_pool`](GraphPools::release_pool) has been called once more.
    fn incref_pool(&mut self, pool: GraphPool) -> Result<(), Error>;
}

/// Tagged memory that sleeps and wakes (docs/allocator.md, "Sleep and wake"). A sleep or wake that copies
/// bytes runs in phases, so that a caller holding a lock lets go of it while they cross the link:
/// [`begin_sleep`](Tags::begin_sleep) under the lock, [`TagCopy::run`] without it,
/// [`finish_sleep`](Tags::finish_sleep) under it again (the same for a wake); [`sleep`](Tags::sleep) and
/// [`wake`](Tags::wake) run the three in a row.
pub trait Tags {
    /// Allocates `size` bytes for use on `stream` under the tag `tag`, whose memory
    /// [`sleep`](Tags::sleep) can give back and [`wake`](Tags::wake) map again at the same addresses.
    /// Tagged memory shares no page with other memory.
    fn alloc_tagged(&mut self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error>;

    /// Puts `tag` to sleep: waits for the streams that used its memory, keeps its bytes on the host if
    /// `keep`, and gives its physical memory back; its addresses stay reserved. Returns the bytes unmapped.
    /// Idempotent.
    fn sleep(&mut self, tag: &str, keep: bool) -> Result<u64, Error>;

    /// Wakes `tag`: maps memory at the same addresses and puts back the bytes kept. Idempotent.
    fn wake(&mut self, tag: &str) -> Result<(), Error>;

    /// The first phase of [`sleep`](Tags::sleep): the whole sleep ([`Begun::Done`]), or, when it keeps
    /// bytes, the copies to run without the caller's lock and hand to [`finish_sleep`](Tags::finish_sleep)
    /// ([`Begun::Copy`]). Until then the tag is busy ([`Error::TagBusy`] to another sleep or wake).
    fn begin_sleep(&mut self, tag: &str, keep: bool) -> Result<Begun<u64>, Error>;

    /// The last phase of a sleep that kept bytes, with its copies run: unmaps the tag's pages and returns
    /// the bytes unmapped, or, with a copy failed, leaves the tag awake and returns the error.
    fn finish_sleep(&mut self, copy: TagCopy) -> Result<u64, Error>;

    /// The first phase of [`wake`](Tags::wake): maps the tag's pages, then the whole wake
    /// ([`Begun::Done`]) or the copies of its kept bytes to run without the caller's lock and hand to
    /// [`finish_wake`](Tags::finish_wake) ([`Begun::Copy`]).
    fn begin_wake(&mut self, tag: &str) -> Result<Begun<()>, Error>;

    /// The last phase of a wake that puts bytes back, with its copies run: the tag is awake, or, with a
    /// copy failed, stays asleep for a second wake and the error is returned.
    fn finish_wake(&mut self, copy: TagCopy) -> Result<(), Error>;

    /// The first phase of pinning, ahead of a sleep, the host memory `tag`'s sleep with its bytes would
    /// copy into, so that the sleep pins nothing: the whole call ([`Begun::Done`], with 0 where there is
    /// nothing to pin), or the pinning to run without the caller's lock and hand to
    /// [`finish_prepare_sleep`](Tags::finish_prepare_sleep) ([`Begun::Copy`]). The tag stays awake
    /// meanwhile.
    fn begin_prepare_sleep(&mut self, tag: &str) -> Result<Begun<u64>, Error>;

    /// The last phase of a preparation, with its pinning run: the pieces are the tag's buffers for its
    /// next sleep (unless it fell asleep meanwhile); returns the bytes pinned for it, or the failure.
    fn finish_prepare_sleep(&mut self, copy: TagCopy) -> Result<u64, Error>;

    /// The tags asleep and the bytes each gave back, by name.
    fn asleep_tags(&self) -> Vec<(String, u64)>;

    /// Lets go of the host memory tags keep for their next sleep (`tag`'s, or every tag's with `None`),
    /// never the bytes of a sleeping tag; returns its bytes. It is freed when the caller drops what
    /// [`take_freed_host`](Tags::take_freed_host) gives it.
    fn release_host_buffers(&mut self, tag: Option<&str>) -> Result<u64, Error>;

    /// Copies into `out` the bytes from `addr` on that a sleeping tag kept on the host, and names the tag;
    /// `None` for memory of no sleeping tag (its bytes are on the device). [`Error::NotKept`] where the
    /// sleep kept no bytes, [`Error::TagBusy`] while they are being copied.
    fn read_kept(&self, addr: u64, out: &mut [u8]) -> Result<Option<String>, Error>;

    /// The host memory let go of since the last call (buffers released, or replaced or given up by a
    /// sleep's or a wake's phases), for a caller holding a lock to drop after letting go of it: freeing
    /// page-locked memory may wait for the device. [`sleep`](Tags::sleep) and [`wake`](Tags::wake) free
    /// theirs themselves.
    fn take_freed_host(&mut self) -> Vec<HostMemory>;

    /// Every tag named so far: its state, live bytes, the bytes its wake would map and its host memory.
    fn tag_infos(&self) -> Vec<TagInfo>;
}

/// Memory shared with other processes. See [`crate::strategy::sharing`].
pub trait Sharing {
    /// Exports the memory under the live allocation that starts at `addr`, for another process to map
    /// with [`open_shared`](Sharing::open_shared): the whole mappings that cover it, each handle as a file
    /// descriptor. The allocation must stay live while the other process uses it (PyTorch's IPC reference
    /// counting sees to that).
    fn share(&mut self, addr: u64) -> Result<SharedMemory, Error>;

    /// Maps memory another process shared ([`share`](Sharing::share)), the parts back to back in a range of
    /// its own, readable and writable; returns the range's start. The descriptors stay the caller's.
    fn open_shared(&mut self, parts: &[SharedPart<BorrowedFd<'_>>]) -> Result<u64, Error>;

    /// Unmaps shared memory that [`open_shared`](Sharing::open_shared) mapped at `addr` and gives its
    /// handles and addresses back. The caller's work on it must have finished.
    fn close_shared(&mut self, addr: u64) -> Result<(), Error>;
}

/// Other devices reaching this one's memory.
pub trait Peers {
    /// Lets device `peer` read and write every range mapped now and every one mapped later (PyTorch's
    /// `enablePeerAccess` for expandable segments).
    fn add_peer(&mut self, peer: usize) -> Result<(), Error>;
}

/// Segments, blocks and recorded events, as PyTorch's `torch.cuda.memory._snapshot()` gives them.
pub trait Snapshots {
    /// The allocator's segments and blocks now, and the events recorded since
    /// [`record_history`](Snapshots::record_history) turned recording on.
    fn snapshot(&self) -> Result<MemorySnapshot, Error>;

    /// Starts recording events for [`snapshot`](Snapshots::snapshot), keeping the last `max_entries`
    /// (PyTorch's `_record_memory_history(max_entries=...)`), or stops and forgets them with `None`.
    /// Recording is off until this is called; off, it costs nothing measurable.
    fn record_history(&mut self, max_entries: Option<usize>) -> Result<(), Error>;

    /// Calls `tracker` with every event from now on, recording or not (PyTorch's
    /// `attachAllocatorTraceTracker`): on the thread of the event, under the allocator's lock, so it must not
    /// call the allocator ([`TraceTracker`]).
    fn attach_trace_tracker(&mut self, tracker: TraceTracker) -> Result<(), Error>;

    /// Records `action` of memory of `pool` that the allocator does not hold itself but reports as its own
    /// (the segments and blocks of a pool with an allocator of its own, which PyTorch's allocator keeps and
    /// records with its other events): in the history, if recording, and to the trackers, in order with the
    /// allocator's own events.
    fn record_event(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        pool: GraphPool,
    );
}

/// The bytes of allocated memory, through the driver (`--touch` replays and tests; not a fast path).
pub trait DeviceBytes {
    /// Sets `len` bytes from `addr` (inside a live allocation) to `value` on the device, through the
    /// driver's [`memset_d8`](crate::Driver::memset_d8).
    fn memset(&mut self, addr: u64, len: u64, value: u8) -> Result<(), Error>;

    /// Copies `out.len()` bytes from `addr` (inside a live allocation) to `out`, through the driver's
    /// [`copy_to_host`](crate::Driver::copy_to_host).
    fn copy_to_host(&mut self, addr: u64, out: &mut [u8]) -> Result<(), Error>;
}

/// PyTorch's controls of its allocator's accounting and limit.
pub trait Controls {
    /// Sets every statistic's peak to its current value (PyTorch's `reset_peak_memory_stats`).
    fn reset_peak_stats(&mut self) -> Result<(), Error>;

    /// Sets every cumulative count (each statistic's `allocated` and `freed`, retries, OOMs, device
    /// allocations and frees, synchronizations) to 0 (PyTorch's `reset_accumulated_memory_stats`).
    fn reset_accumulated_stats(&mut self) -> Result<(), Error>;

    /// Limits the memory the allocator may reserve to `fraction` (in [0, 1]) of the device's, from now on
    /// (PyTorch's `set_per_process_memory_fraction`); memory already reserved above it is not taken back.
    fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), Error>;

    /// The memory limit as a fraction of the device's memory; `None` when no limit is set.
    fn memory_fraction(&self) -> Option<f64>;

    /// Sets the bytes of the device that a request's growth leaves free, from now on
    /// ([`Config::device_margin`](crate::Config::device_margin); 0: none). Memory already reserved stays.
    fn set_device_margin(&mut self, bytes: u64);

    /// Gives back the idle pages stranded in multi-page handles that live allocations still touch, under
    /// any compaction policy: each such handle's live part is re-created as single pages at the same
    /// addresses, its bytes moved through host memory after one device synchronization (what
    /// `compaction:split` does under pressure, done once, now). By calling it the program says that no
    /// other thread launches work on this allocator's memory until it returns. Returns the bytes given
    /// back; refused while a CUDA graph is being captured.
    fn release_stranded(&mut self) -> Result<u64, Error>;
}
