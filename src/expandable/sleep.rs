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
//! Failures (docs/DESIGN.md, "Failures with side effects"): a failure before step 3 changes nothing. A
//! sleep that fails while unmapping leaves the tag *sleeping* with some pages still mapped: a second sleep
//! unmaps the rest, a wake maps the missing ones. A wake that fails leaves the tag sleeping with some pages
//! mapped: a second wake maps the rest and copies the kept bytes again, a sleep unmaps them again. The kept
//! bytes stay until the wake that succeeds.
//!
//! The kept bytes live in ordinary (pageable) host memory: `cuMemcpyDtoH` into it is synchronous, which a
//! sleep wants anyway.

use super::Expandable;
use super::blocks::BlockState;
use super::physical::Wait;
use super::tag::TagId;
use crate::driver::{Driver, PhysPage, StreamId};
use crate::strategy::error::{Error, InvariantViolation};
use std::collections::HashSet;

/// Where a tag is between sleep and wake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Its pages are mapped under its live blocks; it allocates and frees like any memory.
    Awake,
    /// A sleep or a wake failed half way: some pages may be mapped. Treated as asleep.
    Sleeping,
    /// No page of its segments is mapped.
    Asleep,
}

/// One tag.
#[derive(Debug)]
struct Tag {
    name: String,
    state: State,
    /// The live blocks when it fell asleep, `(address, size)` in segment and address order: exactly the
    /// live blocks of its segments while it sleeps.
    blocks: Vec<(u64, u64)>,
    /// Their bytes, when the sleep kept them (one buffer per block).
    kept: Option<Vec<Vec<u8>>>,
}

/// Every tag named so far (a program names a handful).
#[derive(Debug, Default)]
pub(super) struct Tags {
    tags: Vec<Tag>,
}

impl Tags {
    /// The tag named `name`, made awake if new.
    pub fn id(&mut self, name: &str) -> TagId {
        if let Some(id) = self.find(name) {
            return id;
        }
        self.tags.push(Tag {
            name: name.to_owned(),
            state: State::Awake,
            blocks: Vec::new(),
            kept: None,
        });
        TagId((self.tags.len() - 1) as u32)
    }

    /// The tag named `name`, if it was named before.
    pub fn find(&self, name: &str) -> Option<TagId> {
        let at = self.tags.iter().position(|t| t.name == name)?;
        Some(TagId(at as u32))
    }

    fn get(&self, id: TagId) -> &Tag {
        &self.tags[id.0 as usize]
    }

    fn get_mut(&mut self, id: TagId) -> &mut Tag {
        &mut self.tags[id.0 as usize]
    }

    /// Whether the tag is awake (neither asleep nor half way).
    #[inline]
    pub fn is_awake(&self, id: TagId) -> bool {
        self.get(id).state == State::Awake
    }

    /// The tag's name.
    pub fn name(&self, id: TagId) -> &str {
        &self.get(id).name
    }

    fn ids(&self) -> impl Iterator<Item = TagId> {
        (0..self.tags.len() as u32).map(TagId)
    }
}

impl<D: Driver> Expandable<D> {
    /// Allocates `size` bytes on `stream` under the tag `tag`: in segments of that tag only, so that
    /// [`sleep`](Self::sleep) can give their pages back without touching other memory. Refused with
    /// [`Error::TagAsleep`] while the tag sleeps.
    pub fn alloc_tagged(&mut self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        let id = self.tags.id(tag);
        if !self.tags.is_awake(id) {
            return Err(self.tag_asleep("alloc", id));
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
        if self.capturing() {
            return Err(Error::CaptureUnderway { operation: "sleep" });
        }
        let id = self.tags.id(tag);
        let slots = self.tag_slots(id);
        if self.tags.is_awake(id) {
            let lent: usize = (self.lenders.values())
                .filter(|l| slots.contains(&l.slot))
                .map(|l| l.lent)
                .sum();
            if lent > 0 {
                return Err(Error::TagPagesLent {
                    tag: tag.to_owned(),
                    pages: lent,
                });
            }
            self.wait_for_tag(&slots)?;
            let blocks: Vec<(u64, u64)> = (slots.iter())
                .flat_map(|&slot| self.segment(slot).blocks())
                .filter(|(_, b)| b.is_live())
                .map(|(addr, b)| (addr, b.size))
                .collect();
            let kept = match keep {
                true => Some(self.copy_out(&blocks)?),
                false => None,
            };
            let t = self.tags.get_mut(id);
            (t.state, t.blocks, t.kept) = (State::Sleeping, blocks, kept);
        }
        let unmapped = self.unmap_tag(&slots)?;
        self.tags.get_mut(id).state = State::Asleep;
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
        if self.capturing() {
            return Err(Error::CaptureUnderway { operation: "wake" });
        }
        let t = self.tags.get_mut(id);
        t.state = State::Sleeping;
        let (blocks, kept) = (std::mem::take(&mut t.blocks), t.kept.take());
        let result =
            (self.map_blocks(&blocks)).and_then(|()| self.copy_in(&blocks, kept.as_deref()));
        let t = self.tags.get_mut(id);
        if let Err(err) = result {
            (t.blocks, t.kept) = (blocks, kept);
            return Err(err);
        }
        t.state = State::Awake;
        tracing::info!(tag, "cuvmm: tag awake");
        Ok(())
    }

    /// Maps the missing pages of each block (`back_with_pages`, which takes no page of a sleeping tag).
    fn map_blocks(&mut self, blocks: &[(u64, u64)]) -> Result<(), Error> {
        for &(addr, size) in blocks {
            let slot = self.slot_of(addr).ok_or(Error::UnknownAddress { addr })?;
            self.back_with_pages(slot, addr, size)?;
        }
        Ok(())
    }

    /// The tags asleep (or half way) and the bytes each would map at its wake, by name.
    pub fn asleep_tags(&self) -> Vec<(String, u64)> {
        (self.tags.ids())
            .filter(|&id| !self.tags.is_awake(id))
            .map(|id| (self.tags.name(id).to_owned(), self.asleep_bytes_of(id)))
            .collect()
    }

    /// Bytes of the pages under a sleeping tag's live blocks that are not mapped (each page once).
    fn asleep_bytes_of(&self, id: TagId) -> u64 {
        let mut pages = 0;
        // The blocks lie in segment and address order: (slot, first page not counted yet).
        let mut counted: Option<(usize, usize)> = None;
        for &(addr, size) in &self.tags.get(id).blocks {
            let Some(slot) = self.slot_of(addr) else {
                continue;
            };
            let seg = self.segment(slot);
            let mut run = seg.pages_of(addr, size);
            if let Some((last, end)) = counted
                && last == slot
            {
                run.start = run.start.max(end);
            }
            if run.start < run.end {
                pages += seg.pages.unmapped_count(run.clone());
                counted = Some((slot, run.end));
            }
        }
        pages as u64 * self.page_size
    }

    /// The bytes of every tag asleep, for the statistics.
    pub(super) fn asleep_bytes(&self) -> u64 {
        (self.tags.ids())
            .filter(|&id| !self.tags.is_awake(id))
            .map(|id| self.asleep_bytes_of(id))
            .sum()
    }

    /// Whether segment `slot` belongs to a tag that is not awake: pinned, and refusing frees.
    #[inline]
    pub(super) fn asleep(&self, slot: usize) -> bool {
        (self.segment(slot).tag).is_some_and(|id| !self.tags.is_awake(id))
    }

    /// [`Error::TagAsleep`] for `operation` on tag `id`.
    pub(super) fn tag_asleep(&self, operation: &'static str, id: TagId) -> Error {
        Error::TagAsleep {
            operation,
            tag: self.tags.name(id).to_owned(),
        }
    }

    /// The slots of the segments of tag `id`.
    fn tag_slots(&self, id: TagId) -> Vec<usize> {
        (0..self.segments.len())
            .filter(|&slot| {
                self.segments[slot]
                    .as_ref()
                    .is_some_and(|s| s.tag == Some(id))
            })
            .collect()
    }

    /// Waits for every stream that used the memory of the segments `slots`: their own streams, the
    /// streams recorded on their live blocks, and those their pending frees wait for. A stream an event
    /// query shows idle is not synchronized. Then frees the pending blocks whose events completed.
    fn wait_for_tag(&mut self, slots: &[usize]) -> Result<(), Error> {
        if !self.graphs.deferred.is_empty() {
            self.insert_deferred_events()?;
        }
        let inside = |a: &Self, addr: u64| a.slot_of(addr).is_some_and(|s| slots.contains(&s));
        let mut streams: Vec<StreamId> = (slots.iter())
            .filter(|&&slot| self.segment(slot).pages.mapped_count() > 0)
            .map(|&slot| self.segment(slot).stream)
            .collect();
        for (&addr, uses) in &self.stream_uses {
            if inside(self, addr) {
                streams.extend(uses.iter());
            }
        }
        for (stream, queue) in &self.pending.events {
            if queue.iter().any(|&(_, addr)| inside(self, addr)) {
                streams.push(*stream);
            }
        }
        streams.sort_unstable();
        streams.dedup();
        let mut compacting = Default::default();
        for stream in streams {
            if !self.stream_done(stream, Wait::Query, &mut compacting)? {
                self.stream_done(stream, Wait::Block, &mut Default::default())?;
            }
        }
        self.process_events()?;
        Ok(())
    }

    /// Copies the bytes of `blocks` to host memory.
    fn copy_out(&mut self, blocks: &[(u64, u64)]) -> Result<Vec<Vec<u8>>, Error> {
        let mut kept = Vec::with_capacity(blocks.len());
        for &(addr, size) in blocks {
            let mut bytes = vec![0; size as usize];
            self.driver.copy_to_host(addr, &mut bytes)?;
            kept.push(bytes);
        }
        Ok(kept)
    }

    /// Puts the kept bytes back into `blocks`, if there are any.
    fn copy_in(&mut self, blocks: &[(u64, u64)], kept: Option<&[Vec<u8>]>) -> Result<(), Error> {
        for (&(addr, _), bytes) in blocks.iter().zip(kept.unwrap_or_default()) {
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
            let before = self.segment(slot).pages.mapped_count();
            let runs = (self.segment(slot).pages).mapped_runs(0..self.segment(slot).pages.len());
            for run in runs {
                let first = run.start;
                let mut out: Vec<PhysPage> = Vec::new();
                let result = self.unmap_run(slot, run, &mut out);
                self.release_unmapped(out);
                if let Err(err) = result {
                    if self.segment(slot).pages.is_mapped(first) {
                        // The unmap failed: the run is still mapped, for the next sleep or a wake.
                        unmapped += before - self.segment(slot).pages.mapped_count();
                        tracing::info!(unmapped, "cuvmm: sleep failed half way");
                        return Err(err);
                    }
                    tracing::warn!(%err, "cuvmm: sleep: releasing an unmapped chunk failed; pooled");
                }
            }
            unmapped += before - self.segment(slot).pages.mapped_count();
        }
        Ok(unmapped as u64 * self.page_size)
    }

    /// Gives unmapped pages back: single-page handles are released (pooled if that fails), lent pieces go
    /// home.
    fn release_unmapped(&mut self, pages: Vec<PhysPage>) {
        let mut singles = Vec::new();
        for page in pages {
            if self.chunks.contains(&page.handle) {
                self.put_back([page]);
            } else {
                singles.push(page.handle);
            }
        }
        for handle in singles {
            if let Err(err) = self.release_handle(handle) {
                tracing::warn!(%err, "cuvmm: sleep: releasing a page failed; pooled for others");
                self.pooled.push(handle);
            }
        }
    }

    /// The sleep part of `check_invariants()`: every segment's tag is known; a sleeping tag's live blocks
    /// are exactly those it fell asleep with (no block placed, none freed), with as many kept buffers of
    /// their sizes; an asleep tag has no page mapped; an awake tag keeps nothing.
    pub(super) fn check_sleep(&self) -> Result<(), InvariantViolation> {
        for seg in self.live_segments() {
            if seg
                .tag
                .is_some_and(|id| id.0 as usize >= self.tags.tags.len())
            {
                return Err(InvariantViolation::Asleep { addr: seg.va.start });
            }
        }
        for id in self.tags.ids() {
            let tag = self.tags.get(id);
            if tag.state == State::Awake {
                if !tag.blocks.is_empty() || tag.kept.is_some() {
                    return Err(InvariantViolation::Asleep { addr: 0 });
                }
                continue;
            }
            let slots = self.tag_slots(id);
            let mut live = HashSet::new();
            for &slot in &slots {
                let seg = self.segment(slot);
                if tag.state == State::Asleep && seg.pages.mapped_count() > 0 {
                    return Err(InvariantViolation::Asleep { addr: seg.va.start });
                }
                for (addr, block) in seg.blocks() {
                    if matches!(block.state, BlockState::Live { .. }) {
                        live.insert((addr, block.size));
                    }
                }
            }
            let recorded: HashSet<(u64, u64)> = tag.blocks.iter().copied().collect();
            if let Some(&(addr, _)) = live.symmetric_difference(&recorded).next() {
                return Err(InvariantViolation::Asleep { addr });
            }
            if let Some(kept) = &tag.kept {
                let sizes = kept.iter().map(|b| b.len() as u64);
                if kept.len() != tag.blocks.len() || !sizes.eq(tag.blocks.iter().map(|b| b.1)) {
                    return Err(InvariantViolation::Asleep { addr: 0 });
                }
            }
        }
        Ok(())
    }
}
