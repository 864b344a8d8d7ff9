//! Tags: the names allocations are made under (`alloc_tagged`), and whether each is awake, asleep, half way
//! or being copied (`sleep.rs` puts them to sleep and wakes them). A part that owns its state: a segment key
//! carries a [`TagId`], (`segment.rs`), small and `Copy`; what a sleeping tag had live, what its wake maps,
//! and its host memory (`kept.rs`: the bytes kept, or buffers kept for the next sleep) are here.

use super::kept::Kept;
use super::segment::TagId;
use super::segments::Segments;
use crate::driver::HostMemory;
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::tags::TagInfo;
use std::collections::{BTreeSet, HashSet};

/// Where a tag is between sleep and wake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Its pages are mapped under its live blocks; it allocates and frees like any memory.
    Awake,
    /// A sleep or a wake is copying its bytes without the allocator's lock (a `TagCopy`, `kept.rs`): treated
    /// as asleep, and another sleep or wake of it is refused as busy.
    Copying,
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
    /// What its wake maps, page-aligned ranges `(address, bytes)`, disjoint, in segment and address order:
    /// the pages under `blocks`, and the pages of its segments of live CUDA graph pools that were mapped
    /// when it fell asleep (the graphs' temporaries, whose bytes are not kept: a graph writes them before
    /// it reads them).
    wake: Vec<(u64, u64)>,
    /// Its host memory: the bytes a sleep kept, or buffers kept for the next sleep.
    kept: Kept,
    /// Blocks freed while it was not awake, by address: pending (no longer allocated; a wake puts back the
    /// bytes of the blocks it fell asleep with, laid out by them), made free once it is awake again
    /// (`sleep.rs`).
    freed: BTreeSet<u64>,
}

/// Every tag named so far (a program names a handful).
#[derive(Debug, Default)]
pub(super) struct Tags {
    tags: Vec<Tag>,
    /// Host memory let go of (buffers released or replaced), not freed yet: the caller frees it after
    /// letting go of its lock ([`take_freed`](Self::take_freed)), as freeing page-locked memory may wait
    /// for the device. Counted in no tag's bytes.
    freed: Vec<HostMemory>,
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
            wake: Vec::new(),
            kept: Kept::default(),
            freed: BTreeSet::new(),
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

    /// Whether the tag is awake (neither asleep, half way nor being copied).
    #[inline]
    pub(super) fn is_awake(&self, id: TagId) -> bool {
        self.get(id).state == State::Awake
    }

    /// Whether a sleep or a wake is copying the tag's bytes now.
    pub(super) fn is_copying(&self, id: TagId) -> bool {
        self.get(id).state == State::Copying
    }

    /// A tag whose host memory a job holds now (a sleep's or a wake's copies, or a preparation pinning
    /// it), if any.
    pub(super) fn host_job(&self) -> Option<TagId> {
        self.ids()
            .find(|&id| self.is_copying(id) || self.is_preparing(id))
    }

    /// The tag's name.
    pub(super) fn name(&self, id: TagId) -> &str {
        &self.get(id).name
    }

    /// Every tag (an iterator that borrows nothing, so the tags may change while it runs).
    pub(super) fn ids(&self) -> std::iter::Map<std::ops::Range<u32>, fn(u32) -> TagId> {
        (0..self.tags.len() as u32).map(TagId as fn(u32) -> TagId)
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

    /// Whether `tag` (a segment's) names a tag that is not awake: its segment is pinned, and a free of one
    /// of its blocks waits for the wake.
    #[inline]
    pub(super) fn sleeps(&self, tag: Option<TagId>) -> bool {
        tag.is_some_and(|id| !self.is_awake(id))
    }

    /// [`Error::TagBusy`] for `operation` on tag `id`.
    pub(super) fn busy_error(&self, operation: &'static str, id: TagId) -> Error {
        Error::TagBusy {
            operation,
            tag: self.name(id).to_owned(),
        }
    }

    /// Marks the awake tag `id` falling asleep, with its live blocks and what its wake maps: copying its
    /// bytes if `copying`, else half way (its pages are unmapped next).
    pub(super) fn fall_asleep(
        &mut self,
        id: TagId,
        blocks: Vec<(u64, u64)>,
        wake: Vec<(u64, u64)>,
        copying: bool,
    ) {
        let t = self.get_mut(id);
        t.state = if copying {
            State::Copying
        } else {
            State::Sleeping
        };
        (t.blocks, t.wake) = (blocks, wake);
        t.kept.forget_contents();
    }

    /// A sleep's copies failed: tag `id` is awake again, its host memory kept as buffers.
    pub(super) fn sleep_failed(&mut self, id: TagId, pieces: Vec<HostMemory>) {
        let t = self.get_mut(id);
        t.kept.take_back(pieces, false);
        t.state = State::Awake;
        t.blocks.clear();
        t.wake.clear();
    }

    /// A sleep's copies succeeded: tag `id` keeps its bytes in `pieces`, half way (its pages are unmapped
    /// next).
    pub(super) fn kept(&mut self, id: TagId, pieces: Vec<HostMemory>) {
        let t = self.get_mut(id);
        t.kept.take_back(pieces, true);
        t.state = State::Sleeping;
    }

    /// Marks tag `id` asleep: none of its pages is mapped.
    pub(super) fn set_asleep(&mut self, id: TagId) {
        self.get_mut(id).state = State::Asleep;
    }

    /// Marks tag `id` half way to waking (its pages are being mapped).
    pub(super) fn start_waking(&mut self, id: TagId) {
        self.get_mut(id).state = State::Sleeping;
    }

    /// Marks tag `id` copying its kept bytes back.
    pub(super) fn set_copying(&mut self, id: TagId) {
        self.get_mut(id).state = State::Copying;
    }

    /// A wake's copies failed: tag `id` keeps its bytes in `pieces`, half way (some pages mapped).
    pub(super) fn wake_failed(&mut self, id: TagId, pieces: Vec<HostMemory>) {
        let t = self.get_mut(id);
        t.kept.take_back(pieces, true);
        t.state = State::Sleeping;
    }

    /// Marks tag `id` awake; its host memory (given back from the copies, if any) stays as buffers for the
    /// next sleep if `keep_buffers`, else is freed.
    pub(super) fn woke(&mut self, id: TagId, pieces: Option<Vec<HostMemory>>, keep_buffers: bool) {
        let t = self.get_mut(id);
        if let Some(pieces) = pieces {
            t.kept.take_back(pieces, false);
        }
        t.kept.forget_contents();
        t.state = State::Awake;
        t.blocks.clear();
        t.wake.clear();
        if !keep_buffers {
            self.release_host(id);
        }
    }

    /// Notes that the block at `addr` of tag `id`, which is not awake, was freed (it is pending): it is made
    /// free when the tag is awake again ([`take_freed_blocks`](Self::take_freed_blocks)).
    pub(super) fn free_at_wake(&mut self, id: TagId, addr: u64) {
        self.get_mut(id).freed.insert(addr);
    }

    /// Whether the block at `addr` of tag `id` was freed and waits for the tag's wake.
    pub(super) fn freed_at_wake(&self, id: TagId, addr: u64) -> bool {
        self.get(id).freed.contains(&addr)
    }

    /// How many blocks of every tag wait for their tag's wake to be made free.
    pub(super) fn freed_count(&self) -> usize {
        self.tags.iter().map(|t| t.freed.len()).sum()
    }

    /// The blocks of tag `id` freed while it was not awake, to free now.
    pub(super) fn take_freed_blocks(&mut self, id: TagId) -> BTreeSet<u64> {
        std::mem::take(&mut self.get_mut(id).freed)
    }

    /// The live blocks tag `id` fell asleep with.
    pub(super) fn blocks(&self, id: TagId) -> &[(u64, u64)] {
        &self.get(id).blocks
    }

    /// What the wake of tag `id` maps.
    pub(super) fn wake_ranges(&self, id: TagId) -> &[(u64, u64)] {
        &self.get(id).wake
    }

    /// Whether tag `id`'s host memory holds its bytes.
    pub(super) fn holds_bytes(&self, id: TagId) -> bool {
        self.get(id).kept.holds_contents()
    }

    /// Copies into `out` the bytes tag `id` keeps from `host` on in its host layout (`kept.rs`), laid out
    /// in pieces of `piece` bytes; `false` when it keeps none there.
    pub(super) fn read_kept(&self, id: TagId, host: u64, piece: u64, out: &mut [u8]) -> bool {
        self.get(id).kept.read(host, piece, out)
    }

    /// Tag `id`'s host memory, lent to a copy.
    pub(super) fn lend_host(&mut self, id: TagId) -> Vec<HostMemory> {
        self.get_mut(id).kept.lend_pieces()
    }

    /// The copy tag `id`'s host memory is lent to holds `bytes` (those lent, and those it pins).
    pub(super) fn host_lent_bytes(&mut self, id: TagId, bytes: u64) {
        self.get_mut(id).kept.note_lent_bytes(bytes);
    }

    /// Whether a preparation pins host memory for tag `id` now (`prepare_sleep`).
    pub(super) fn is_preparing(&self, id: TagId) -> bool {
        self.get(id).kept.preparing()
    }

    /// Tag `id`'s host memory, lent to a preparation.
    pub(super) fn lend_to_prepare(&mut self, id: TagId) -> Vec<HostMemory> {
        self.get_mut(id).kept.lend_to_prepare()
    }

    /// The preparation tag `id`'s host memory is lent to holds `bytes` (those lent, and those it pins).
    pub(super) fn host_preparing_bytes(&mut self, id: TagId, bytes: u64) {
        self.get_mut(id).kept.note_preparing(bytes);
    }

    /// The pieces back from a preparation of tag `id`: its buffers for the next sleep if it is still
    /// awake and holds none, else freed (a sleep that ran meanwhile pinned its own). Returns whether they
    /// were kept.
    pub(super) fn prepared(&mut self, id: TagId, pieces: Vec<HostMemory>) -> bool {
        let awake = self.is_awake(id);
        let unused = self.get_mut(id).kept.take_prepared(pieces, awake);
        let kept = awake && unused.is_empty();
        self.freed.extend(unused);
        kept
    }

    /// Host memory lent by [`lend_host`](Self::lend_host) and not used, back to tag `id` as it was.
    pub(super) fn unlend_host(&mut self, id: TagId, pieces: Vec<HostMemory>) {
        let t = self.get_mut(id);
        let contents = t.state != State::Awake && t.kept.holds_contents();
        t.kept.take_back(pieces, contents);
    }

    /// Lets go of the host buffers of tag `id` (not bytes it keeps), to be freed by the caller
    /// ([`take_freed`](Self::take_freed)); returns their bytes.
    pub(super) fn release_host(&mut self, id: TagId) -> u64 {
        let pieces = self.get_mut(id).kept.free_buffers();
        let bytes = pieces.iter().map(|p| p.len() as u64).sum();
        self.freed.extend(pieces);
        bytes
    }

    /// Host memory to free later: see [`take_freed`](Self::take_freed).
    pub(super) fn free_later(&mut self, pieces: Vec<HostMemory>) {
        self.freed.extend(pieces);
    }

    /// The host memory let go of since the last call, for the caller to free (drop) after its lock.
    pub(super) fn take_freed(&mut self) -> Vec<HostMemory> {
        std::mem::take(&mut self.freed)
    }

    /// Bytes of host memory every tag holds.
    pub(super) fn host_bytes(&self) -> u64 {
        self.tags.iter().map(|t| t.kept.held_bytes()).sum()
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

    /// Bytes of the pages a sleeping tag's wake maps that are not mapped now.
    fn asleep_bytes_of(&self, id: TagId, segments: &Segments, page_size: u64) -> u64 {
        let pages: usize = (self.get(id).wake.iter())
            .filter_map(|&(addr, size)| {
                let seg = segments.at(segments.slot_of(addr)?);
                Some(seg.pages.unmapped_count(seg.pages_of(addr, size)))
            })
            .sum();
        pages as u64 * page_size
    }

    /// Tag `id` as [`TagInfo`] says it.
    pub(super) fn info(&self, id: TagId, segments: &Segments, page_size: u64) -> TagInfo {
        let t = self.get(id);
        let live_bytes = (segments.of_tag(id).into_iter())
            .flat_map(|slot| segments.at(slot).blocks())
            .filter(|(_, b)| b.is_live())
            .map(|(_, b)| b.size)
            .sum();
        TagInfo {
            name: t.name.clone(),
            state: match t.state {
                State::Awake => "awake",
                State::Copying => "copying",
                State::Sleeping => "sleeping",
                State::Asleep => "asleep",
            },
            live_bytes,
            asleep_bytes: match t.state {
                State::Awake => 0,
                _ => self.asleep_bytes_of(id, segments, page_size),
            },
            bytes_kept: t.kept.holds_contents(),
            host_kept_bytes: t.kept.held_bytes(),
        }
    }

    /// The sleep part of `check_invariants()`: every segment's tag is known; a block freed before its tag's
    /// wake is one of its pending blocks; a sleeping tag's live blocks and those freed since
    /// are exactly those it fell asleep with (no block placed), its wake maps their pages in
    /// segments of the tag still reserved, and the host memory holding its bytes is long enough for them;
    /// an asleep tag has no page mapped; an
    /// awake tag keeps no bytes, nor blocks, nor ranges to map.
    pub(super) fn check_tags(&self, segments: &Segments) -> Result<(), InvariantViolation> {
        for seg in segments.live() {
            if seg.tag.is_some_and(|id| id.0 as usize >= self.tags.len()) {
                return Err(InvariantViolation::Asleep { addr: seg.va.start });
            }
        }
        for id in self.ids() {
            let tag = self.get(id);
            // A block freed before the wake is a pending block of the tag.
            for &addr in &tag.freed {
                let pending = (segments.slot_of(addr)).is_some_and(|slot| {
                    let seg = segments.at(slot);
                    seg.tag == Some(id) && seg.block_at(addr).is_some_and(|b| b.is_pending())
                });
                if !pending {
                    return Err(InvariantViolation::Asleep { addr });
                }
            }
            if tag.state == State::Awake {
                let idle = tag.blocks.is_empty() && tag.wake.is_empty();
                if !idle || tag.kept.holds_contents() || tag.kept.lent() {
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
                    if block.is_live() || tag.freed.contains(&addr) {
                        live.insert((addr, block.size));
                    }
                }
            }
            let recorded: HashSet<(u64, u64)> = tag.blocks.iter().copied().collect();
            if let Some(&(addr, _)) = live.symmetric_difference(&recorded).next() {
                return Err(InvariantViolation::Asleep { addr });
            }
            let covered = |&(addr, size): &(u64, u64)| {
                (tag.wake.iter()).any(|&(start, len)| start <= addr && addr + size <= start + len)
            };
            if let Some(&(addr, _)) = tag.blocks.iter().find(|b| !covered(b)) {
                return Err(InvariantViolation::Asleep { addr });
            }
            // What the wake maps lies in segments of the tag, reserved until it wakes.
            let in_tag = |&(addr, size): &(u64, u64)| {
                (segments.slot_of(addr)).is_some_and(|slot| {
                    let seg = segments.at(slot);
                    seg.tag == Some(id) && addr + size <= seg.va.start + seg.va.size
                })
            };
            if let Some(&(addr, _)) = tag.wake.iter().find(|r| !in_tag(r)) {
                return Err(InvariantViolation::Asleep { addr });
            }
            let bytes: u64 = tag.blocks.iter().map(|b| b.1).sum();
            if tag.kept.holds_contents()
                && !tag.kept.lent()
                && tag.kept.piece_lens().sum::<u64>() < bytes
            {
                return Err(InvariantViolation::Asleep { addr: 0 });
            }
        }
        Ok(())
    }
}
