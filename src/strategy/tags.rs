//! What a strategy with [`Tags`](super::capabilities::Tags) hands out about its tags: a tag as reported
//! ([`TagInfo`]), and a sleep or wake begun under the caller's lock ([`Begun`]) whose copies
//! ([`TagCopy`]) run without it, so that other threads allocate while a tag's bytes cross the link
//! (docs/allocator.md, "Sleep and wake"). The copies themselves are the driver's
//! ([`CopyJob`]); the strategy plans them and takes their outcome back.

#![deny(unsafe_code)]

use crate::driver::{CopyJob, CopyOutcome, DriverError, HostMemory};

/// A tag as [`Tags::tag_infos`](super::capabilities::Tags::tag_infos) reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TagInfo {
    /// The tag's name.
    pub name: String,
    /// `awake`, `asleep`, `sleeping` (a sleep or wake failed half way) or `copying` (a sleep or wake is
    /// copying its bytes now).
    pub state: &'static str,
    /// Bytes of its live allocations (rounded as the allocator rounds them).
    pub live_bytes: u64,
    /// Bytes of pages its wake would map now.
    pub asleep_bytes: u64,
    /// Whether its host memory holds its bytes (it sleeps with them kept).
    pub bytes_kept: bool,
    /// Bytes of host memory it holds (its kept bytes, or buffers kept for its next sleep).
    pub host_kept_bytes: u64,
}

/// A sleep, a wake or a preparation begun under the caller's lock: done already, or a job to run without
/// it and hand back (`finish_sleep`, `finish_wake`, `finish_prepare_sleep`).
#[derive(Debug)]
pub enum Begun<T> {
    /// Nothing to copy: this is the result.
    Done(T),
    /// Copies to [`run`](TagCopy::run).
    Copy(Box<TagCopy>),
}

/// A sleep's or a wake's copies, run without the allocator's lock: made by `begin_sleep` / `begin_wake`
/// under it, [`run`](Self::run) by the caller, and handed back to `finish_sleep` / `finish_wake` under it
/// (a preparation's pinning, `begin_prepare_sleep` / `finish_prepare_sleep`, is such a job with no copies;
/// its tag stays awake). Until then the tag of a sleep or a wake is *busy*: a sleep or wake of it is [`Error::TagBusy`](crate::Error::TagBusy), an
/// allocation under it [`Error::TagAsleep`](crate::Error::TagAsleep), a free of its memory takes effect once
/// it is awake, and its pages are neither unmapped nor taken by compaction.
#[derive(Debug)]
pub struct TagCopy {
    /// The strategy's own number for the tag.
    id: u32,
    name: String,
    job: Option<CopyJob>,
    pieces: Vec<Option<HostMemory>>,
    result: Option<Result<(), DriverError>>,
    bytes: u64,
    pinned: u64,
}

impl TagCopy {
    /// The copies of `job` for the tag `name` (the strategy's number `id`), with the host `pieces` they
    /// copy to or from (`None`: a piece the job allocates).
    pub(crate) fn new(id: u32, name: &str, job: CopyJob, pieces: Vec<Option<HostMemory>>) -> Self {
        let plan = job.plan();
        let pinned = (plan.pieces.iter().zip(&plan.allocate))
            .filter(|&(_, &allocate)| allocate)
            .map(|(&len, _)| len)
            .sum();
        Self {
            id,
            name: name.to_owned(),
            bytes: plan.bytes(),
            pinned,
            job: Some(job),
            pieces,
            result: None,
        }
    }

    /// The tag's name.
    pub fn tag(&self) -> &str {
        &self.name
    }

    /// Bytes the copies move.
    pub fn moved_bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of host memory the job pins (the pieces the tag did not hold already).
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned
    }

    /// Runs the copies (once; no lock needed): returns once none runs.
    pub fn run(&mut self) {
        if let Some(job) = self.job.take() {
            let CopyOutcome { pieces, result } = job.run(std::mem::take(&mut self.pieces));
            self.pieces = pieces;
            self.result = Some(result);
        }
    }

    /// The tag's number, the pieces that came back and the outcome (an error if the copies were never
    /// run).
    pub(crate) fn into_outcome(mut self) -> (u32, Vec<HostMemory>, Result<(), DriverError>) {
        let result = self.result.take().unwrap_or(Err(DriverError::CopyPlan {
            reason: "the copies were not run",
        }));
        // A job dropped unrun ends its guard on the device ranges.
        drop(self.job.take());
        let pieces = std::mem::take(&mut self.pieces).into_iter().flatten();
        (self.id, pieces.collect(), result)
    }
}
