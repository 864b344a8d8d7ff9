//! Sharing memory with other processes: exporting a live block's mappings, and mapping what another
//! process exported (`crate::strategy::sharing` says what is shared and why whole mappings).
//!
//! Exporting reads the page map and asks the supply for each handle's descriptor: an `export_handle` call
//! the first time a handle is shared, the same descriptor after, until the handle is released
//! (`supply/exports.rs`). The block's pages stay where they are while it is live: compaction and lending
//! move only idle pages. A tagged block is shared too: a sleep gives the exporter's handles back, while an
//! importer's mapping keeps the memory (and the bytes it had) until that importer closes it.
//!
//! Imported memory is a part of its own (`imports.rs`), which `mod.rs` calls.

use super::Expandable;
use crate::driver::{Driver, PhysPage};
use crate::strategy::error::Error;
use crate::strategy::sharing::{SharedMemory, SharedPart};

impl<D: Driver> Expandable<D> {
    /// Exports the mappings that cover the live block at `addr` (see the module's doc).
    pub(super) fn share_block(&mut self, addr: u64) -> Result<SharedMemory, Error> {
        let slot = (self.segments.slot_of(addr)).ok_or(Error::UnknownAddress { addr })?;
        let seg = self.segments.at(slot);
        let block = (seg.block_at(addr).filter(|block| block.is_live()))
            .ok_or(Error::UnknownAddress { addr })?;
        let (physical, lending) = (self.supply.physical(), self.supply.lending());
        let pages = seg.pages_of(addr, block.size);
        let pages = physical.widen_to_chunks(lending, seg, pages);
        let chunk_size = physical.chunk_pages() as u64 * self.page_size;
        // The mappings in address order: a lent page is a mapping of one page of a chunk, a chunk at home
        // one of all of it, any other page one of its own handle.
        let mut layout: Vec<(PhysPage, u64, u64)> = Vec::new();
        let mut page = pages.start;
        while page < pages.end {
            let handle = (seg.pages.handle(page)).ok_or(Error::UnknownAddress { addr })?;
            let (source, handle_size, size) = match lending.alias_at(seg.page_addr(page)) {
                Some(&piece) => (piece, chunk_size, self.page_size),
                None => match physical.chunk_at(lending, seg, page) {
                    // Widened to whole chunks, the range starts each chunk at its first page.
                    Some(chunk) if chunk.start == page => {
                        (PhysPage { handle, offset: 0 }, chunk_size, chunk_size)
                    }
                    Some(_) => return Err(Error::UnknownAddress { addr }),
                    None => (
                        PhysPage { handle, offset: 0 },
                        self.page_size,
                        self.page_size,
                    ),
                },
            };
            layout.push((source, handle_size, size));
            page += (size / self.page_size) as usize;
        }
        let start = seg.page_addr(pages.start);
        let size = block.size;
        // Its handles may now be mapped in another process too: they are never re-created
        // (`compaction:split`), or the two would no longer share the bytes.
        self.segments.at_mut(slot).shared = true;
        let mut parts = Vec::with_capacity(layout.len());
        for (source, handle_size, size) in layout {
            parts.push(SharedPart {
                fd: self.supply.export(&mut self.driver, source.handle)?,
                handle_size,
                handle_offset: source.offset,
                size,
            });
        }
        Ok(SharedMemory {
            parts,
            offset: addr - start,
            size,
        })
    }
}
