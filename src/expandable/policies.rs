//! The policies, chosen once from the configuration: the one place where a policy is chosen. A new policy
//! is a file in `compaction/` or `handle_size/` that implements the folder's `Policy`, and one line here.
//! The orchestrator holds them and lends them to the parts that consult them (`supply/`, placement).

use super::compaction::{self, eager::Eager, pressure::Pressure, split::Split};
use super::handle_size::{self, chunks::Chunks, single_pages::SinglePages};
use crate::strategy::config::{Compaction, Config};

/// The policies an allocator follows.
#[derive(Debug)]
pub(super) struct Policies {
    /// When growth reclaims idle pages, and how (`compaction/`).
    pub compaction: Box<dyn compaction::Policy>,
    /// Chunks or single pages for new memory (`handle_size/`).
    pub handle_size: Box<dyn handle_size::Policy>,
}

impl Policies {
    /// The policies `config` chooses, for pages of `page_size` bytes.
    pub(super) fn chosen(config: &Config, page_size: u64) -> Self {
        let compaction: Box<dyn compaction::Policy> = match config.compaction {
            Compaction::Pressure => Box::new(Pressure),
            Compaction::Eager => Box::new(Eager),
            Compaction::Split => Box::new(Split),
        };
        // `large_handle` in whole pages, at least one.
        let pages = (config.large_handle / page_size).max(1) as usize;
        let handle_size: Box<dyn handle_size::Policy> = match config.compaction {
            Compaction::Pressure | Compaction::Split if pages > 1 => Box::new(Chunks {
                pages,
                headroom: config.large_handle_headroom,
            }),
            // Eager compaction moves idle pages one by one, which a chunk, unmapped only whole, would not
            // let it do.
            Compaction::Pressure | Compaction::Split | Compaction::Eager => Box::new(SinglePages),
        };
        Self {
            compaction,
            handle_size,
        }
    }
}
