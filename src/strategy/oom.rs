//! An out-of-memory error that explains itself: PyTorch's first sentence, then a diagnosis computed from the
//! allocator's state and one suggestion that follows from the numbers.
//!
//! The first sentence is PyTorch's, word for word and with its size formatting (`format_size` of
//! `c10/cuda/CUDACachingAllocator.cpp`, here [`format_size_pytorch`]), so tools and people that recognise
//! "CUDA out of memory. Tried to allocate ..." recognise this one. What follows says where the memory is
//! (allocated, reserved but unallocated, idle handles, the largest free block), what the allocator already
//! tried (compaction, releasing its cache, a retry) and one thing to do about it.

use crate::base::size::{GIB, KIB, MIB};
use crate::driver::StreamId;
use crate::strategy::config::{Compaction, Config};
use std::fmt;

/// Something the allocator did to find memory for the failed request before giving up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimStep {
    /// Idle pages elsewhere were unmapped to map them under the request (cuvmm's compaction).
    Compaction {
        /// Pages unmapped.
        pages: u64,
    },
    /// Old cached blocks were freed because the memory held passed `garbage_collection_threshold`.
    GarbageCollection,
    /// Cached memory was given back to the driver (PyTorch's `release_cached_blocks`, cuvmm's idle pages and
    /// pooled handles).
    ReleaseCache {
        /// Bytes given back.
        bytes: u64,
    },
    /// The device allocation was tried once more after releasing the cache (`num_alloc_retries`).
    Retry,
}

impl fmt::Display for ReclaimStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReclaimStep::Compaction { pages } => {
                write!(f, "unmapped {pages} idle pages to reuse them")
            }
            ReclaimStep::GarbageCollection => write!(f, "garbage-collected old cached blocks"),
            ReclaimStep::ReleaseCache { bytes } => {
                write!(f, "released {} of cache", format_size_pytorch(*bytes))
            }
            ReclaimStep::Retry => write!(f, "retried the device allocation"),
        }
    }
}

/// The setting that gives back idle pages stranded in multi-page handles that live allocations touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrandedRemedy {
    /// `compaction:split`: such handles are re-created as single pages under pressure.
    Split,
    /// Single-page handles (`large_handle_mb` of the page size), where split is already set and still
    /// left pages stranded (in a live CUDA graph pool, memory shared with another process, a capture).
    SinglePages {
        /// The page size in bytes.
        page_size: u64,
    },
}

impl StrandedRemedy {
    /// Puts the setting into `config`.
    pub fn apply_to(self, config: &mut Config) {
        match self {
            StrandedRemedy::Split => config.compaction = Compaction::Split,
            StrandedRemedy::SinglePages { page_size } => config.large_handle = page_size,
        }
    }
}

impl fmt::Display for StrandedRemedy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            StrandedRemedy::Split => f.write_str("compaction:split"),
            StrandedRemedy::SinglePages { page_size } if page_size % MIB == 0 => {
                write!(f, "large_handle_mb:{}", page_size / MIB)
            }
            StrandedRemedy::SinglePages { .. } => f.write_str("large_handle_mb of the page size"),
        }
    }
}

/// The one thing to do about an out-of-memory error, chosen from its numbers by
/// [`OutOfMemory::suggestion`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suggestion {
    /// The allocator's memory limit (PyTorch's memory fraction), not the device, refused the request.
    RaiseLimit {
        /// The limit in bytes.
        allowed: u64,
        /// Bytes the limit would have to grow by.
        need: u64,
    },
    /// The device margin ([`Config::device_margin`](crate::Config::device_margin)), not the device, refused
    /// the request: the device had room, but not beyond the margin.
    LowerMargin {
        /// The margin in bytes.
        margin: u64,
        /// Bytes the margin would have to shrink by.
        need: u64,
    },
    /// Free device memory plus what the allocator holds unallocated would serve the request, but not in
    /// one piece: fragmentation. `remedy` says what setting or allocator avoids it.
    Fragmentation {
        /// Bytes reserved but unallocated.
        unallocated: u64,
        /// What to change.
        remedy: &'static str,
    },
    /// Memory used outside this allocator (other processes, other allocators) is what is missing.
    OtherUsers {
        /// Bytes in use on the device that this allocator does not hold.
        outside: u64,
        /// Bytes missing for the request.
        need: u64,
    },
    /// Free device memory plus the idle pages stranded in multi-page handles that live allocations still
    /// touch would hold the request: `setting` gives such pages back.
    Stranded {
        /// Stranded bytes ([`OutOfMemory::stranded`]).
        stranded: u64,
        /// The setting that would have made the request fit.
        setting: StrandedRemedy,
    },
    /// The device is truly full: live allocations must shrink by at least `need` bytes.
    ReduceUsage {
        /// Bytes missing for the request.
        need: u64,
    },
}

impl fmt::Display for Suggestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = |b: u64| format_size_pytorch(b);
        match *self {
            Suggestion::RaiseLimit { allowed, need } => write!(
                f,
                "The memory limit of {} refused it: raise the memory fraction by at least {}.",
                size(allowed),
                size(need)
            ),
            Suggestion::LowerMargin { margin, need } => write!(
                f,
                "The device margin of {} kept free refused it: lower device_margin_mb (torch_memory_saver's \
                 memory_margin_bytes) by at least {}.",
                size(margin),
                size(need)
            ),
            Suggestion::Fragmentation {
                unallocated,
                remedy,
            } => write!(
                f,
                "Free and unallocated memory would hold the request but not in one piece \
                 ({} reserved but unallocated): {remedy}.",
                size(unallocated)
            ),
            Suggestion::OtherUsers { outside, need } => write!(
                f,
                "{} of the device is used outside this allocator: free at least {} there \
                 (another process or allocator).",
                size(outside),
                size(need)
            ),
            Suggestion::Stranded { stranded, setting } => write!(
                f,
                "{} of idle pages lie in multi-page handles (large_handle_mb) that live allocations still \
                 touch, which are unmapped only whole; with them the request would fit: set {setting} \
                 (CUVMM_ALLOC_CONF){}.",
                size(stranded),
                match setting {
                    StrandedRemedy::Split => {
                        ", or call release_stranded() where no other thread launches work"
                    }
                    StrandedRemedy::SinglePages { .. } => "",
                }
            ),
            Suggestion::ReduceUsage { need } => write!(
                f,
                "The device is full of live allocations: free at least {} more (a smaller batch, \
                 shorter sequences, or activation checkpointing).",
                size(need)
            ),
        }
    }
}

/// The state of the allocator when a request could not be served: the same numbers for programs as the
/// message gives people.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutOfMemory {
    /// The allocator's name ([`Strategy::name`](crate::Strategy::name)).
    pub allocator: &'static str,
    /// The device's ordinal.
    pub device: usize,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes the allocator tried to obtain for it: the rounded request for cuvmm; the segment size
    /// (PyTorch's `alloc_size`) for the models of PyTorch. The message's "Tried to allocate", as PyTorch's.
    pub alloc_size: u64,
    /// Stream the request was made on.
    pub stream: StreamId,
    /// Total bytes of the device.
    pub device_total: u64,
    /// Bytes the device reported free at the failure.
    pub device_free: u64,
    /// The allocator's memory limit, when one is set (PyTorch's memory fraction).
    pub allowed: Option<u64>,
    /// Bytes of the device that the request's growth had to leave free (the device margin; 0: none).
    pub margin: u64,
    /// Bytes held by live allocations.
    pub allocated: u64,
    /// Physical bytes held by the allocator (live, cached and idle).
    pub reserved: u64,
    /// Physical bytes held but touched by no live allocation.
    pub idle: u64,
    /// Of `idle`, bytes held as unmapped handles (cuvmm's pool; 0 for the models of PyTorch).
    pub idle_handles: u64,
    /// Of `idle`, bytes of idle pages stranded in multi-page handles (cuvmm's 20 MiB chunks) that live
    /// allocations still touch: a handle is unmapped only whole, so they could not be given back.
    pub stranded: u64,
    /// The setting that gives stranded pages back; `None` where none applies (the models of PyTorch).
    pub stranded_remedy: Option<StrandedRemedy>,
    /// Largest request that could have been served without a driver call.
    pub largest_free_block: u64,
    /// Whether the cache was released and the request retried before giving up.
    pub retried: bool,
    /// Bytes mapped for live CUDA graph pools, which only their graphs' allocations may use.
    pub graph_pool_bytes: u64,
    /// Whether a capture was underway: nothing could be waited for or unmapped to make room.
    pub capturing: bool,
    /// The tags asleep and the bytes each gave back (`sleep`): memory another job may be using now, that
    /// their wake needs again.
    pub asleep: Vec<(String, u64)>,
    /// What the allocator tried for this request, in order.
    pub reclaim: Vec<ReclaimStep>,
}

impl OutOfMemory {
    /// Bytes reserved by the allocator but not allocated.
    pub fn unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }

    /// Bytes in use on the device that this allocator does not hold.
    pub fn outside(&self) -> u64 {
        self.device_total
            .saturating_sub(self.device_free)
            .saturating_sub(self.reserved)
    }

    /// The one thing to do, from the numbers: a memory limit that refused the request; else a device margin
    /// that did (the device had room, but not beyond the margin); else, where free
    /// memory plus the idle pages stranded in handles that live allocations touch would hold it, the setting
    /// that gives those back; else fragmentation
    /// if free plus unallocated memory would hold the request; else, with `need` the bytes missing,
    /// other users of the device if they hold at least that much, or smaller live allocations.
    pub fn suggestion(&self) -> Suggestion {
        if let Some(allowed) = self.allowed {
            let wanted = self.reserved.saturating_add(self.alloc_size);
            if wanted > allowed && self.device_free >= self.alloc_size {
                return Suggestion::RaiseLimit {
                    allowed,
                    need: wanted - allowed,
                };
            }
        }
        let beyond_margin = self.device_free.saturating_sub(self.margin);
        if self.margin > 0 && self.device_free >= self.alloc_size && beyond_margin < self.alloc_size
        {
            return Suggestion::LowerMargin {
                margin: self.margin,
                need: self.alloc_size - beyond_margin,
            };
        }
        if let Some(setting) = self.stranded_remedy
            && self.stranded > 0
            && self.device_free.saturating_add(self.stranded) >= self.alloc_size
        {
            return Suggestion::Stranded {
                stranded: self.stranded,
                setting,
            };
        }
        let unallocated = self.unallocated();
        let reachable = self.device_free.saturating_add(unallocated);
        if reachable >= self.alloc_size {
            return Suggestion::Fragmentation {
                unallocated,
                remedy: remedy(self.allocator),
            };
        }
        let need = self.alloc_size - reachable;
        let outside = self.outside();
        if outside >= need {
            Suggestion::OtherUsers { outside, need }
        } else {
            Suggestion::ReduceUsage { need }
        }
    }
}

/// What avoids fragmentation for each allocator.
fn remedy(allocator: &str) -> &'static str {
    match allocator {
        "classic" => {
            "set expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF or CUVMM_ALLOC_CONF), or use cuvmm, so free \
             memory is not stranded inside split segments"
        }
        "pytorch-expandable" => {
            "use cuvmm, whose pages move to whichever stream and pool needs them instead of staying in \
             per-stream segments of 20 MiB pages"
        }
        "cuvmm" => {
            "the unallocated bytes lie in pages that live allocations partly use; a smaller page_size_mb \
             strands less of them"
        }
        _ => "an allocator that does not split its cached blocks (cuvmm) avoids it",
    }
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = |b: u64| format_size_pytorch(b);
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            size(self.alloc_size),
            self.device,
            size(self.device_total),
            size(self.device_free),
        )?;
        if let Some(allowed) = self.allowed {
            write!(f, "{} allowed; ", size(allowed))?;
        }
        if self.margin > 0 {
            write!(f, "{} kept free (device margin); ", size(self.margin))?;
        }
        write!(
            f,
            "Of the allocated memory {} is allocated by {}, and {} is reserved by {} but unallocated \
             ({} in idle handles; largest free block {}). ",
            size(self.allocated),
            self.allocator,
            size(self.unallocated()),
            self.allocator,
            size(self.idle_handles),
            size(self.largest_free_block),
        )?;
        let suggestion = self.suggestion();
        // A `Stranded` suggestion names the stranded bytes itself: said once.
        if self.stranded > 0 && !matches!(suggestion, Suggestion::Stranded { .. }) {
            write!(
                f,
                "{} of the idle pages lie in multi-page handles that live allocations still touch. ",
                size(self.stranded)
            )?;
        }
        if self.graph_pool_bytes > 0 {
            write!(
                f,
                "{} is held by CUDA graphs' private pools. ",
                size(self.graph_pool_bytes)
            )?;
        }
        if !self.asleep.is_empty() {
            write!(f, "Asleep (memory given back, addresses kept):")?;
            for (i, (tag, bytes)) in self.asleep.iter().enumerate() {
                let sep = if i == 0 { "" } else { "," };
                write!(f, "{sep} tag {tag:?} {}", size(*bytes))?;
            }
            write!(f, ". ")?;
        }
        if self.capturing {
            write!(
                f,
                "A CUDA graph was being captured, so nothing idle could be waited for or unmapped. "
            )?;
        }
        if self.reclaim.is_empty() {
            write!(f, "Nothing could be reclaimed. ")?;
        } else {
            write!(f, "Before failing it ")?;
            for (i, step) in self.reclaim.iter().enumerate() {
                let sep = match i {
                    0 => "",
                    _ if i + 1 == self.reclaim.len() => " and ",
                    _ => ", ",
                };
                write!(f, "{sep}{step}")?;
            }
            write!(f, ". ")?;
        }
        write!(f, "{suggestion}")
    }
}

impl std::error::Error for OutOfMemory {}

/// PyTorch's `format_size` (`c10/cuda/CUDACachingAllocator.cpp`), used in its out-of-memory message: up to
/// 1024 bytes "N bytes", then KiB up to 1 MiB, MiB up to 1 GiB, else GiB, with two decimals.
pub fn format_size_pytorch(bytes: u64) -> String {
    if bytes <= KIB {
        format!("{bytes} bytes")
    } else if bytes <= MIB {
        format!("{:.2} KiB", bytes as f64 / KIB as f64)
    } else if bytes <= GIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    }
}

#[cfg(test)]
mod tests;
