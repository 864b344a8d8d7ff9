//! A snapshot's device trace as plain requests: what any allocator, not only PyTorch's, can replay.

use super::{PytorchTrace, TraceOp};
use crate::trace::event::{Event, Trace};
use cuvmm::driver::StreamId;
use std::collections::HashMap;

impl PytorchTrace {
    /// The requests of this device as a [`Trace`] named `name`: first an allocation for each block that was
    /// live when recording began (its requested bytes, in address order), then the recorded allocations and
    /// frees in order, each allocation named by a fresh id, and an [`Event::EmptyCache`] where the snapshot
    /// shows `torch.cuda.empty_cache()` (a release that PyTorch's own logic does not explain: see
    /// `docs/fidelity.md`). A free of an address no allocation holds is left out.
    pub fn to_trace(&self, name: impl Into<String>) -> Trace {
        let mut trace = Trace::new(name);
        let mut live: HashMap<u64, u64> = HashMap::new();
        let mut next_id = 0u64;
        let mut alloc = |trace: &mut Trace,
                         live: &mut HashMap<u64, u64>,
                         addr: u64,
                         size: u64,
                         stream: StreamId| {
            next_id += 1;
            live.insert(addr, next_id);
            trace.events.push(Event::Alloc {
                id: next_id,
                size: size.max(1),
                stream,
            });
        };
        for segment in &self.initial {
            for block in &segment.live {
                let addr = segment.addr + block.offset;
                alloc(&mut trace, &mut live, addr, block.requested, segment.stream);
            }
        }
        for op in &self.ops {
            match *op {
                TraceOp::Alloc { addr, size, stream } => {
                    alloc(&mut trace, &mut live, addr, size, stream)
                }
                TraceOp::Free { addr } => {
                    if let Some(id) = live.remove(&addr) {
                        trace.events.push(Event::Free { id });
                    }
                }
                TraceOp::EmptyCache => {
                    if trace.events.last() != Some(&Event::EmptyCache) {
                        trace.events.push(Event::EmptyCache);
                    }
                }
            }
        }
        trace
    }
}
