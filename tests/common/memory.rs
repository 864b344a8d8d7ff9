//! Which physical memory backs an address range of the simulated device, to check that memory pending work
//! or a live graph may still touch is not handed out again under another address (a lent page is mapped a
//! second time elsewhere); and the large-pool handle settings the stream and graph models run under.

use cuvmm::Config;
use cuvmm::driver::VaRange;
use cuvmm::driver::sim::{Owner, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;

/// Physical memory: bytes `start .. end` of an owner's.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    owner: Owner,
    start: u64,
    end: u64,
}

/// The physical memory behind `range`, page by page (`page` bytes); none where nothing is mapped.
pub fn physical(driver: &SimDriver, range: VaRange, page: u64) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut addr = range.start;
    while addr < range.end() {
        let len = ((addr / page + 1) * page).min(range.end()) - addr;
        if let Some((owner, start)) = driver.physical_at(addr) {
            pieces.push(Piece {
                owner,
                start,
                end: start + len,
            });
        }
        addr += len;
    }
    pieces
}

/// Whether two sets of pieces share a byte.
pub fn shares_memory(a: &[Piece], b: &[Piece]) -> bool {
    a.iter().any(|x| {
        b.iter()
            .any(|y| x.owner == y.owner && x.start < y.end && y.start < x.end)
    })
}

/// Large-pool handle sizes for pages of `page` bytes (single pages, 4-page chunks, and the default, 20 MiB,
/// larger than a test device), each with whether the device maps part of a handle, so that idle pages of
/// chunks in use are lent (CUDA does not).
pub fn handle_settings(page: u64) -> [(u64, bool); 5] {
    let default = cuvmm::config::DEFAULT_LARGE_HANDLE;
    [
        (page, false),
        (4 * page, false),
        (4 * page, true),
        (default, false),
        (default, true),
    ]
}

/// An expandable allocator configured by `config`, its large-pool handles `handle` bytes, on a simulated
/// device of `pages` pages of `page` bytes with its backing store on and partial mappings as `partial`.
pub fn chunked(
    page: u64,
    pages: u64,
    config: Config,
    (handle, partial): (u64, bool),
) -> Expandable<SimDriver> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(page * pages)
            .with_granularity(page)
            .with_backing_store(true)
            .with_partial_mappings(partial),
    );
    let config = Config {
        large_handle: handle,
        ..config
    };
    Expandable::new(sim, config).expect("valid configuration")
}
