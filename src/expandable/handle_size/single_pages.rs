//! Single pages: every handle is one page, so every idle page can be unmapped and moved, and none is
//! stranded by a live neighbour, at about 10x the driver calls of chunks. What `compaction:eager` needs (it
//! moves idle pages one by one) and what `large_handle_mb` of one page asks for.

use super::Policy;
use crate::expandable::supply::Growth;

/// One page per handle.
#[derive(Debug)]
pub(crate) struct SinglePages;

impl Policy for SinglePages {
    fn chunk_pages(&self) -> usize {
        1
    }

    fn new_chunk(&self, _growth: Growth) -> bool {
        false
    }
}
