//! What one compaction (or release) has learnt about streams: those whose queued work is known complete,
//! and those an event query found busy, so that each stream is synchronized or queried at most once; or,
//! for one that waits for the device rather than for streams, whether it did.

use super::accounting::Books;
use super::streams::{StreamWaits, synchronize, synchronize_device};
use crate::driver::{Driver, StreamId};
use crate::strategy::error::Error;

/// How a compaction learns that an idle page's last use is complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Only segments whose stream an event query shows idle; never blocks.
    Query,
    /// Synchronize each segment's stream (once per compaction).
    Block,
}

/// What one compaction has learnt about streams: those whose queued work is known complete, and those an
/// event query found busy; or, for one that waits for the device rather than for streams
/// ([`by_device`](Self::by_device)), whether it did.
#[derive(Debug, Default)]
pub(crate) struct Compacting {
    done: Vec<StreamId>,
    busy: Vec<StreamId>,
    /// A blocking wait synchronizes the device, once, instead of the stream.
    by_device: bool,
    device_done: bool,
}

impl Compacting {
    /// A compaction whose blocking waits synchronize the device once, naming no stream.
    pub(super) fn by_device() -> Self {
        Self {
            by_device: true,
            ..Self::default()
        }
    }

    /// Synchronizes the device, once per compaction: every stream's queued work is complete after it.
    pub(super) fn device_done<D: Driver>(
        &mut self,
        driver: &mut D,
        books: &mut Books,
    ) -> Result<(), Error> {
        if !self.device_done {
            synchronize_device(driver, books)?;
            self.device_done = true;
        }
        Ok(())
    }

    /// Whether `stream`'s queued work is known complete for this compaction: synchronized (`Wait::Block`;
    /// the device, once, in a compaction [`by_device`](Self::by_device)) or shown idle by an event query
    /// (`Wait::Query`), each stream at most once.
    pub(super) fn stream_done<D: Driver>(
        &mut self,
        (driver, books, waits): (&mut D, &mut Books, &mut StreamWaits),
        stream: StreamId,
        wait: Wait,
    ) -> Result<bool, Error> {
        if self.device_done || self.done.contains(&stream) {
            return Ok(true);
        }
        if self.by_device && wait == Wait::Block {
            self.device_done(driver, books)?;
            return Ok(true);
        }
        let done = match wait {
            Wait::Block => {
                synchronize(driver, books, stream)?;
                true
            }
            Wait::Query if self.busy.contains(&stream) => false,
            Wait::Query => waits.stream_idle(driver, stream)?,
        };
        if done {
            self.done.push(stream);
        } else {
            self.busy.push(stream);
        }
        Ok(done)
    }
}
