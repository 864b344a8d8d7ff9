//! Tags: the names allocations are made under (`alloc_tagged`), and whether each is awake, asleep or half way
//! (`sleep.rs` puts them to sleep and wakes them). A part that owns its state: a segment key carries a
//! [`TagId`], (`segment.rs`), small and `Copy`; what a sleeping tag had live, and kept, is here.

use super::blocks::BlockState;
use super::segment::TagId;
use super::segments::Segments;
use crate::driver::HostMemory;
use crate::strategy::error::{Error, InvariantViolation};
use std::collections::HashSet;

/// A sleeping tag's live blocks `(address, size)` and their bytes, if kept.
type Slept = (Vec<(u64, u64)>, Option<Vec<HostMemory>>);

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
    kept: Option<Vec<HostMemory>>,
}

/// Every tag named so far (a program names a handful).
#[derive(Debug, Default)]
pub(super) struct Tags {
    tags: Vec<Tag>,
}

impl Tags {
    /// The tag named `name`, made awake if new.
    pub(super) fn id(&mut self, name: &str) -> TagId {
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
    pub(super) fn find(&self, name: &str) -> Option<TagId> {
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
    pub(super) fn is_awake(&self, id: TagId) -> bool {
        self.get(id).state == State::Awake
    }

    /// The tag's name.
    pub(super) fn name(&self, id: TagId) -> &str {
        &self.get(id).name
    }

    fn ids(&self) -> impl Iterator<Item = TagId> {
        (0..self.tags.len() as u32).map(TagId)
    }
}

impl Tags {
    /// [`Error::TagAsleep`] for `operation` on tag `id`.
    pub(super) fn asleep_error(&self, operation: &'static str, id: TagId) -> Error {
        Error::TagAsleep {
            operation,
            tag: self.name(id).to_owned(),
        }
    }

    /// Whether `tag` (a segment's) names a tag that is not awake: its segment is pinned and refuses frees.
    #[inline]
    pub(super) fn sleeps(&self, tag: Option<TagId>) -> bool {
        tag.is_some_and(|id| !self.is_awake(id))
    }

    /// Marks tag `id` half way to sleep, with the live blocks it has and their bytes if kept.
    pub(super) fn fall_asleep(
        &mut self,
        id: TagId,
        blocks: Vec<(u64, u64)>,
        kept: Option<Vec<HostMemory>>,
    ) {
        let t = self.get_mut(id);
        (t.state, t.blocks, t.kept) = (State::Sleeping, blocks, kept);
    }

    /// Marks tag `id` asleep: none of its pages is mapped.
    pub(super) fn set_asleep(&mut self, id: TagId) {
        self.get_mut(id).state = State::Asleep;
    }

    /// Marks tag `id` half way to waking and hands over its live blocks and kept bytes.
    pub(super) fn start_waking(&mut self, id: TagId) -> Slept {
        let t = self.get_mut(id);
        t.state = State::Sleeping;
        (std::mem::take(&mut t.blocks), t.kept.take())
    }

    /// A wake of tag `id` failed: it keeps its blocks and kept bytes, half way.
    pub(super) fn wake_failed(
        &mut self,
        id: TagId,
        blocks: Vec<(u64, u64)>,
        kept: Option<Vec<HostMemory>>,
    ) {
        let t = self.get_mut(id);
        (t.blocks, t.kept) = (blocks, kept);
    }

    /// Marks tag `id` awake.
    pub(super) fn set_awake(&mut self, id: TagId) {
        self.get_mut(id).state = State::Awake;
    }

    /// The tags asleep (or half way) and the bytes each would map at its wake, by name.
    pub(super) fn asleep_list(&self, segments: &Segments, page_size: u64) -> Vec<(String, u64)> {
        (self.ids())
            .filter(|&id| !self.is_awake(id))
            .map(|id| {
                (
                    self.name(id).to_owned(),
                    self.asleep_bytes_of(id, segments, page_size),
                )
            })
            .collect()
    }

    /// The bytes of every tag asleep, for the statistics.
    pub(super) fn asleep_bytes(&self, segments: &Segments, page_size: u64) -> u64 {
        (self.ids())
            .filter(|&id| !self.is_awake(id))
            .map(|id| self.asleep_bytes_of(id, segments, page_size))
            .sum()
    }

    /// Bytes of the pages under a sleeping tag's live blocks that are not mapped (each page once).
    fn asleep_bytes_of(&self, id: TagId, segments: &Segments, page_size: u64) -> u64 {
        let mut pages = 0;
        // The blocks lie in segment and address order: (slot, first page not counted yet).
        let mut counted: Option<(usize, usize)> = None;
        for &(addr, size) in &self.get(id).blocks {
            let Some(slot) = segments.slot_of(addr) else {
                continue;
            };
            let seg = segments.at(slot);
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
        pages as u64 * page_size
    }

    /// The sleep part of `check_invariants()`: every segment's tag is known; a sleeping tag's live blocks
    /// are exactly those it fell asleep with (no block placed, none freed), with as many kept buffers of
    /// their sizes; an asleep tag has no page mapped; an awake tag keeps nothing.
    pub(super) fn check_tags(&self, segments: &Segments) -> Result<(), InvariantViolation> {
        for seg in segments.live() {
            if seg.tag.is_some_and(|id| id.0 as usize >= self.tags.len()) {
                return Err(InvariantViolation::Asleep { addr: seg.va.start });
            }
        }
        for id in self.ids() {
            let tag = self.get(id);
            if tag.state == State::Awake {
                if !tag.blocks.is_empty() || tag.kept.is_some() {
                    return Err(InvariantViolation::Asleep { addr: 0 });
                }
                continue;
            }
            let slots = segments.of_tag(id);
            let mut live = HashSet::new();
            for &slot in &slots {
                let seg = segments.at(slot);
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
