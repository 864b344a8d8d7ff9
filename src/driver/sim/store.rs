//! The sparse byte backing store: bytes belong to physical memory, not to virtual addresses.
//!
//! Bytes are kept per owner of physical memory (a handle from `create`, or an allocation from `malloc`) at
//! offsets inside it, in 4 KiB chunks allocated on first write. When a handle is unmapped and mapped
//! elsewhere its bytes move with it, exactly like real memory. Unwritten bytes read as 0.

use std::collections::HashMap;

/// Bytes per chunk of the store.
const CHUNK: usize = 4096;

/// Who owns a piece of physical memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Owner {
    /// A handle from `create`, by its number.
    Handle(u64),
    /// An allocation from `malloc`, by its address.
    Malloc(u64),
}

/// Written bytes, by owner and chunk index.
#[derive(Debug, Clone, Default)]
pub(super) struct ByteStore {
    owners: HashMap<Owner, HashMap<u64, Box<[u8; CHUNK]>>>,
}

impl ByteStore {
    /// Writes `data` at `offset` inside `owner`'s memory.
    pub(super) fn write(&mut self, owner: Owner, offset: u64, data: &[u8]) {
        let chunks = self.owners.entry(owner).or_default();
        let mut pos = offset;
        let mut rest = data;
        while !rest.is_empty() {
            let (index, within) = split(pos);
            let n = rest.len().min(CHUNK - within);
            let chunk = chunks.entry(index).or_insert_with(|| Box::new([0; CHUNK]));
            chunk[within..within + n].copy_from_slice(&rest[..n]);
            rest = &rest[n..];
            pos += n as u64;
        }
    }

    /// Fills `out` with the bytes at `offset` inside `owner`'s memory.
    pub(super) fn read(&self, owner: Owner, offset: u64, out: &mut [u8]) {
        let chunks = self.owners.get(&owner);
        let mut pos = offset;
        let mut done = 0;
        while done < out.len() {
            let (index, within) = split(pos);
            let n = (out.len() - done).min(CHUNK - within);
            let dst = &mut out[done..done + n];
            match chunks.and_then(|c| c.get(&index)) {
                Some(chunk) => dst.copy_from_slice(&chunk[within..within + n]),
                None => dst.fill(0),
            }
            done += n;
            pos += n as u64;
        }
    }

    /// Drops every byte of `owner`, whose memory was freed.
    pub(super) fn forget(&mut self, owner: Owner) {
        self.owners.remove(&owner);
    }

    /// Chunks held in all (for tests of the store itself).
    #[cfg(test)]
    fn chunk_count(&self) -> usize {
        self.owners.values().map(HashMap::len).sum()
    }
}

/// Chunk index and offset inside the chunk of byte `pos`.
fn split(pos: u64) -> (u64, usize) {
    (pos / CHUNK as u64, (pos % CHUNK as u64) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_across_chunks_read_back_and_holes_read_zero() {
        let mut s = ByteStore::default();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        s.write(Owner::Handle(1), 4000, &data);
        let mut out = vec![0xAA; 10_100];
        s.read(Owner::Handle(1), 3950, &mut out);
        assert!(out[..50].iter().all(|&b| b == 0));
        assert_eq!(&out[50..10_050], &data[..]);
        assert!(out[10_050..].iter().all(|&b| b == 0));
        assert_eq!(s.chunk_count(), 4);
        s.forget(Owner::Handle(1));
        assert_eq!(s.chunk_count(), 0);
    }
}
