//! Copy jobs on the simulated device ([`Driver::start_copies`](crate::driver::Driver::start_copies)).
//!
//! `start_copies` checks the plan and that every device range is mapped with access, counts every step the
//! job will make and decides each one's fault there and then (in the job's order, `driver/copies.rs`: after
//! the first allocation or copy that fails, only the event and the wait), and marks the device ranges in
//! use by the copy stream ([`COPY_STREAM`]): until the job is over, `unmap` of one of them is
//! [`DriverError::UnmapWhileInUse`], as a kernel's pending work is. The job then runs without the driver:
//! it moves bytes between the byte store (shared with it) and its host pieces, and with
//! [`SimConfig::sleep_latency`](super::SimConfig::sleep_latency) waits out each step's modelled latency, so
//! a test sees other threads use the allocator meanwhile.
//!
//! What the model leaves out: a copy moves its bytes when the job runs it, not later; host memory is
//! ordinary memory the simulator calls page-locked; a copy is charged the latency model's pinned rate
//! (an estimate of the link's speed, `latency.rs`).

use super::latency::wait_out;
use super::store::ByteStore;
use super::{COPY_STREAM, SimDriver, Span};
use crate::base::sync::{Arc, AtomicBool, AtomicU64, Mutex};
use crate::driver::{
    CopyDirection, CopyJob, CopyPlan, CopyRun, DriverError, HostBytes, HostCopy, HostMemory,
    HostPinning, Op, VaRange,
};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

/// The jobs not over yet and the device ranges each copies; the page-locked host memory they allocated
/// that is not freed yet.
#[derive(Debug, Default)]
pub(super) struct Copying {
    jobs: Vec<(Arc<AtomicBool>, Vec<VaRange>)>,
    /// Bytes of host memory the jobs allocated and not freed yet (shared with each piece, which counts
    /// itself out when dropped).
    pinned: Arc<AtomicU64>,
    /// How the last job asked its pieces to be pinned (the simulator pins every way alike).
    last_pinning: Option<HostPinning>,
}

impl Copying {
    /// Bytes of page-locked host memory allocated by copy jobs and not freed yet.
    pub(super) fn pinned_bytes(&self) -> u64 {
        self.pinned.load(Ordering::Acquire)
    }

    /// How the last job started asked its pieces to be pinned.
    pub(super) fn last_pinning(&self) -> Option<HostPinning> {
        self.last_pinning
    }

    /// Marks `ranges` in use until the returned flag is set.
    fn add(&mut self, ranges: Vec<VaRange>) -> Arc<AtomicBool> {
        let over = Arc::new(AtomicBool::new(false));
        self.jobs.push((Arc::clone(&over), ranges));
        over
    }

    /// The first address of `va .. va + size` that a job not over yet copies, forgetting the jobs over.
    pub(super) fn user_of(&mut self, va: u64, size: u64) -> Option<u64> {
        if self.jobs.is_empty() {
            return None;
        }
        self.jobs.retain(|(over, _)| !over.load(Ordering::Acquire));
        let end = va.saturating_add(size);
        (self.jobs.iter().flat_map(|(_, ranges)| ranges))
            .filter(|r| r.start < end && va < r.end())
            .map(|r| r.start.max(va))
            .min()
    }
}

/// Host memory the simulated device calls page-locked, counted in its copies' pinned bytes while it
/// lives.
struct SimPinned(Vec<u8>, Arc<AtomicU64>);

impl Drop for SimPinned {
    fn drop(&mut self) {
        self.1.fetch_sub(self.0.len() as u64, Ordering::AcqRel);
    }
}

impl HostBytes for SimPinned {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn pinned(&self) -> bool {
        true
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A job's side on the simulated device: the outcome of each step, decided when it started.
struct SimCopies {
    /// Each step's outcome in the job's order: its modelled nanoseconds, or its fault.
    steps: VecDeque<Result<u64, DriverError>>,
    /// The physical memory behind each copy's device range, by the copy's place in the plan.
    spans: Vec<Vec<Span>>,
    /// The next copy.
    next: usize,
    store: Option<Arc<Mutex<ByteStore>>>,
    /// Whether steps wait out their latency.
    sleep: bool,
    /// Set once the job is over: its device ranges may be unmapped again.
    over: Arc<AtomicBool>,
    /// The device's count of pinned bytes ([`Copying::pinned_bytes`]).
    pinned: Arc<AtomicU64>,
}

impl SimCopies {
    /// The next step's outcome, its latency waited out.
    fn step(&mut self) -> Result<(), DriverError> {
        let outcome = self.steps.pop_front().unwrap_or(Err(DriverError::CopyPlan {
            reason: "a step the job did not count at its start",
        }));
        let ns = outcome?;
        if self.sleep {
            wait_out(ns);
        }
        Ok(())
    }
}

impl CopyRun for SimCopies {
    fn alloc(&mut self, len: u64) -> Result<HostMemory, DriverError> {
        self.step()?;
        let len = usize::try_from(len).map_err(|_| DriverError::HostOutOfMemory { bytes: len })?;
        let mut bytes = Vec::new();
        (bytes.try_reserve_exact(len))
            .map_err(|_| DriverError::HostOutOfMemory { bytes: len as u64 })?;
        bytes.resize(len, 0);
        self.pinned.fetch_add(len as u64, Ordering::AcqRel);
        Ok(HostMemory::new(SimPinned(bytes, Arc::clone(&self.pinned))))
    }

    fn copy(
        &mut self,
        copy: &HostCopy,
        direction: CopyDirection,
        host: &mut HostMemory,
    ) -> Result<(), DriverError> {
        self.step()?;
        let spans = self.spans.get(self.next).ok_or(DriverError::CopyPlan {
            reason: "more copies than the plan has",
        })?;
        self.next += 1;
        let mut store = self
            .store
            .as_ref()
            .ok_or(DriverError::NoBackingStore)?
            .lock();
        let mut at = copy.offset as usize;
        let bytes = host.as_mut_slice();
        for span in spans {
            let part = &mut bytes[at..at + span.len];
            match direction {
                CopyDirection::ToHost => store.read(span.owner, span.offset, part),
                CopyDirection::FromHost => store.write(span.owner, span.offset, part),
            }
            at += span.len;
        }
        Ok(())
    }

    fn record(&mut self) -> Result<(), DriverError> {
        self.step()
    }

    fn wait(&mut self, _recorded: bool) -> Result<(), DriverError> {
        self.step()
    }

    fn finish(&mut self) {
        self.over.store(true, Ordering::Release);
    }
}

impl SimDriver {
    /// [`Driver::start_copies`](crate::driver::Driver::start_copies) on the simulated device (see the
    /// module's documentation).
    pub(super) fn start_copy_job(&mut self, plan: CopyPlan) -> Result<CopyJob, DriverError> {
        plan.validate()?;
        self.copying.last_pinning = Some(plan.pinning);
        let spans: Vec<Vec<Span>> = (plan.copies.iter())
            .map(|c| self.spans(c.va, c.len))
            .collect::<Result<_, _>>()?;
        if self.store.is_none() && !plan.copies.is_empty() {
            return Err(DriverError::NoBackingStore);
        }
        // Waiting for the copy stream is a potentially unsafe call during a capture.
        self.refuse_in_capture(Op::Synchronize, Some(COPY_STREAM))?;
        let mut steps = VecDeque::new();
        for (op, bytes) in plan.work_steps() {
            let outcome = self.charge(op, bytes);
            let failed = outcome.is_err();
            steps.push_back(outcome);
            if failed {
                break;
            }
        }
        steps.push_back(self.charge(Op::RecordEvent, 0));
        steps.push_back(self.charge(Op::Synchronize, 0));
        let ranges = (plan.copies.iter()).map(|c| VaRange::new(c.va, c.len));
        let over = self.copying.add(ranges.collect());
        let run = SimCopies {
            steps,
            spans,
            next: 0,
            store: self.store.clone(),
            sleep: self.config.sleep_latency,
            over,
            pinned: Arc::clone(&self.copying.pinned),
        };
        Ok(CopyJob::new(plan, Box::new(run)))
    }
}
