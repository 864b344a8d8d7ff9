//! Sleep and wake: tagged memory gives its physical pages back and keeps its virtual addresses.
//!
//! An allocation made under a *tag* (`alloc_tagged`) goes to segments of that tag only (the tag is part of
//! the segment key), so a tag's pages are never shared with anyone else's blocks and are never borrowed by
//! another stream. `sleep(tag, keep)`:
//! 1. waits for the streams that used the tag's memory: each segment's stream, the streams recorded on its
//!    live blocks and those of its pending frees; an event query first, a synchronization only of a stream
//!    still busy (never during a capture, which is refused);
//! 2. with `keep`, copies each live block's bytes to host memory;
//! 3. marks the tag asleep, then unmaps every page of its segments and releases the handles (a handle whose
//!    release fails is pooled for others).
//!
//! While a tag sleeps its segments are *pinned* (no compaction, no lending), no allocation is placed in
//! them (an allocation under a sleeping tag is refused), and a free of one of its blocks is refused.
//! `wake(tag)` maps pages under the same live blocks, puts back the kept bytes, and marks the tag awake.
//! Both are idempotent.
//!
//! Failures (docs/allocator.md, "Failures with side effects"): a failure before step 3 changes nothing. A
//! sleep that fails while unmapping leaves the tag *sleeping* with some pages still mapped: a second sleep
//! unmaps the rest, a wake maps the missing ones. A wake that fails leaves the tag sleeping with some pages
//! mapped: a second wake maps the rest and copies the kept bytes again, a sleep unmaps them again. The kept
//! bytes stay until the wake that succeeds.
//!
//! The kept bytes live in host memory from [`Driver::alloc_host`]: page-locked on CUDA (`cuMemHostAlloc`),
//! where the copies run at the link's speed (pageable memory ran 1.5 GB/s to the host and 7.7 GB/s back
//! on an H100 host, `docs/gpu-results.md`), ordinary memory where it cannot be locked. `cuMemcpyDtoH` is
//! synchronous, which a sleep wants anyway. Host memory that cannot be had at all is
//! [`DriverError::HostOutOfMemory`] before anything changed, not an abort.

use super::Expandable;
use super::compacting::{Compacting, Wait};
use crate::driver::{Driver, DriverError, HostMemory, PhysPage, StreamId};
use crate::strategy::error::Error;

impl<D: Driver> Expandable<D> {
    /// Allocates `size` bytes on `stream` under the tag `tag`: in segments of that tag only, so that
    /// [`sleep`](Self::sleep) can give their pages back without touching other memory. Refused with
    /// [`Error::TagAsleep`] while the tag sleeps.
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
    /// memory. Refused during a capture ([`Error::CaptureUnderway`]), and while pages of the tag's chunks
    /// are lent elsewhere under memory pressure ([`Error::TagPagesLent`]).
    pub fn sleep(&mut self, tag: &str, keep: bool) -> Result<u64, Error> {
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway { operation: "sleep" });
        }
        let id = self.tags.id(tag);
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
            let blocks: Vec<(u64, u64)> = (slots.iter())
                .flat_map(|&slot| self.segments.at(slot).blocks())
                .filter(|(_, b)| b.is_live())
                .map(|(addr, b)| (addr, b.size))
                .collect();
            let kept = match keep {
                true => Some(self.copy_out(&blocks)?),
                false => None,
            };
            self.tags.fall_asleep(id, blocks, kept);
        }
        let unmapped = self.unmap_tag(&slots)?;
        self.tags.set_asleep(id);
        tracing::info!(tag, unmapped, keep, "cuvmm: tag asleep");
        Ok(unmapped)
    }

    /// Wakes `tag`: maps pages under its live blocks at the same addresses and puts back the bytes the
    /// sleep kept. A tag awake (or never named) is left as it is. Refused during a capture. On failure
    /// (out of memory, say) the tag stays asleep and a second wake finishes.
    pub fn wake(&mut self, tag: &str) -> Result<(), Error> {
        let Some(id) = self.tags.find(tag) else {
            return Ok(());
        };
        if self.tags.is_awake(id) {
            return Ok(());
        }
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway { operation: "wake" });
        }
        let (blocks, kept) = self.tags.start_waking(id);
        let result =
            (self.map_blocks(&blocks)).and_then(|()| self.copy_in(&blocks, kept.as_deref()));
        if let Err(err) = result {
            self.tags.wake_failed(id, blocks, kept);
            return Err(err);
        }
        self.tags.set_awake(id);
        tracing::info!(tag, "cuvmm: tag awake");
        Ok(())
    }

    /// The tags asleep (or half way) and the bytes each would map at its wake, by name.
    pub fn asleep_tags(&self) -> Vec<(String, u64)> {
        self.tags.asleep_list(&self.segments, self.page_size)
    }

    /// Waits for every stream that used the memory of the segments `slots`: their own streams, the
    /// streams recorded on their live blocks, and those their pending frees wait for. A stream an event
    /// query shows idle is not synchronized. Then frees the pending blocks whose events completed.
    fn wait_for_tag(&mut self, slots: &[usize]) -> Result<(), Error> {
        if self.graphs.any_deferred() {
            self.parts().insert_deferred_events()?;
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

    /// Copies the bytes of `blocks` to host memory.
    fn copy_out(&mut self, blocks: &[(u64, u64)]) -> Result<Vec<HostMemory>, Error> {
        let mut kept = Vec::with_capacity(blocks.len());
        for &(addr, size) in blocks {
            let len =
                usize::try_from(size).map_err(|_| DriverError::HostOutOfMemory { bytes: size })?;
            let mut host = self.driver.alloc_host(len)?;
            self.driver.copy_to_host(addr, host.as_mut_slice())?;
            kept.push(host);
        }
        Ok(kept)
    }

    /// Puts the kept bytes back into `blocks`, if there are any.
    fn copy_in(&mut self, blocks: &[(u64, u64)], kept: Option<&[HostMemory]>) -> Result<(), Error> {
        for (&(addr, _), host) in blocks.iter().zip(kept.unwrap_or_default()) {
            let bytes = host.as_slice();
            self.driver.copy_from_host(addr, bytes)?;
        }
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
