//! A fast hasher for the runtime's maps keyed by ids it made or validated (agent ids, envelope
//! ids): std's SipHash resists hash flooding by chosen keys, which these keys are not, and costs a
//! few percent of a turn. Maps keyed by text from outside (channel ids, idempotency keys) keep
//! the default hasher.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-rotate hasher (the FxHash scheme, with a final rotation so the low bits a table
/// indexes by depend on every input word).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FastHasher {
    hash: u64,
}

const SEED: u64 = 0xf135_7aea_2e62_a9c5;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash ^ word).wrapping_mul(SEED).rotate_left(5);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // One more multiply spreads the last word into the high bits; the rotation brings the
        // well-mixed high bits down to where a table takes its index.
        self.hash.wrapping_mul(SEED).rotate_left(26)
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;
/// A `HashSet` with [`FastHasher`].
pub(crate) type FastSet<K> = HashSet<K, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash>(t: &T) -> u64 {
        BuildHasherDefault::<FastHasher>::default().hash_one(t)
    }

    #[test]
    fn ids_spread_over_the_low_bits() {
        let mut buckets = [0u32; 1024];
        for i in 0..100_000 {
            buckets[(hash(&format!("agent-{i}")) & 1023) as usize] += 1;
        }
        // About 98 per bucket; a weak low-bit mix would leave most buckets empty.
        assert!(buckets.iter().all(|&n| n > 40 && n < 200), "{buckets:?}");
        assert_ne!(hash(&"ab"), hash(&"ab\0"));
        let mut map: FastMap<String, usize> = FastMap::default();
        map.insert("x".into(), 1);
        assert_eq!(map.get("x"), Some(&1));
    }
}
