//! A fast hasher for maps keyed by small integers the program itself hands out (trace ids, block addresses,
//! handle and event numbers, stream ids).
//!
//! The standard library's SipHash resists hash flooding by an adversary choosing the keys; none of these
//! keys comes from one, and SipHash cost a sizeable share of a replay. This is the multiply-rotate scheme of
//! Firefox's and rustc's `FxHasher`: one rotate, xor and multiply per word.

#![deny(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A `HashSet` with [`FastHasher`].
pub type FastSet<T> = HashSet<T, BuildHasherDefault<FastHasher>>;

/// Multiply-rotate hashing of whole words; not for keys an adversary picks.
#[derive(Clone, Copy, Debug, Default)]
pub struct FastHasher {
    hash: u64,
}

/// An odd constant with well-mixed bits (rustc's `FxHasher` uses the same one).
const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    /// The multiply leaves the low bits of page-aligned keys all 0, and `HashMap` picks buckets by the low
    /// bits: rotating brings the well-mixed high bits down (as rustc-hash 2 does).
    fn finish(&self) -> u64 {
        self.hash.rotate_left(26)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    fn hash<T: std::hash::Hash>(value: T) -> u64 {
        BuildHasherDefault::<FastHasher>::default().hash_one(value)
    }

    #[test]
    fn neighbouring_keys_hash_apart_and_equal_keys_alike() {
        let hashes: FastSet<u64> = (0..10_000u64).map(hash).collect();
        assert_eq!(hashes.len(), 10_000);
        assert_eq!(hash((3u64, 4u8)), hash((3u64, 4u8)));
        assert_ne!(hash((3u64, 4u8)), hash((4u64, 3u8)));
        // Page-aligned keys spread over the low bits, which pick the buckets.
        let low: FastSet<u64> = (0..1000u64).map(|i| hash(i << 21) & 1023).collect();
        assert!(low.len() > 500, "{}", low.len());
        // Bytes not a multiple of 8 still count.
        assert_ne!(hash([1u8, 2, 3].as_slice()), hash([1u8, 2, 4].as_slice()));
    }

    #[test]
    fn maps_work_as_maps() {
        let mut map: FastMap<u64, u64> = FastMap::default();
        for i in 0..1000 {
            map.insert(i << 21, i);
        }
        assert_eq!(map.len(), 1000);
        assert_eq!(map.get(&(7 << 21)), Some(&7));
        assert_eq!(map.remove(&(999 << 21)), Some(999));
        assert_eq!(map.get(&(999 << 21)), None);
    }
}
