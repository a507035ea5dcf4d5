//! The (worker, dp rank) table: a dense slot number per pair, and per slot the map from the
//! engine's block hash (sequence hash) to the tree node it names.
//!
//! Engines name blocks by their own opaque hash; the tree is keyed by `tokens_hash`. Keeping
//! the engine hash per slot is what lets two engines that hash differently share nodes.

use hashbrown::{HashMap, HashTable};
use kvroute_common::hashing::SequenceHash;
use kvroute_common::ids::{DpRank, WorkerId};

use super::tree::{MAX_SLOTS, NodeId, Slot, mix};

/// One block a (worker, dp rank) holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub block_hash: SequenceHash,
    pub node: NodeId,
    /// When it was last stored, in the index's store counter (eviction order).
    pub stamp: u32,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 16);

/// Everything one (worker, dp rank) holds.
#[derive(Debug, Clone)]
pub(crate) struct SlotBlocks {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub blocks: HashTable<Entry>,
}

impl SlotBlocks {
    #[inline]
    pub fn get(&self, block_hash: SequenceHash) -> Option<&Entry> {
        self.blocks
            .find(mix(block_hash), |e| e.block_hash == block_hash)
    }

    pub fn remove(&mut self, block_hash: SequenceHash) -> Option<Entry> {
        self.blocks
            .find_entry(mix(block_hash), |e| e.block_hash == block_hash)
            .ok()
            .map(|o| o.remove().0)
    }
}

/// Slots in use, a free list, and the pair → slot lookup.
#[derive(Debug, Clone, Default)]
pub(crate) struct Workers {
    slots: Vec<Option<SlotBlocks>>,
    free: Vec<Slot>,
    by_pair: HashMap<(WorkerId, DpRank), Slot>,
    /// Per slot, its rank among slots in use ordered by (worker, dp rank), so query results
    /// come out sorted without a comparison sort. Rebuilt when a pair joins or leaves.
    rank: Vec<u32>,
}

impl Workers {
    #[inline]
    pub fn slot_of(&self, worker_id: WorkerId, dp_rank: DpRank) -> Option<Slot> {
        self.by_pair.get(&(worker_id, dp_rank)).copied()
    }

    /// The slot of a pair, assigned if new. `None` when every slot number is taken.
    pub fn slot_or_assign(&mut self, worker_id: WorkerId, dp_rank: DpRank) -> Option<Slot> {
        if let Some(s) = self.slot_of(worker_id, dp_rank) {
            return Some(s);
        }
        let fresh = SlotBlocks {
            worker_id,
            dp_rank,
            blocks: HashTable::new(),
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(fresh);
                s
            }
            None => {
                if self.slots.len() >= MAX_SLOTS {
                    return None;
                }
                self.slots.push(Some(fresh));
                (self.slots.len() - 1) as Slot
            }
        };
        self.by_pair.insert((worker_id, dp_rank), slot);
        self.rerank();
        Some(slot)
    }

    fn rerank(&mut self) {
        let mut order: Vec<(WorkerId, DpRank, Slot)> =
            self.by_pair.iter().map(|(&(w, d), &s)| (w, d, s)).collect();
        order.sort_unstable();
        self.rank.clear();
        self.rank.resize(self.slots.len(), u32::MAX);
        for (r, (_, _, s)) in order.into_iter().enumerate() {
            self.rank[s as usize] = r as u32;
        }
    }

    /// The slot's position in (worker, dp rank) order among slots in use (`< len()`).
    #[inline]
    pub fn rank(&self, slot: Slot) -> u32 {
        self.rank[slot as usize]
    }

    #[inline]
    pub fn get(&self, slot: Slot) -> Option<&SlotBlocks> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    #[inline]
    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut SlotBlocks> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Takes a slot's blocks out and frees its number.
    pub fn take(&mut self, slot: Slot) -> Option<SlotBlocks> {
        let taken = self.slots.get_mut(slot as usize)?.take()?;
        self.by_pair.remove(&(taken.worker_id, taken.dp_rank));
        self.free.push(slot);
        self.rerank();
        Some(taken)
    }

    /// Frees the slot if it holds nothing (so idle pairs cost nothing).
    pub fn drop_if_empty(&mut self, slot: Slot) {
        if self.get(slot).is_some_and(|s| s.blocks.is_empty()) {
            self.take(slot);
        }
    }

    /// Every slot in use, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &SlotBlocks)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as Slot, s)))
    }

    /// Slots of every dp rank of `worker_id`.
    pub fn slots_of_worker(&self, worker_id: WorkerId) -> Vec<Slot> {
        self.iter()
            .filter(|(_, s)| s.worker_id == worker_id)
            .map(|(slot, _)| slot)
            .collect()
    }

    pub fn len(&self) -> usize {
        self.by_pair.len()
    }

    pub fn bytes(&self) -> usize {
        let per_slot: usize = self.iter().map(|(_, s)| s.blocks.allocation_size()).sum();
        per_slot
            + self.slots.capacity() * std::mem::size_of::<Option<SlotBlocks>>()
            + self.free.capacity() * 4
            + self.rank.capacity() * 4
            + self.by_pair.allocation_size()
    }
}

impl Workers {
    /// Appends a slot during a restore (slots numbered in push order). `None` if the pair is
    /// already present.
    pub fn push_restored(
        &mut self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        blocks: HashTable<Entry>,
    ) -> Option<Slot> {
        let slot = self.slots.len() as Slot;
        if self.by_pair.insert((worker_id, dp_rank), slot).is_some() {
            return None;
        }
        self.slots.push(Some(SlotBlocks {
            worker_id,
            dp_rank,
            blocks,
        }));
        Some(slot)
    }

    /// Computes what `push_restored` deferred (one ranking instead of one per pair).
    pub fn finish_restore(&mut self) {
        self.rerank();
    }
}
