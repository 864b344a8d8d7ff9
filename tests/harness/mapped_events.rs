//! The memory mapped as an allocator trace tracker sees it, from the `segment_map` and `segment_unmap`
//! events (the view NCCL's and torchcomms' registration hooks keep), checked against the mappings the
//! simulated driver holds: nothing is reported mapped twice, nothing unmapped that was not mapped, and no
//! mapping goes unreported. Each page is of the private pool its events name (NCCL's hook registers a
//! pool's memory by it): unmapped as the pool it was mapped for, which is the pool of the snapshot's segment
//! holding it.

use cuvmm::GraphPool;
use cuvmm::driver::sim::SimDriver;
use cuvmm::expandable::Expandable;
use cuvmm::history::{TraceAction, TraceEntry};
use cuvmm::strategy::Snapshots;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

/// A tracker's view of the mapped pages of `page` bytes, and the first inconsistency in the events.
pub struct MappedEvents {
    view: Arc<Mutex<View>>,
    page: u64,
}

#[derive(Default)]
struct View {
    /// Page number -> the pool it was mapped for.
    pages: BTreeMap<u64, GraphPool>,
    error: Option<String>,
}

impl MappedEvents {
    /// Attaches a tracker to `alloc` that follows its segment events, by pages of `page` bytes.
    pub fn attach(alloc: &mut impl Snapshots, page: u64) -> Self {
        let view = Arc::new(Mutex::new(View::default()));
        let sink = Arc::clone(&view);
        let tracker = move |e: &TraceEntry| {
            let mut view = sink.lock().unwrap();
            let mut pages = (e.addr / page)..(e.addr + e.size).div_ceil(page);
            let fault = match e.action {
                TraceAction::SegmentMap => pages.find(|p| view.pages.insert(*p, e.pool).is_some()),
                TraceAction::SegmentUnmap => pages.find(|p| view.pages.remove(p) != Some(e.pool)),
                _ => return,
            };
            if let Some(p) = fault {
                let error = format!(
                    "{e:?}: page {:#x} was already as it leaves it, or mapped for another pool",
                    p * page
                );
                view.error.get_or_insert(error);
            }
        };
        (alloc.attach_trace_tracker(Arc::new(tracker))).expect("a tracker attaches");
        Self { view, page }
    }

    /// Whether the events so far agree with each other, with the driver's mappings now, and with the pools
    /// of `alloc`'s segments.
    pub fn check(&self, alloc: &Expandable<SimDriver>) -> Result<(), String> {
        let page = self.page;
        let mapped: BTreeSet<u64> = (alloc.driver().leak_report().mappings.iter())
            .flat_map(|m| (m.start / page)..(m.start + m.size).div_ceil(page))
            .collect();
        let view = self.view.lock().unwrap();
        if let Some(error) = &view.error {
            return Err(format!("trace events: {error}"));
        }
        if !view.pages.keys().copied().eq(mapped.iter().copied()) {
            return Err(format!(
                "trace events say pages {:x?} are mapped, the driver {mapped:x?}",
                view.pages.keys()
            ));
        }
        let snapshot = alloc.snapshot().map_err(|e| format!("snapshot: {e}"))?;
        for seg in &snapshot.segments {
            let pages = (seg.address / page)..(seg.address + seg.total_size).div_ceil(page);
            if let Some((p, pool)) = view
                .pages
                .range(pages)
                .find(|(_, pool)| **pool != seg.graph_pool)
            {
                return Err(format!(
                    "page {:#x} was mapped for {pool}, its segment is of {}",
                    p * page,
                    seg.graph_pool
                ));
            }
        }
        Ok(())
    }
}
