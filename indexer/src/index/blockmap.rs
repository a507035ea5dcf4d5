//! One (worker, dp rank)'s blocks: the engine's block hash → the block's arena slot (and, when
//! the index is capped, the block's eviction stamp).
//!
//! Open addressing with linear probing over 12-byte entries (hash, slot; stamps, when kept, in
//! a parallel array), with no control bytes and no power-of-two size: the home bucket is a
//! multiply-shift of the mixed hash, the table is resized to 55 % full when it passes 80 % or
//! falls under 20 %, and a removal shifts later entries back instead of leaving a tombstone.
//! Engine hashes are opaque, so every entry keeps its whole key.

use kvroute_common::hashing::SequenceHash;

use super::arena::BlockSlot;

/// The slot of an empty bucket (no block has this slot).
const EMPTY: u32 = u32::MAX;

/// A fast 64-bit mixer for keys that are already hashes (folded 128-bit multiply).
#[inline]
pub(crate) fn mix(x: u64) -> u64 {
    let m = (x as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (m as u64) ^ ((m >> 64) as u64)
}

/// `[hash low, hash high, slot]`.
type Entry = [u32; 3];

const VACANT: Entry = [0, 0, EMPTY];

#[inline]
fn key_of(e: &Entry) -> SequenceHash {
    u64::from(e[0]) | u64::from(e[1]) << 32
}

#[derive(Debug, Clone, Default)]
pub(crate) struct BlockMap {
    entries: Vec<Entry>,
    /// Per bucket, when the index is capped.
    stamps: Vec<u32>,
    stamped: bool,
    len: usize,
}

/// Where a key is, or the empty bucket it would take.
pub(crate) enum Probe {
    Found(usize),
    Vacant(usize),
}

impl BlockMap {
    pub fn new(stamped: bool) -> Self {
        Self {
            stamped,
            ..Self::default()
        }
    }

    /// A map sized for `n` entries without growing.
    pub fn with_capacity(n: usize, stamped: bool) -> Self {
        let mut m = Self::new(stamped);
        m.resize(Self::size_for(n));
        m
    }

    /// Buckets for `n` entries at 55 % full.
    fn size_for(n: usize) -> usize {
        (n * 20 / 11).max(8)
    }

    #[inline]
    fn buckets(&self) -> usize {
        self.entries.len()
    }

    #[inline]
    fn home(&self, key: SequenceHash) -> usize {
        ((u128::from(mix(key)) * self.buckets() as u128) >> 64) as usize
    }

    #[inline]
    pub fn slot_at(&self, i: usize) -> BlockSlot {
        self.entries[i][2]
    }

    #[inline]
    pub fn stamp_at(&self, i: usize) -> u32 {
        if self.stamped { self.stamps[i] } else { 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes room for `additional` more entries, so that [`BlockMap::probe`] and
    /// [`BlockMap::insert_at`] need not grow until that many are inserted.
    pub fn reserve(&mut self, additional: usize) {
        if (self.len + additional) * 5 > self.buckets() * 4 {
            self.resize(Self::size_for(self.len + additional));
        }
    }

    /// Shrinks a table that has become mostly empty (so a pair's memory follows its blocks).
    pub fn shrink_if_sparse(&mut self) {
        if self.buckets() > 64 && self.len * 5 < self.buckets() {
            self.resize(Self::size_for(self.len));
        }
    }

    /// Asks for `key`'s home bucket (and the cache line after it) to be in cache soon: call a few
    /// keys ahead of the operations on them, so their cache misses overlap (an event's keys are
    /// random, a pair's table is megabytes, and memory latency here is ~200 ns).
    #[inline]
    pub fn prefetch(&self, key: SequenceHash) {
        if !self.entries.is_empty() {
            kvroute_prefetch::prefetch(&self.entries, self.home(key));
        }
    }

    /// The bucket holding `key` (`Ok`), or the empty bucket that ends its probe (`Err`).
    #[inline]
    fn scan(&self, key: SequenceHash) -> Result<usize, usize> {
        let n = self.buckets();
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e[2] == EMPTY {
                return Err(i);
            }
            if key_of(e) == key {
                return Ok(i);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// The bucket holding `key`.
    #[inline]
    pub fn find(&self, key: SequenceHash) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        self.scan(key).ok()
    }

    /// The slot and stamp of `key`.
    #[inline]
    pub fn get(&self, key: SequenceHash) -> Option<(BlockSlot, u32)> {
        self.find(key).map(|i| (self.slot_at(i), self.stamp_at(i)))
    }

    /// Where `key` is, or the empty bucket it would take. Call after a
    /// [`BlockMap::reserve`] that left room for it.
    #[inline]
    pub fn probe(&mut self, key: SequenceHash) -> Probe {
        debug_assert!(
            (self.len + 1) * 5 <= self.buckets() * 4,
            "probe without reserve"
        );
        match self.scan(key) {
            Ok(i) => Probe::Found(i),
            Err(i) => Probe::Vacant(i),
        }
    }

    /// Fills the vacant bucket `i` from [`BlockMap::probe`].
    #[inline]
    pub fn insert_at(&mut self, i: usize, key: SequenceHash, slot: BlockSlot, stamp: u32) {
        debug_assert_eq!(self.entries[i][2], EMPTY);
        self.entries[i] = [key as u32, (key >> 32) as u32, slot];
        if self.stamped {
            self.stamps[i] = stamp;
        }
        self.len += 1;
    }

    /// Changes the value in occupied bucket `i`.
    #[inline]
    pub fn set_at(&mut self, i: usize, slot: BlockSlot, stamp: u32) {
        self.entries[i][2] = slot;
        if self.stamped {
            self.stamps[i] = stamp;
        }
    }

    /// Empties bucket `i`, shifting back the entries after it that may move.
    pub fn remove_at(&mut self, mut i: usize) {
        let n = self.buckets();
        let mut j = i;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let e = self.entries[j];
            if e[2] == EMPTY {
                break;
            }
            let h = self.home(key_of(&e));
            // The entry at `j` may fill `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j {
                i < h && h <= j
            } else {
                i < h || h <= j
            };
            if !stays {
                self.entries[i] = e;
                if self.stamped {
                    self.stamps[i] = self.stamps[j];
                }
                i = j;
            }
        }
        self.entries[i] = VACANT;
        self.len -= 1;
    }

    /// Removes `key`; returns its slot and stamp.
    #[cfg(test)]
    pub fn remove(&mut self, key: SequenceHash) -> Option<(BlockSlot, u32)> {
        let i = self.find(key)?;
        let value = (self.slot_at(i), self.stamp_at(i));
        self.remove_at(i);
        self.shrink_if_sparse();
        Some(value)
    }

    /// Rehashes into a table of `buckets` buckets.
    fn resize(&mut self, buckets: usize) {
        let old = std::mem::replace(&mut self.entries, vec![VACANT; buckets]);
        let old_stamps = std::mem::take(&mut self.stamps);
        if self.stamped {
            self.stamps = vec![0; buckets];
        }
        for (i, e) in old.iter().enumerate() {
            if e[2] == EMPTY {
                continue;
            }
            let mut j = self.home(key_of(e));
            while self.entries[j][2] != EMPTY {
                j += 1;
                if j == buckets {
                    j = 0;
                }
            }
            self.entries[j] = *e;
            if self.stamped {
                self.stamps[j] = old_stamps[i];
            }
        }
    }

    /// Every entry: (block hash, slot, stamp), in table order.
    pub fn iter(&self) -> impl Iterator<Item = (SequenceHash, BlockSlot, u32)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e[2] != EMPTY)
            .map(|(i, e)| (key_of(e), e[2], self.stamp_at(i)))
    }

    pub fn bytes(&self) -> usize {
        self.entries.capacity() * 12 + self.stamps.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn agrees_with_a_hash_map_under_churn() {
        for stamped in [false, true] {
            let mut m = BlockMap::new(stamped);
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut x = 7u64;
            for step in 0..200_000u32 {
                x = mix(x.wrapping_add(step as u64));
                // Few distinct keys, so inserts, hits and removals all happen; some keys share
                // home buckets (small tables) so shifting back is exercised.
                let key = x % 3_000;
                if x >> 62 == 0 {
                    assert_eq!(m.remove(key).map(|v| v.0), model.remove(&key));
                } else {
                    m.reserve(1);
                    match m.probe(key) {
                        Probe::Found(i) => {
                            assert_eq!(Some(&m.slot_at(i)), model.get(&key));
                            m.set_at(i, step, step);
                            model.insert(key, step);
                        }
                        Probe::Vacant(i) => {
                            assert!(!model.contains_key(&key));
                            m.insert_at(i, key, step, step);
                            model.insert(key, step);
                        }
                    }
                }
                assert_eq!(m.len(), model.len());
                if step % 10_000 == 0 {
                    let mut all: Vec<_> = m.iter().map(|(k, s, _)| (k, s)).collect();
                    all.sort_unstable();
                    let mut want: Vec<_> = model.iter().map(|(&k, &s)| (k, s)).collect();
                    want.sort_unstable();
                    assert_eq!(all, want);
                }
            }
            // Drain: the table shrinks and stays correct.
            let keys: Vec<u64> = model.keys().copied().collect();
            for k in keys {
                assert_eq!(m.remove(k).map(|v| v.0), model.remove(&k));
            }
            assert!(m.is_empty());
            assert!(m.bytes() <= 64 * 16);
        }
    }
}
