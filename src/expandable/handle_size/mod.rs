//! Handle-size policies: whether new physical memory for a large-pool block comes as *chunks*, one driver
//! handle of several pages mapped at an aligned group of pages (few driver calls; but a chunk is unmapped
//! only whole, so a live block strands its idle pages), or as single pages (nothing stranded, about 10x
//! the calls). `docs/allocator.md`, "Compaction under pressure, and handle size".
//!
//! A policy decides and the supply does: the supply maps a chunk at each unmapped aligned group the policy
//! lets it ([`Policy::new_chunk`]), a pooled chunk first, and single pages everywhere else. The chunk's size
//! is fixed for the allocator's life ([`Policy::chunk_pages`]): the page map tells a chunk by it. One file
//! per policy, chosen from the configuration in `policies.rs`:
//!
//! | policy | file | chosen by |
//! |---|---|---|
//! | `Chunks` | `chunks.rs` | `compaction:pressure` with `large_handle_mb` over one page (the default, 20 MiB), `large_handle_headroom` |
//! | `SinglePages` | `single_pages.rs` | `compaction:eager`, or `large_handle_mb` of one page or less |

pub(super) mod chunks;
pub(super) mod single_pages;

use super::supply::Growth;
use std::fmt::Debug;

/// How large the handles of new physical memory are.
pub(super) trait Policy: Debug + Send + Sync {
    /// Pages per chunk, the multi-page handle of the large pool; 1: every handle is a single page.
    fn chunk_pages(&self) -> usize;

    /// Whether a new chunk is created for an aligned group of unmapped pages of a large-pool block, with
    /// reserved memory against the budget as `growth` says (`extra`: the chunk's bytes). If not, the group's
    /// missing pages come as single pages. (A pooled chunk is mapped whatever this says.)
    fn new_chunk(&self, growth: Growth) -> bool;
}
