//! The process's exports ([`crate::sharing`]): one per *range* of mappings shared, held while a live
//! allocation shared through it lives.
//!
//! Allocations that lie on the same mappings (small tensors on one 20 MiB chunk, or one 2 MiB page) are
//! shared through one export, with one handle string: an importer that keeps its mappings by handle string,
//! as PyTorch's `getIpcDevPtr` and the C++ layer's do, maps the range once for all of them, as it does for
//! PyTorch's expandable segments (whose handle string is the segment range's). Each allocation has its own
//! offset in the range. The allocator exports a handle once (one descriptor per handle, kept until its
//! release), so a range is known by its handles' descriptors and the piece of each it maps.
//!
//! An allocation freed ([`Exports::remove`]) leaves its range's export to the other allocations shared
//! through it; the last one takes it away, and a later share of the same range makes a new export (a new
//! id, so an importer's mapping of the old handle string is not taken for the new one).

use cuvmm::sharing::SharedPart;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// An allocation: which registry's allocator (tests build several registries in one process), which
/// device, which address.
pub type Allocation = (u64, i32, u64);

/// A range of mappings, as an export is known: the registry, the device, and per part its handle's
/// descriptor (by identity: the allocator keeps one per handle), the first byte of the handle mapped and
/// the bytes mapped.
type Range = (u64, i32, Vec<(usize, u64, u64)>);

/// One range's export.
#[derive(Debug)]
struct Export {
    range: Range,
    /// The descriptor of each part; held here, they stay open while the export is.
    fds: Vec<Arc<OwnedFd>>,
    /// The handle string given for every allocation shared through it.
    handle: Vec<u8>,
    /// Allocations shared through it and not freed.
    users: usize,
}

/// The exports, by id, by range, and the allocations shared through them.
#[derive(Debug, Default)]
pub struct Exports {
    by_id: HashMap<u64, Export>,
    by_range: HashMap<Range, u64>,
    /// Each allocation shared: its export's id and its offset in the range.
    by_allocation: HashMap<Allocation, (u64, u64)>,
}

/// What [`Exports::insert`] needs to make a new export if the range has none.
pub struct Candidate<'a> {
    /// The allocation shared.
    pub allocation: Allocation,
    /// Its offset in the range.
    pub offset: u64,
    /// The range's parts, as the allocator exported them.
    pub parts: &'a [SharedPart<Arc<OwnedFd>>],
}

impl Exports {
    /// The handle string and offset of an allocation shared before and not freed since.
    pub fn held(&self, allocation: Allocation) -> Option<(Vec<u8>, u64)> {
        let &(id, offset) = self.by_allocation.get(&allocation)?;
        Some((self.by_id.get(&id)?.handle.clone(), offset))
    }

    /// Shares `candidate`'s allocation through its range's export, made with `handle(id)` (the handle
    /// string of a new export `id`) if the range has none; returns the handle string and offset. An
    /// allocation another thread shared meanwhile keeps what it was given.
    pub fn insert(
        &mut self,
        candidate: Candidate<'_>,
        id: u64,
        handle: impl FnOnce(u64) -> Vec<u8>,
    ) -> (Vec<u8>, u64) {
        if let Some(held) = self.held(candidate.allocation) {
            return held;
        }
        let (registry, device, _) = candidate.allocation;
        let pieces = (candidate.parts.iter())
            .map(|p| (Arc::as_ptr(&p.fd) as usize, p.handle_offset, p.size))
            .collect();
        let range: Range = (registry, device, pieces);
        let id = match self.by_range.get(&range) {
            Some(&existing) => existing,
            None => {
                self.by_range.insert(range.clone(), id);
                id
            }
        };
        let export = self.by_id.entry(id).or_insert_with(|| Export {
            range,
            fds: candidate.parts.iter().map(|p| Arc::clone(&p.fd)).collect(),
            handle: handle(id),
            users: 0,
        });
        export.users += 1;
        (self.by_allocation).insert(candidate.allocation, (id, candidate.offset));
        (export.handle.clone(), candidate.offset)
    }

    /// Forgets a freed allocation; its range's export goes with its last allocation.
    pub fn remove(&mut self, allocation: Allocation) {
        if let Some((id, _)) = self.by_allocation.remove(&allocation) {
            self.release(id);
        }
    }

    /// Forgets the allocations `doomed` says.
    pub fn remove_where(&mut self, doomed: impl Fn(Allocation) -> bool) {
        let gone: Vec<Allocation> = (self.by_allocation.keys())
            .copied()
            .filter(|&allocation| doomed(allocation))
            .collect();
        for allocation in gone {
            self.remove(allocation);
        }
    }

    /// One allocation fewer through export `id`.
    fn release(&mut self, id: u64) {
        let Some(export) = self.by_id.get_mut(&id) else {
            return;
        };
        export.users = export.users.saturating_sub(1);
        if export.users == 0
            && let Some(export) = self.by_id.remove(&id)
        {
            self.by_range.remove(&export.range);
        }
    }

    /// Duplicates of export `id`'s descriptors, in order.
    pub fn descriptors(&self, id: u64) -> Result<Vec<OwnedFd>, String> {
        let export = (self.by_id.get(&id))
            .ok_or_else(|| "no such export: the exporting process freed that memory".to_owned())?;
        (export.fds.iter())
            .map(|fd| {
                fd.try_clone()
                    .map_err(|err| format!("cannot duplicate a descriptor: {err}"))
            })
            .collect()
    }

    /// Allocations shared and not freed.
    pub fn allocations(&self) -> usize {
        self.by_allocation.len()
    }

    /// Exports held (one per range).
    pub fn exports(&self) -> usize {
        self.by_id.len()
    }
}

/// The process's exports under a lock, with their number of allocations readable without it.
#[derive(Debug, Default)]
pub struct ExportTable {
    exports: Mutex<Exports>,
    /// [`Exports::allocations`], read without the lock at every free.
    len: AtomicUsize,
}

impl ExportTable {
    /// Runs `change` on the exports under the lock, and publishes their number of allocations.
    pub fn with<T>(&self, change: impl FnOnce(&mut Exports) -> T) -> T {
        // A panic while the table was locked left it whole: each change completes its maps in step before
        // anything that can panic (an allocation failure aborts).
        let mut exports = (self.exports.lock()).unwrap_or_else(|poisoned| poisoned.into_inner());
        let out = change(&mut exports);
        self.len.store(exports.allocations(), Ordering::Release);
        out
    }

    /// Allocations shared and not freed: one atomic load.
    pub fn allocations(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }
}

impl crate::transport::Exports for ExportTable {
    fn descriptors(&self, id: u64) -> Result<Vec<OwnedFd>, String> {
        self.with(|exports| exports.descriptors(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(fds: &[&Arc<OwnedFd>], size: u64) -> Vec<SharedPart<Arc<OwnedFd>>> {
        (fds.iter())
            .map(|fd| SharedPart {
                fd: Arc::clone(fd),
                handle_size: size,
                handle_offset: 0,
                size,
            })
            .collect()
    }

    fn fd() -> Arc<OwnedFd> {
        Arc::new(OwnedFd::from(
            std::fs::File::open("/dev/null").expect("/dev/null opens"),
        ))
    }

    /// Allocations on one range share its export and handle string, each with its offset; one on another
    /// range has its own; a second share of one allocation (another thread's at once) gives what the first
    /// did; the export goes with the last allocation on it, and the range shared again is a new export.
    #[test]
    fn allocations_on_one_range_share_one_export_until_the_last_is_freed() {
        let (a, b) = (fd(), fd());
        let chunk = parts(&[&a], 20);
        let two = parts(&[&a, &b], 20);
        let mut t = Exports::default();
        let share = |t: &mut Exports, ptr: u64, offset, parts: &[_], id: u64| {
            let candidate = Candidate {
                allocation: (1, 0, ptr),
                offset,
                parts,
            };
            t.insert(candidate, id, |id| id.to_le_bytes().to_vec())
        };
        assert_eq!(
            share(&mut t, 0x100, 0, &chunk, 7),
            (7u64.to_le_bytes().to_vec(), 0)
        );
        assert_eq!(
            share(&mut t, 0x200, 4, &chunk, 8),
            (7u64.to_le_bytes().to_vec(), 4)
        );
        assert_eq!(
            share(&mut t, 0x200, 4, &chunk, 9),
            (7u64.to_le_bytes().to_vec(), 4),
            "again"
        );
        assert_eq!(
            share(&mut t, 0x300, 6, &two, 10),
            (10u64.to_le_bytes().to_vec(), 6)
        );
        assert_eq!((t.allocations(), t.exports()), (3, 2));
        assert_eq!(t.descriptors(10).map(|fds| fds.len()), Ok(2));
        t.remove((1, 0, 0x100));
        assert!(t.descriptors(7).is_ok(), "0x200 still holds it");
        t.remove_where(|(_, _, ptr)| ptr >= 0x200);
        assert_eq!((t.allocations(), t.exports()), (0, 0));
        assert!(t.descriptors(7).is_err());
        assert_eq!(
            share(&mut t, 0x100, 0, &chunk, 11).0,
            11u64.to_le_bytes().to_vec(),
            "a new export"
        );
    }
}
