//! The sparse byte backing store: bytes belong to physical memory, not to virtual addresses.
//!
//! Bytes are kept per owner of physical memory (an allocation from `create`, or one from `malloc`) at
//! offsets inside it. When a handle is unmapped and mapped elsewhere its bytes move with it, exactly like
//! real memory, and every handle to one allocation (an imported handle is another) shows the same bytes.
//! Unwritten bytes read as 0.
//!
//! Two representations share the work, so that filling gigabytes (`memset_d8`, `cuvmm compare --touch`)
//! costs a few map entries rather than gigabytes of host memory:
//! - **chunks**: 4 KiB blocks of explicit bytes, allocated on the first [`ByteStore::write`] into them;
//! - **fills**: disjoint ranges set to one byte by [`ByteStore::fill`].
//!
//! A chunk, where there is one, is authoritative for its bytes; elsewhere the fill covering a byte gives its
//! value, and a byte covered by neither reads as 0. A new chunk starts from what the fills say, and a fill
//! overwrites the bytes of the chunks it overlaps (dropping those it covers entirely).

use std::collections::{BTreeMap, HashMap};

/// Bytes per chunk of the store.
const CHUNK: usize = 4096;

/// Who owns a piece of physical memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    /// An allocation from `create`, by the number of the handle that created it (every handle imported for
    /// it shares its bytes).
    Allocation(u64),
    /// An allocation from `malloc`, by its address.
    Malloc(u64),
}

/// The bytes of one owner.
#[derive(Debug, Clone, Default)]
struct Bytes {
    /// Chunk index -> its bytes.
    chunks: BTreeMap<u64, Box<[u8; CHUNK]>>,
    /// Start -> (end, value): disjoint filled ranges.
    fills: BTreeMap<u64, (u64, u8)>,
}

/// Written bytes, by owner.
#[derive(Debug, Clone, Default)]
pub(super) struct ByteStore {
    owners: HashMap<Owner, Bytes>,
}

impl ByteStore {
    /// Writes `data` at `offset` inside `owner`'s memory.
    pub(super) fn write(&mut self, owner: Owner, offset: u64, data: &[u8]) {
        let bytes = self.owners.entry(owner).or_default();
        let mut pos = offset;
        let mut rest = data;
        while !rest.is_empty() {
            let (index, within) = split(pos);
            let n = rest.len().min(CHUNK - within);
            if !bytes.chunks.contains_key(&index) {
                let mut fresh = Box::new([0; CHUNK]);
                bytes.read_fills(index * CHUNK as u64, &mut fresh[..]);
                bytes.chunks.insert(index, fresh);
            }
            if let Some(chunk) = bytes.chunks.get_mut(&index) {
                chunk[within..within + n].copy_from_slice(&rest[..n]);
            }
            rest = &rest[n..];
            pos += n as u64;
        }
    }

    /// Sets `len` bytes at `offset` inside `owner`'s memory to `value`.
    pub(super) fn fill(&mut self, owner: Owner, offset: u64, len: u64, value: u8) {
        if len == 0 {
            return;
        }
        let end = offset.saturating_add(len);
        let bytes = self.owners.entry(owner).or_default();
        let first = offset / CHUNK as u64;
        let last = (end - 1) / CHUNK as u64;
        let touched: Vec<u64> = bytes.chunks.range(first..=last).map(|(&i, _)| i).collect();
        for index in touched {
            let chunk_start = index * CHUNK as u64;
            let from = offset.max(chunk_start);
            let to = end.min(chunk_start + CHUNK as u64);
            if from == chunk_start && to == chunk_start + CHUNK as u64 {
                bytes.chunks.remove(&index);
            } else if let Some(chunk) = bytes.chunks.get_mut(&index) {
                chunk[(from - chunk_start) as usize..(to - chunk_start) as usize].fill(value);
            }
        }
        bytes.assign(offset, end, value);
    }

    /// Fills `out` with the bytes at `offset` inside `owner`'s memory.
    pub(super) fn read(&self, owner: Owner, offset: u64, out: &mut [u8]) {
        let Some(bytes) = self.owners.get(&owner) else {
            out.fill(0);
            return;
        };
        let mut pos = offset;
        let mut done = 0;
        while done < out.len() {
            let (index, within) = split(pos);
            let n = (out.len() - done).min(CHUNK - within);
            let dst = &mut out[done..done + n];
            match bytes.chunks.get(&index) {
                Some(chunk) => dst.copy_from_slice(&chunk[within..within + n]),
                None => bytes.read_fills(pos, dst),
            }
            done += n;
            pos += n as u64;
        }
    }

    /// Drops every byte of `owner`, whose memory was freed.
    pub(super) fn forget(&mut self, owner: Owner) {
        self.owners.remove(&owner);
    }

    /// Chunks and fill ranges held in all (for tests of the store itself).
    #[cfg(test)]
    fn entry_count(&self) -> (usize, usize) {
        let chunks = self.owners.values().map(|b| b.chunks.len()).sum();
        let fills = self.owners.values().map(|b| b.fills.len()).sum();
        (chunks, fills)
    }
}

impl Bytes {
    /// Fills `out` with what the fills say about the bytes from `pos` (0 where no fill covers them).
    fn read_fills(&self, pos: u64, out: &mut [u8]) {
        out.fill(0);
        let end = pos + out.len() as u64;
        // Disjoint and sorted by start, so also sorted by end: walk back until a range ends before `pos`.
        for (&start, &(stop, value)) in self.fills.range(..end).rev() {
            if stop <= pos {
                break;
            }
            let from = start.max(pos);
            let to = stop.min(end);
            out[(from - pos) as usize..(to - pos) as usize].fill(value);
        }
    }

    /// Makes `start .. end` one fill range of `value`, cutting the ranges it overlaps.
    fn assign(&mut self, start: u64, end: u64, value: u8) {
        if let Some((&s, &(e, v))) = self.fills.range(..start).next_back() {
            if e > start {
                self.fills.insert(s, (start, v));
                if e > end {
                    self.fills.insert(end, (e, v));
                }
            }
        }
        let inside: Vec<u64> = self.fills.range(start..end).map(|(&s, _)| s).collect();
        for s in inside {
            if let Some((e, v)) = self.fills.remove(&s) {
                if e > end {
                    self.fills.insert(end, (e, v));
                }
            }
        }
        self.fills.insert(start, (end, value));
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
        s.write(Owner::Allocation(1), 4000, &data);
        let mut out = vec![0xAA; 10_100];
        s.read(Owner::Allocation(1), 3950, &mut out);
        assert!(out[..50].iter().all(|&b| b == 0));
        assert_eq!(&out[50..10_050], &data[..]);
        assert!(out[10_050..].iter().all(|&b| b == 0));
        assert_eq!(s.entry_count(), (4, 0));
        s.forget(Owner::Allocation(1));
        assert_eq!(s.entry_count(), (0, 0));
    }

    /// A plain byte vector as the model: every mix of writes and fills reads back as it says.
    #[test]
    fn fills_and_writes_agree_with_a_flat_model() {
        const LEN: usize = 5 * CHUNK;
        let mut s = ByteStore::default();
        let mut model = vec![0u8; LEN];
        let owner = Owner::Malloc(7);
        let ops: [(usize, usize, Option<u8>); 8] = [
            (100, 3 * CHUNK, Some(1)),
            (CHUNK - 10, 20, None),
            (2 * CHUNK, CHUNK, Some(2)),
            (0, LEN, Some(3)),
            (CHUNK + 5, 2 * CHUNK, None),
            (CHUNK, 7, Some(4)),
            (3 * CHUNK - 1, 2, Some(5)),
            (4 * CHUNK + 1, CHUNK - 1, None),
        ];
        for (i, &(at, len, fill)) in ops.iter().enumerate() {
            match fill {
                Some(v) => {
                    s.fill(owner, at as u64, len as u64, v);
                    model[at..at + len].fill(v);
                }
                None => {
                    let data: Vec<u8> = (0..len).map(|k| (k * 13 + i) as u8).collect();
                    s.write(owner, at as u64, &data);
                    model[at..at + len].copy_from_slice(&data);
                }
            }
            let mut out = vec![0xEE; LEN];
            s.read(owner, 0, &mut out);
            assert_eq!(out, model, "after op {i}");
        }
    }

    #[test]
    fn a_huge_fill_costs_one_entry_and_drops_covered_chunks() {
        let mut s = ByteStore::default();
        let owner = Owner::Allocation(3);
        s.write(owner, 0, &[9; 3 * CHUNK]);
        s.fill(owner, 10, 1 << 40, 0x5A);
        assert_eq!(s.entry_count(), (1, 1), "one partial chunk and one fill");
        let mut out = [0; 12];
        s.read(owner, 4, &mut out);
        assert_eq!(out, [9, 9, 9, 9, 9, 9, 0x5A, 0x5A, 0x5A, 0x5A, 0x5A, 0x5A]);
        s.read(owner, (1 << 40) + 8, &mut out);
        assert_eq!(out, [0x5A, 0x5A, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    }
}
