//! Copies between device memory and host memory that run without the driver: what a sleep and a wake of
//! a tag move, at the link's speed, while other threads keep using the allocator.
//!
//! [`Driver::start_copies`](super::Driver::start_copies) checks a [`CopyPlan`] (every device range
//! mapped with access) and marks its device ranges in use by the driver's own copy stream: until the job
//! is over, an `unmap` of one of them fails with [`DriverError::UnmapWhileInUse`]. It returns a
//! [`CopyJob`], which holds what the backend needs ([`CopyRun`]) and runs the plan without the driver:
//! the allocator drops its lock for it.
//!
//! A job runs in one order, the same on every backend, so the simulator can decide its faults when it is
//! started and `AfterEffect` can name a step:
//! - to the host: for each host piece in order, its allocation if the plan allocates it
//!   ([`Op::HostAlloc`], page-locked memory where the backend can), then the copies into it
//!   ([`Op::CopyToHost`], asynchronous on the copy stream, so a piece is copied into while the next is
//!   pinned);
//! - from the host: every copy ([`Op::CopyFromHost`]);
//! - then an event recorded on the copy stream ([`Op::RecordEvent`]) and a wait for everything enqueued
//!   ([`Op::Synchronize`]; on the stream itself when the event could not be recorded).
//!
//! The first allocation or copy that fails ends the enqueueing; the job still records and waits, so no
//! copy is left running into or out of host memory it hands back. What a failure leaves: every piece
//! allocated or given comes back ([`CopyOutcome::pieces`]), the device memory is untouched by a copy to
//! the host, and a copy from the host may have written part of its range.

use super::error::DriverError;
use super::host_memory::{HostMemory, HostPinning};
use super::op::Op;
use std::fmt;

/// Which way a job copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// Device memory to host pieces (a sleep keeping its bytes).
    ToHost,
    /// Host pieces to device memory (a wake putting them back).
    FromHost,
}

impl CopyDirection {
    /// The operation its copies are counted, checked and faulted as.
    pub fn op(self) -> Op {
        match self {
            CopyDirection::ToHost => Op::CopyToHost,
            CopyDirection::FromHost => Op::CopyFromHost,
        }
    }
}

/// One copy of a job: `len` bytes at device address `va`, and at `offset` in host piece `piece`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCopy {
    /// The device address.
    pub va: u64,
    /// Bytes.
    pub len: u64,
    /// The host piece.
    pub piece: usize,
    /// The offset in the host piece.
    pub offset: u64,
}

/// What a job copies: host pieces, which of them it allocates, and the copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyPlan {
    /// Which way.
    pub direction: CopyDirection,
    /// The bytes of each host piece.
    pub pieces: Vec<u64>,
    /// Whether the job allocates each piece (to the host only); the others are given to
    /// [`CopyJob::run`].
    pub allocate: Vec<bool>,
    /// The copies, in order of piece, then of offset in it.
    pub copies: Vec<HostCopy>,
    /// How the pieces the job allocates are pinned.
    pub pinning: HostPinning,
}

impl CopyPlan {
    /// [`DriverError::CopyPlan`] unless every copy lies inside its piece, in order, and only a plan to the
    /// host allocates.
    pub fn validate(&self) -> Result<(), DriverError> {
        let bad = |reason| Err(DriverError::CopyPlan { reason });
        if self.allocate.len() != self.pieces.len() {
            return bad("one allocate flag per piece");
        }
        if self.direction == CopyDirection::FromHost && self.allocate.iter().any(|&a| a) {
            return bad("a copy from the host allocates nothing");
        }
        let mut last = (0, 0);
        for c in &self.copies {
            let inside = (self.pieces.get(c.piece))
                .is_some_and(|&len| c.offset.checked_add(c.len).is_some_and(|end| end <= len));
            if !inside || c.len == 0 {
                return bad("a copy lies outside its host piece");
            }
            if (c.piece, c.offset) < last {
                return bad("copies are ordered by piece and offset");
            }
            last = (c.piece, c.offset + c.len);
        }
        Ok(())
    }

    /// Bytes the copies move.
    pub fn bytes(&self) -> u64 {
        self.copies.iter().map(|c| c.len).sum()
    }

    /// The allocations and copies a job makes when none fails, in its order, as `(operation, bytes)`:
    /// what a backend counts. The event and the wait follow them, whatever happened.
    pub fn work_steps(&self) -> Vec<(Op, u64)> {
        let mut steps = Vec::with_capacity(self.copies.len() + self.pieces.len());
        match self.direction {
            CopyDirection::FromHost => {
                steps.extend(self.copies.iter().map(|c| (Op::CopyFromHost, c.len)));
            }
            CopyDirection::ToHost => {
                let mut copies = self.copies.iter().peekable();
                for (piece, (&len, &allocate)) in self.pieces.iter().zip(&self.allocate).enumerate()
                {
                    if allocate {
                        steps.push((Op::HostAlloc, len));
                    }
                    while let Some(c) = copies.next_if(|c| c.piece == piece) {
                        steps.push((Op::CopyToHost, c.len));
                    }
                }
            }
        }
        steps
    }
}

/// A backend's side of a job: one call per step, in the order of the module's documentation.
///
/// # What implementors must guarantee
/// - A copy may still run after [`copy`](CopyRun::copy) returns, but never past what the host memory it
///   was given can see: its storage waits for the copy before it is read, written or freed (CUDA's
///   page-locked memory does; ordinary memory is copied synchronously).
/// - [`wait`](CopyRun::wait) returns once every copy enqueued has finished, or the device has failed.
/// - [`finish`](CopyRun::finish) (called once, also when the job is dropped unrun) ends the guard on the
///   job's device ranges.
pub trait CopyRun: Send {
    /// Host memory for a piece of `len` bytes (page-locked where the backend can).
    fn alloc(&mut self, len: u64) -> Result<HostMemory, DriverError>;
    /// Enqueues `copy` between its device range and `host` (its piece), in `direction`.
    fn copy(
        &mut self,
        copy: &HostCopy,
        direction: CopyDirection,
        host: &mut HostMemory,
    ) -> Result<(), DriverError>;
    /// Records an event after every copy enqueued.
    fn record(&mut self) -> Result<(), DriverError>;
    /// Waits for every copy enqueued: for the event if `recorded`, else for the copy stream.
    fn wait(&mut self, recorded: bool) -> Result<(), DriverError>;
    /// Every copy of the job into or out of `host` is known complete (the wait succeeded): what the
    /// memory keeps to wait for them at its next access or its drop is let go, so that the access or the
    /// drop (under the allocator's lock) waits for no later job's copies.
    fn done(&mut self, _host: &mut HostMemory) {}
    /// The job is over: its device ranges may be unmapped again.
    fn finish(&mut self);
}

/// What a job did: its pieces, and the first failure.
#[derive(Debug)]
pub struct CopyOutcome {
    /// Each piece, `None` where the job could not allocate it (or, for a piece that was to be given, was
    /// not).
    pub pieces: Vec<Option<HostMemory>>,
    /// `Ok` if every step succeeded, else the first failure.
    pub result: Result<(), DriverError>,
}

/// Copies checked and started by a driver, to run without it ([`Driver::start_copies`](super::Driver::start_copies)).
pub struct CopyJob {
    plan: CopyPlan,
    run: Option<Box<dyn CopyRun>>,
}

impl CopyJob {
    /// A job running `plan` through `run` (for backends).
    pub fn new(plan: CopyPlan, run: Box<dyn CopyRun>) -> Self {
        Self {
            plan,
            run: Some(run),
        }
    }

    /// The plan.
    pub fn plan(&self) -> &CopyPlan {
        &self.plan
    }

    /// The same job with its backend wrapped by `wrap` (a driver wrapper that changes steps, such as
    /// `AfterEffect`).
    pub fn wrap(mut self, wrap: impl FnOnce(Box<dyn CopyRun>) -> Box<dyn CopyRun>) -> Self {
        self.run = self.run.take().map(wrap);
        self
    }

    /// Runs every step. `pieces[i]` is host piece `i` where the plan does not allocate it (memory kept
    /// from before, at least as long as the piece), `None` where it does. Returns every piece it has and
    /// the first failure; it returns only once nothing it enqueued still runs.
    pub fn run(mut self, mut pieces: Vec<Option<HostMemory>>) -> CopyOutcome {
        pieces.resize_with(self.plan.pieces.len(), || None);
        let Some(mut run) = self.run.take() else {
            return CopyOutcome {
                pieces,
                result: Err(DriverError::CopyPlan {
                    reason: "a job runs once",
                }),
            };
        };
        let failure = match self.check(&pieces) {
            Ok(()) => self.enqueue(&mut *run, &mut pieces).err(),
            Err(err) => Some(err),
        };
        let recorded = run.record();
        let waited = run.wait(recorded.is_ok());
        if recorded.is_ok() && waited.is_ok() {
            pieces.iter_mut().flatten().for_each(|host| run.done(host));
        }
        run.finish();
        let result = match (failure, recorded, waited) {
            (Some(err), _, _) | (None, Err(err), _) | (None, Ok(()), Err(err)) => Err(err),
            (None, Ok(()), Ok(())) => Ok(()),
        };
        CopyOutcome { pieces, result }
    }

    /// [`DriverError::CopyPlan`] unless `pieces` are what the plan says: given where it does not allocate
    /// them, at least as long as the piece.
    fn check(&self, pieces: &[Option<HostMemory>]) -> Result<(), DriverError> {
        let plan = &self.plan;
        for ((piece, &len), &allocate) in pieces.iter().zip(&plan.pieces).zip(&plan.allocate) {
            let fits = piece.as_ref().is_some_and(|p| p.len() as u64 >= len);
            if allocate == piece.is_some() || (!allocate && !fits) {
                return Err(DriverError::CopyPlan {
                    reason: "pieces are given exactly where the plan does not allocate them",
                });
            }
        }
        Ok(())
    }

    /// The allocations and copies, in the job's order, up to the first failure.
    fn enqueue(
        &self,
        run: &mut dyn CopyRun,
        pieces: &mut [Option<HostMemory>],
    ) -> Result<(), DriverError> {
        let plan = &self.plan;
        let mut copies = plan.copies.iter().peekable();
        for piece in 0..plan.pieces.len() {
            if plan.allocate[piece] {
                pieces[piece] = Some(run.alloc(plan.pieces[piece])?);
            }
            while let Some(c) = copies.next_if(|c| c.piece == piece) {
                let host = pieces[piece].as_mut().ok_or(DriverError::CopyPlan {
                    reason: "a copy into a piece that is missing",
                })?;
                run.copy(c, plan.direction, host)?;
            }
        }
        Ok(())
    }
}

impl Drop for CopyJob {
    /// A job dropped unrun ends its guard on the device ranges.
    fn drop(&mut self) {
        if let Some(mut run) = self.run.take() {
            run.finish();
        }
    }
}

impl fmt::Debug for CopyJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyJob")
            .field("direction", &self.plan.direction)
            .field("pieces", &self.plan.pieces.len())
            .field("copies", &self.plan.copies.len())
            .field("bytes", &self.plan.bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(direction: CopyDirection) -> CopyPlan {
        CopyPlan {
            direction,
            pieces: vec![8, 4],
            allocate: vec![direction == CopyDirection::ToHost; 2],
            copies: vec![
                HostCopy {
                    va: 0x1000,
                    len: 8,
                    piece: 0,
                    offset: 0,
                },
                HostCopy {
                    va: 0x2000,
                    len: 2,
                    piece: 1,
                    offset: 0,
                },
            ],
            pinning: HostPinning::default(),
        }
    }

    #[test]
    fn a_plan_says_its_steps_in_the_order_a_job_runs_them() {
        let to = plan(CopyDirection::ToHost);
        to.validate().unwrap();
        assert_eq!(
            to.work_steps(),
            [
                (Op::HostAlloc, 8),
                (Op::CopyToHost, 8),
                (Op::HostAlloc, 4),
                (Op::CopyToHost, 2)
            ]
        );
        let mut from = plan(CopyDirection::FromHost);
        from.validate().unwrap();
        assert_eq!(
            from.work_steps(),
            [(Op::CopyFromHost, 8), (Op::CopyFromHost, 2)]
        );
        assert_eq!(from.bytes(), 10);
        from.allocate[0] = true;
        assert!(from.validate().is_err(), "a copy from the host allocates");
        let mut outside = plan(CopyDirection::ToHost);
        outside.copies[1].offset = 3;
        assert!(outside.validate().is_err(), "a copy past its piece");
        let mut unordered = plan(CopyDirection::ToHost);
        unordered.copies.swap(0, 1);
        assert!(unordered.validate().is_err());
    }

    /// A backend that writes down the steps a job takes, its wait failing if asked.
    struct Steps {
        seen: std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>,
        wait_fails: bool,
    }

    impl CopyRun for Steps {
        fn alloc(&mut self, len: u64) -> Result<HostMemory, DriverError> {
            HostMemory::pageable(len as usize)
        }
        fn copy(
            &mut self,
            _: &HostCopy,
            _: CopyDirection,
            _: &mut HostMemory,
        ) -> Result<(), DriverError> {
            Ok(())
        }
        fn record(&mut self) -> Result<(), DriverError> {
            Ok(())
        }
        fn wait(&mut self, _: bool) -> Result<(), DriverError> {
            self.seen.lock().unwrap().push("wait");
            match self.wait_fails {
                true => Err(DriverError::Injected {
                    op: Op::Synchronize,
                    call: 0,
                }),
                false => Ok(()),
            }
        }
        fn done(&mut self, _: &mut HostMemory) {
            self.seen.lock().unwrap().push("done");
        }
        fn finish(&mut self) {
            self.seen.lock().unwrap().push("finish");
        }
    }

    /// Each piece hears that its copies are complete once the wait for them succeeded, and only then (the
    /// page-locked memory of a job whose wait failed still waits for its copies at its drop).
    #[test]
    fn pieces_are_told_their_copies_are_done_only_after_a_successful_wait() {
        for wait_fails in [false, true] {
            let seen = std::sync::Arc::default();
            let run = Steps {
                seen: std::sync::Arc::clone(&seen),
                wait_fails,
            };
            let outcome = CopyJob::new(plan(CopyDirection::ToHost), Box::new(run)).run(Vec::new());
            assert_eq!(outcome.result.is_err(), wait_fails);
            let expected: &[&str] = match wait_fails {
                false => &["wait", "done", "done", "finish"],
                true => &["wait", "finish"],
            };
            assert_eq!(*seen.lock().unwrap(), expected);
        }
    }
}
