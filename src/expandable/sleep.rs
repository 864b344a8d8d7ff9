//! Sleep and wake: tagged memory gives its physical pages back and keeps its virtual addresses.
//!
//! An allocation made under a *tag* (`alloc_tagged`) goes to segments of that tag only (the tag is part of
//! the segment key, with the stream, the pool and the CUDA graph pool), so a tag's pages are never shared
//! with anyone else's blocks and are never borrowed by another stream. `sleep(tag, keep)`:
//! 1. waits for the streams that used the tag's memory: each segment's stream, the streams recorded on its
//!    live blocks and those of its pending frees; an event query first, a synchronization only of a stream
//!    still busy (never during a capture, which is refused). A tag with memory of a CUDA graph pool waits
//!    for the whole device: a graph replays on any stream, unseen by the allocator;
//! 2. with `keep`, copies each live block's bytes to the tag's host memory (`kept.rs`): large asynchronous
//!    copies on the driver's copy stream into page-locked pieces kept across cycles, run *without the
//!    allocator's lock* by the facade (`begin_sleep` .. [`TagCopy::run`] .. `finish_sleep`);
//! 3. marks the tag asleep, then unmaps every page of its segments and releases the handles (a handle whose
//!    release fails is pooled for others).
//!
//! While a tag sleeps, or its bytes are being copied, its segments are *pinned* (no compaction, no
//! lending, no release of their idle pages), and no allocation is placed in them (an allocation under it is
//! [`Error::TagAsleep`]). A free of one of its blocks succeeds and counts at once (no longer allocated, as
//! PyTorch counts a free); the block stays pending until the tag is awake again (the wake puts back the
//! bytes of the blocks the tag fell asleep with, laid out by them), then its memory is free; a program's
//! tensor dropped while its tag sleeps is not lost. A sleep or wake of a tag being
//! copied is [`Error::TagBusy`]. `wake(tag)` maps pages under the same live blocks, and the pages of
//! its segments of live CUDA graph pools that were mapped when it fell asleep (a graph captured in the tag
//! replays there: the rule that memory a live graph uses is never unmapped has this one exception, an
//! explicit sleep of its tag, and the program must not replay the graph while the tag sleeps), puts back
//! the kept bytes, and marks the tag awake. Both are idempotent.
//!
//! Failures (docs/allocator.md, "Failures with side effects"): a failure before step 3 changes nothing (a
//! failed copy, host allocation, event or wait leaves the tag awake with its bytes on the device, and the
//! host memory it had). A sleep that fails while unmapping leaves the tag *sleeping* with some pages still
//! mapped: a second sleep unmaps the rest, a wake maps the missing ones. A wake that fails (out of memory, a
//! failed copy) leaves the tag sleeping with some pages mapped: a second wake maps the rest and copies the
//! kept bytes again, a sleep unmaps them again. The kept bytes stay until the wake that succeeds; then the
//! host memory stays as buffers for the next sleep (unless `keep_host_buffers` is off, or
//! [`release_host_buffers`](Expandable::release_host_buffers) frees them).
//! [`prepare_sleep`](Expandable::prepare_sleep) pins those buffers ahead of a first sleep, the tag awake.

use super::Expandable;
use super::compacting::{Compacting, Wait};
use super::kept;
use super::segment::TagId;
use super::streams::synchronize_device;
use crate::driver::{CopyDirection, Driver, HostMemory, PhysPage, StreamId};
use crate::strategy::error::Error;
use crate::strategy::tags::{Begun, TagCopy, TagInfo};
use std::ops::Range;

impl<D: Driver> Expandable<D> {
    /// Allocates `size` bytes on `stream` under the tag `tag`: in segments of that tag only, so that
    /// [`sleep`](Self::sleep) can give their pages back without touching other memory. Refused with
    /// [`Error::TagAsleep`] while the tag sleeps (or its bytes are being copied).
    pub fn alloc_tagged(&mut self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        let id = self.tags.id(tag);
        if !self.tags.is_awake(id) {
            return Err(self.tags.asleep_error("alloc", id));
        }
        self.alloc_in(size, stream, Some(id))
    }

    /// Puts `tag` to sleep: waits for the streams that used its memory, copies its live blocks' bytes to
    /// host memory if `keep`, then unmaps its pages and releases their physical memory; its virtual
    /// addresses stay reserved for it. Returns the bytes unmapped by this call. A tag already asleep
    /// returns 0 (after finishing a sleep that failed half way); a tag never named falls asleep with no
    /// memory. Refused during a capture ([`Error::CaptureUnderway`]), while pages of the tag's chunks are
    /// lent elsewhere under memory pressure ([`Error::TagPagesLent`]), and while another sleep or wake
    /// copies its bytes ([`Error::TagBusy`]).
    ///
    /// The copies run with `&mut self` held; the facade (`Allocator::sleep`) runs them without its lock.
    pub fn sleep(&mut self, tag: &str, keep: bool) -> Result<u64, Error> {
        let begun = self.begin_sleep(tag, keep);
        self.run_phases(begun, |a, copy| a.finish_sleep(copy))
    }

    /// Wakes `tag`: maps pages under its live blocks at the same addresses and puts back the bytes the
    /// sleep kept. A tag awake (or never named) is left as it is. Refused during a capture, and while
    /// another sleep or wake copies its bytes. On failure (out of memory, say) the tag stays asleep and a
    /// second wake finishes.
    pub fn wake(&mut self, tag: &str) -> Result<(), Error> {
        let begun = self.begin_wake(tag);
        self.run_phases(begun, |a, copy| a.finish_wake(copy))
    }

    /// The rest of a sleep, wake or preparation begun (`begun`) with `&mut self` held: the job run, then
    /// `finish`; the host memory let go of meanwhile freed.
    fn run_phases<T>(
        &mut self,
        begun: Result<Begun<T>, Error>,
        finish: impl FnOnce(&mut Self, TagCopy) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let done = match begun {
            Ok(Begun::Done(out)) => Ok(out),
            Ok(Begun::Copy(mut copy)) => {
                copy.run();
                finish(self, *copy)
            }
            Err(err) => Err(err),
        };
        drop(self.take_freed_host());
        done
    }

    /// The first part of [`sleep`](Self::sleep), under the caller's lock: the waits, and for a sleep that
    /// keeps bytes the copies to run ([`TagCopy::run`], without the lock) and hand to
    /// [`finish_sleep`](Self::finish_sleep); else the whole sleep.
    pub fn begin_sleep(&mut self, tag: &str, keep: bool) -> Result<Begun<u64>, Error> {
        if self.graphs.routing() {
            return Err(Error::CaptureUnderway { operation: "sleep" });
        }
        let id = self.tags.id(tag);
        if self.tags.is_copying(id) {
            return Err(self.tags.busy_error("sleep", id));
        }
        let slots = self.segments.of_tag(id);
        if self.tags.is_awake(id) {
            let lent = self.supply.lent_from(&slots);
            if lent > 0 {
                return Err(Error::TagPagesLent {
                    tag: tag.to_owned(),
                    pages: lent,
                });
            }
            self.wait_for_tag(&slots)?;
            let blocks = self.live_blocks(&slots);
            let wake = self.wake_ranges(&slots, &blocks);
            if keep && !blocks.is_empty() {
                let copy = self.start_copy(id, CopyDirection::ToHost, &blocks)?;
                self.tags.fall_asleep(id, blocks, wake, true);
                tracing::debug!(
                    tag,
                    bytes = copy.moved_bytes(),
                    "cuvmm: copying a tag to the host"
                );
                return Ok(Begun::Copy(Box::new(copy)));
            }
            self.tags.fall_asleep(id, blocks, wake, false);
        }
        self.unmap_and_sleep(id, &slots).map(Begun::Done)
    }

    /// The last part of a sleep that kept bytes, under the caller's lock: with the copies done, unmaps the
    /// tag's pages (as [`sleep`](Self::sleep)); with a copy failed, the tag is awake again, its bytes on the
    /// device, and the error is returned.
    pub fn finish_sleep(&mut self, copy: TagCopy) -> Result<u64, Error> {
        let (id, pieces, result) = copy.into_outcome();
        let id = TagId(id);
        if let Err(err) = result {
            self.tags.sleep_failed(id, pieces);
            tracing::warn!(tag = self.tags.name(id), %err, "cuvmm: a sleep's copies failed; the tag stays awake");
            self.free_blocks_freed_asleep(id);
            return Err(err.into());
        }
        self.tags.kept(id, pieces);
        let slots = self.segments.of_tag(id);
        self.unmap_and_sleep(id, &slots)
    }

    /// The first part of [`wake`](Self::wake), under the caller's lock: maps the tag's pages, and returns
    /// the copies of its kept bytes to run ([`TagCopy::run`], without the lock) and hand to
    /// [`finish_wake`](Self::finish_wake); else the whole wake.
    pub fn begin_wake(&mut self, tag: &str) -> Result<Begun<()>, Error> {
        let Some(id) = self.tags.find(tag) else {
            return Ok(Begun::Done(()));
        };
        if self.tags.is_awake(id) {
            return Ok(Begun::Done(()));
        }
        if self.tags.is_copying(id) {
            return Err(self.tags.busy_error("wake", id));
        }
        if self.graphs.routing() {
            return Err(Error::CaptureUnderway { operation: "wake" });
        }
        self.tags.start_waking(id);
        let wake = self.tags.wake_ranges(id).to_vec();
        self.map_blocks(&wake)?;
        if self.tags.holds_bytes(id) {
            let blocks = self.tags.blocks(id).to_vec();
            let copy = self.start_copy(id, CopyDirection::FromHost, &blocks)?;
            self.tags.set_copying(id);
            tracing::debug!(tag, bytes = copy.moved_bytes(), "cuvmm: copying a tag back");
            return Ok(Begun::Copy(Box::new(copy)));
        }
        self.tags.woke(id, None, self.config.keep_host_buffers);
        tracing::info!(tag, "cuvmm: tag awake");
        self.free_blocks_freed_asleep(id);
        Ok(Begun::Done(()))
    }

    /// The last part of a wake that puts bytes back, under the caller's lock: with the copies done the tag
    /// is awake; with a copy failed it stays sleeping, its pages mapped and its bytes kept, for a second
    /// wake.
    pub fn finish_wake(&mut self, copy: TagCopy) -> Result<(), Error> {
        let (id, pieces, result) = copy.into_outcome();
        let id = TagId(id);
        if let Err(err) = result {
            self.tags.wake_failed(id, pieces);
            tracing::warn!(tag = self.tags.name(id), %err, "cuvmm: a wake's copies failed; the tag stays asleep");
            return Err(err.into());
        }
        self.tags
            .woke(id, Some(pieces), self.config.keep_host_buffers);
        tracing::info!(tag = self.tags.name(id), "cuvmm: tag awake");
        self.free_blocks_freed_asleep(id);
        Ok(())
    }

    /// Pins the host memory the next sleep of `tag` with its bytes copies into, so that sleep pins
    /// nothing and runs at the link's speed from its first cycle: the pieces its live blocks need now
    /// (`kept.rs`), kept as the buffers a wake leaves. Returns the bytes pinned by this call: 0 for a tag
    /// not awake, never named, with no live block or holding enough already, and while another
    /// preparation of it runs.
    ///
    /// The pinning runs with `&mut self` held; the facade (`Allocator::prepare_sleep`) runs it without
    /// its lock, and the tag allocates and frees meanwhile (a block allocated after it began may leave
    /// the sleep a piece to pin).
    pub fn prepare_sleep(&mut self, tag: &str) -> Result<u64, Error> {
        let begun = self.begin_prepare_sleep(tag);
        self.run_phases(begun, |a, copy| a.finish_prepare_sleep(copy))
    }

    /// The first part of [`prepare_sleep`](Self::prepare_sleep), under the caller's lock: the pinning to
    /// run ([`TagCopy::run`], a job that allocates its pieces and copies nothing) and hand to
    /// [`finish_prepare_sleep`](Self::finish_prepare_sleep); else the whole call. The tag stays awake: a
    /// sleep of it meanwhile pins its own pieces, and those of the preparation are freed.
    pub fn begin_prepare_sleep(&mut self, tag: &str) -> Result<Begun<u64>, Error> {
        if self.graphs.routing() {
            // Pinning host memory is not among the calls CUDA allows during a capture.
            return Err(Error::CaptureUnderway {
                operation: "prepare_sleep",
            });
        }
        let Some(id) = self.tags.find(tag) else {
            return Ok(Begun::Done(0));
        };
        if !self.tags.is_awake(id) || self.tags.is_preparing(id) {
            return Ok(Begun::Done(0));
        }
        let blocks = self.live_blocks(&self.segments.of_tag(id));
        if blocks.is_empty() {
            return Ok(Begun::Done(0));
        }
        let held = self.tags.lend_to_prepare(id);
        let (mut plan, pieces) = match self.plan_copies(CopyDirection::ToHost, &blocks, held) {
            Ok(planned) => planned,
            Err((err, held)) => {
                self.tags.prepared(id, held);
                return Err(err.into());
            }
        };
        if !plan.allocate.contains(&true) {
            self.tags
                .prepared(id, pieces.into_iter().flatten().collect());
            return Ok(Begun::Done(0));
        }
        // Pieces only: the copies are the sleep's.
        plan.copies.clear();
        let bytes = plan.pieces.iter().sum();
        match self.driver.start_copies(plan) {
            Ok(job) => {
                self.tags.host_preparing_bytes(id, bytes);
                let copy = TagCopy::new(id.0, self.tags.name(id), job, pieces);
                tracing::debug!(
                    tag,
                    bytes = copy.pinned_bytes(),
                    "cuvmm: pinning host memory ahead of a sleep"
                );
                Ok(Begun::Copy(Box::new(copy)))
            }
            Err(err) => {
                self.tags
                    .prepared(id, pieces.into_iter().flatten().collect());
                Err(err.into())
            }
        }
    }

    /// The last part of [`prepare_sleep`](Self::prepare_sleep), under the caller's lock, with the pinning
    /// run: the pieces become the tag's buffers for its next sleep (those pinned before a failure too),
    /// unless it fell asleep meanwhile. Returns the bytes pinned for it, or the failure.
    pub fn finish_prepare_sleep(&mut self, copy: TagCopy) -> Result<u64, Error> {
        let pinned = copy.pinned_bytes();
        let (id, pieces, result) = copy.into_outcome();
        let kept = self.tags.prepared(TagId(id), pieces);
        result?;
        Ok(if kept { pinned } else { 0 })
    }

    /// The live blocks `(address, size)` of the segments `slots`, in segment and address order.
    fn live_blocks(&self, slots: &[usize]) -> Vec<(u64, u64)> {
        (slots.iter())
            .flat_map(|&slot| self.segments.at(slot).blocks())
            .filter(|(_, b)| b.is_live())
            .map(|(addr, b)| (addr, b.size))
            .collect()
    }

    /// Makes free the blocks of tag `id`, awake again, that the program freed while it was not (pending
    /// since, waiting for no event).
    fn free_blocks_freed_asleep(&mut self, id: TagId) {
        for addr in self.tags.take_freed_blocks(id) {
            // A pending block keeps its segment (`check_invariants()`).
            if let Some(slot) = self.segments.slot_of(addr) {
                self.segments.release_parked(&mut self.books, slot, addr);
            }
        }
    }

    /// Lets go of the host memory kept for the next sleep of `tag` (of every tag with `None`): never bytes
    /// a sleeping tag keeps. Returns its bytes; the memory is freed when the caller drops what
    /// [`take_freed_host`](Self::take_freed_host) gives it. [`Error::TagBusy`] for a tag whose bytes are
    /// being copied (with `None`, such a tag is left out). Refused during a capture
    /// ([`Error::CaptureUnderway`]): freeing page-locked memory is an implicit synchronization, which
    /// CUDA forbids while a graph is captured (it would invalidate the capture).
    pub fn release_host_buffers(&mut self, tag: Option<&str>) -> Result<u64, Error> {
        if self.graphs.routing() {
            return Err(Error::CaptureUnderway {
                operation: "release_host_buffers",
            });
        }
        let ids: Vec<TagId> = match tag {
            Some(name) => match self.tags.find(name) {
                Some(id) if self.tags.is_copying(id) => {
                    return Err(self.tags.busy_error("release_host_buffers", id));
                }
                Some(id) => vec![id],
                None => Vec::new(),
            },
            None => self.tags.ids().collect(),
        };
        Ok(ids.into_iter().map(|id| self.tags.release_host(id)).sum())
    }

    /// Copies into `out` the bytes `[addr, addr + out.len())` that a sleeping tag kept on the host: what
    /// that memory will hold again at the wake. Returns the tag's name; `None` for memory of no sleeping
    /// tag (under a tag awake, under none, or not this allocator's), whose bytes are on the device, with
    /// `out` left as it was. [`Error::NotKept`] for a sleeping tag's memory whose bytes its sleep did not
    /// keep (see there); [`Error::TagBusy`] while a sleep or wake copies the tag's bytes.
    pub fn read_kept(&self, addr: u64, out: &mut [u8]) -> Result<Option<String>, Error> {
        let Some(id) = (self.segments.slot_of(addr)).and_then(|slot| self.segments.at(slot).tag)
        else {
            return Ok(None);
        };
        if self.tags.is_awake(id) {
            return Ok(None);
        }
        if self.tags.is_copying(id) {
            return Err(self.tags.busy_error("read_kept", id));
        }
        let len = out.len() as u64;
        let read = kept::host_offset(self.tags.blocks(id), addr, len)
            .is_some_and(|host| (self.tags).read_kept(id, host, self.config.sleep_copy, out));
        if !read {
            return Err(Error::NotKept {
                tag: self.tags.name(id).to_owned(),
                addr,
                len,
            });
        }
        Ok(Some(self.tags.name(id).to_owned()))
    }

    /// The host memory the tags let go of since the last call (buffers released or replaced, by
    /// [`release_host_buffers`](Self::release_host_buffers), a sleep or a wake's first or last phase), for
    /// the caller to drop after letting go of its lock: freeing page-locked memory may wait for the
    /// device, and other threads should not wait with it. [`sleep`](Self::sleep) and
    /// [`wake`](Self::wake) free theirs before they return.
    pub fn take_freed_host(&mut self) -> Vec<HostMemory> {
        self.tags.take_freed()
    }

    /// The tags asleep (or half way) and the bytes each would map at its wake, by name.
    pub fn asleep_tags(&self) -> Vec<(String, u64)> {
        self.tags.asleep_list(&self.segments, self.page_size)
    }

    /// Every tag named so far: its state, live bytes, the bytes its wake would map and its host memory.
    pub fn tag_infos(&self) -> Vec<TagInfo> {
        (self.tags.ids())
            .map(|id| self.tags.info(id, &self.segments, self.page_size))
            .collect()
    }

    /// The copies of `blocks` of tag `id` in `direction`, started: its host memory lent to them, given
    /// back if the driver refuses them.
    fn start_copy(
        &mut self,
        id: TagId,
        direction: CopyDirection,
        blocks: &[(u64, u64)],
    ) -> Result<TagCopy, Error> {
        let held = self.tags.lend_host(id);
        let (plan, pieces) = match self.plan_copies(direction, blocks, held) {
            Ok(planned) => planned,
            Err((err, held)) => {
                self.tags.unlend_host(id, held);
                return Err(err.into());
            }
        };
        let bytes = plan.pieces.iter().sum();
        match self.driver.start_copies(plan) {
            Ok(job) => {
                self.tags.host_lent_bytes(id, bytes);
                Ok(TagCopy::new(id.0, self.tags.name(id), job, pieces))
            }
            Err(err) => {
                self.tags
                    .unlend_host(id, pieces.into_iter().flatten().collect());
                Err(err.into())
            }
        }
    }

    /// The copies of `blocks` in `direction` over the pieces `held` ([`kept::plan`]), the pieces the plan
    /// does not use let go of, for the caller to free after its lock.
    fn plan_copies(
        &mut self,
        direction: CopyDirection,
        blocks: &[(u64, u64)],
        held: Vec<HostMemory>,
    ) -> Result<kept::Planned, kept::Refused> {
        let mut freed = Vec::new();
        let (piece, pinning) = (self.config.sleep_copy, self.config.host_pinning);
        let planned = kept::plan(direction, blocks, piece, pinning, held, &mut freed);
        self.tags.free_later(freed);
        planned
    }

    /// Unmaps the pages of tag `id`'s segments `slots` and marks it asleep; returns the bytes unmapped.
    fn unmap_and_sleep(&mut self, id: TagId, slots: &[usize]) -> Result<u64, Error> {
        let unmapped = self.unmap_tag(slots)?;
        self.tags.set_asleep(id);
        tracing::info!(tag = self.tags.name(id), unmapped, "cuvmm: tag asleep");
        Ok(unmapped)
    }

    /// What the wake of a tag whose segments are `slots` and live blocks `blocks` maps: the pages under the
    /// blocks, and in a segment of a live CUDA graph pool every page mapped now (a graph replays there),
    /// merged into disjoint page-aligned ranges `(address, bytes)` in segment and address order.
    fn wake_ranges(&self, slots: &[usize], blocks: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for &slot in slots {
            let seg = self.segments.at(slot);
            let mut pages: Vec<Range<usize>> = (blocks.iter())
                .filter(|&&(addr, _)| self.segments.slot_of(addr) == Some(slot))
                .map(|&(addr, size)| seg.pages_of(addr, size))
                .collect();
            if seg.graph.is_some_and(|pool| self.graphs.pool_is_live(pool)) {
                pages.extend(seg.pages.mapped_runs(0..seg.pages.len()));
            }
            pages.sort_unstable_by_key(|r| r.start);
            let mut merged: Vec<Range<usize>> = Vec::with_capacity(pages.len());
            for run in pages.into_iter().filter(|r| !r.is_empty()) {
                match merged.last_mut() {
                    Some(last) if run.start <= last.end => last.end = last.end.max(run.end),
                    _ => merged.push(run),
                }
            }
            out.extend(
                merged
                    .into_iter()
                    .map(|r| (seg.page_addr(r.start), r.len() as u64 * self.page_size)),
            );
        }
        out
    }

    /// Waits for every stream that used the memory of the segments `slots`: their own streams, the
    /// streams recorded on their live blocks, and those their pending frees wait for. A stream an event
    /// query shows idle is not synchronized. Then frees the pending blocks whose events completed.
    ///
    /// Memory of a CUDA graph pool is used by the graph's replays, on whatever stream the program replays
    /// it (`torch.cuda.graph` captures on a side stream and replays on the current one), and no replay
    /// reaches the allocator: for a tag with such memory the whole device is synchronized instead.
    fn wait_for_tag(&mut self, slots: &[usize]) -> Result<(), Error> {
        if self.graphs.any_deferred() {
            self.parts().insert_deferred_events()?;
        }
        if slots
            .iter()
            .any(|&slot| self.segments.at(slot).graph.is_some())
        {
            synchronize_device(&mut self.driver, &mut self.books)?;
            self.poll_events()?;
            return Ok(());
        }
        let segments = &self.segments;
        let inside = |addr: u64| segments.slot_of(addr).is_some_and(|s| slots.contains(&s));
        let mut streams: Vec<StreamId> = (slots.iter())
            .filter(|&&slot| self.segments.at(slot).pages.mapped_count() > 0)
            .map(|&slot| self.segments.at(slot).stream)
            .collect();
        streams.extend(self.waits.streams_using(inside));
        streams.sort_unstable();
        streams.dedup();
        let mut compacting = Compacting::default();
        for stream in streams {
            let parts = (&mut self.driver, &mut self.books, &mut self.waits);
            if !compacting.stream_done(parts, stream, Wait::Query)? {
                let parts = (&mut self.driver, &mut self.books, &mut self.waits);
                Compacting::default().stream_done(parts, stream, Wait::Block)?;
            }
        }
        self.poll_events()?;
        Ok(())
    }

    /// Unmaps every mapped page of the segments `slots` (asleep, so pages under live blocks too) and
    /// releases the handles; a handle whose release fails is pooled, for others. Returns the bytes
    /// unmapped.
    fn unmap_tag(&mut self, slots: &[usize]) -> Result<u64, Error> {
        let mut unmapped = 0;
        for &slot in slots {
            let before = self.segments.at(slot).pages.mapped_count();
            let runs =
                (self.segments.at(slot).pages).mapped_runs(0..self.segments.at(slot).pages.len());
            for run in runs {
                let first = run.start;
                let mut out: Vec<PhysPage> = Vec::new();
                let (supply, mut parts) = self.supply_and_parts();
                let result = supply.unmap_idle_run(&mut parts, slot, run, &mut out);
                supply.release_unmapped(&mut parts, out);
                if let Err(err) = result {
                    if self.segments.at(slot).pages.is_mapped(first) {
                        // The unmap failed: the run is still mapped, for the next sleep or a wake.
                        unmapped += before - self.segments.at(slot).pages.mapped_count();
                        tracing::info!(unmapped, "cuvmm: sleep failed half way");
                        return Err(err);
                    }
                    tracing::warn!(%err, "cuvmm: sleep: releasing an unmapped chunk failed; pooled");
                }
            }
            unmapped += before - self.segments.at(slot).pages.mapped_count();
        }
        Ok(unmapped as u64 * self.page_size)
    }
}
