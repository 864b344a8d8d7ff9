//! The virtual reservations: reserved for a new segment, freed once a segment holds no live block and no
//! mapped page, and every one (with everything mapped in it) given back on drop.

use super::Expandable;
use super::segment::{Kind, Segment};
use super::segments::SegmentKey;
use super::settle::free_reservation_settled;
use super::streams::synchronize_device;
use crate::base::size::round_up;
use crate::driver::Driver;
use crate::strategy::error::Error;

impl<D: Driver> Expandable<D> {
    /// Reserves a segment for `key` large enough for `min_size` bytes, for requests of `kind`.
    pub(super) fn reserve_segment(
        &mut self,
        key: SegmentKey,
        kind: Kind,
        min_size: u64,
    ) -> Result<usize, Error> {
        let (stream, pool, graph, tag) = key;
        let wanted = self
            .device_total
            .saturating_mul(self.config.va_factor)
            .max(min_size);
        let size = round_up(wanted, self.page_size).ok_or(Error::TooLarge {
            requested: min_size,
            capacity: self.device_total,
        })?;
        let va = self.driver.reserve(size)?;
        tracing::info!(
            start = va.start,
            size,
            ?pool,
            stream = stream.0,
            "cuvmm: reserved segment"
        );
        let mut segment = Segment::new(va, stream, pool, kind, self.page_size);
        segment.graph = graph;
        segment.tag = tag;
        let slot = self.segments.add_segment(key, segment);
        self.books.counters.segment.add(pool, 1);
        Ok(slot)
    }

    /// Frees the reservations of segments that hold no live block and no mapped page, and belong to no
    /// sleeping tag: a sleeping tag's wake maps pages of its segments again at the same addresses (a CUDA
    /// graph captured in it replays there), though its sleep left none mapped.
    pub(super) fn free_empty_segments(&mut self) -> Result<(), Error> {
        for slot in 0..self.segments.slot_count() {
            let Some(seg) = self.segments.try_at(slot) else {
                continue;
            };
            if seg.occupied_count() > 0 || seg.pages.mapped_count() > 0 || self.tags.sleeps(seg.tag)
            {
                continue;
            }
            let (va, graph, pool) = (seg.va, seg.graph, seg.pool);
            free_reservation_settled(&mut self.driver, va)?;
            self.segments.take_out(slot);
            self.books.counters.segment.sub(pool, 1);
            if let Some(graph) = graph
                && !self.segments.any_of_graph(graph)
            {
                self.graphs.forget_released(graph);
            }
        }
        Ok(())
    }

    /// Unmaps and releases everything, live blocks included, and frees every reservation. Used on drop.
    /// Goes on after a failure so as much as possible is given back, and returns the first failure.
    ///
    /// It waits for the device once, not for each stream it knows of: a program may have destroyed those
    /// streams before dropping the allocator (Rust drops a stream made after the allocator first), and a call
    /// naming a destroyed stream is undefined behaviour on a GPU.
    pub(super) fn teardown(&mut self) -> Result<(), Error> {
        let mut first_err: Option<Error> = None;
        let mut note = |result: Result<(), Error>| {
            if let Err(err) = result {
                first_err.get_or_insert(err);
            }
        };
        let segments = self.segments.take_all();
        if self.waits.any() || segments.iter().any(|seg| seg.pages.mapped_count() > 0) {
            note(synchronize_device(&mut self.driver, &mut self.books));
        }
        note(self.waits.forget_all(&mut self.driver));
        for seg in segments {
            (self.supply).unmap_segment(&mut self.driver, &seg, &mut note);
            note(free_reservation_settled(&mut self.driver, seg.va).map_err(Error::from));
        }
        (self.supply).release_all(&mut self.driver, &mut self.books, note);
        first_err.map_or(Ok(()), Err)
    }
}
