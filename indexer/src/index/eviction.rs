//! The eviction order behind `IndexConfig::max_entries`: a queue of stores, oldest first.
//!
//! Each store (and re-store) pushes `(slot, block hash, stamp)` and writes the stamp into the
//! entry. A queued item is live only while its entry still carries that stamp, so removals
//! and re-stores need no queue surgery; stale items are skipped when popped and compacted away
//! when they outnumber live entries.

use std::collections::VecDeque;

use kvroute_common::hashing::SequenceHash;

use super::view::Slot;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Queued {
    pub block_hash: SequenceHash,
    pub slot: Slot,
    pub stamp: u32,
}

/// Stores in order, plus the stamp counter. Inactive (always empty) when there is no cap.
#[derive(Debug, Clone, Default)]
pub(crate) struct EvictionQueue {
    items: VecDeque<Queued>,
    next_stamp: u32,
}

impl EvictionQueue {
    /// The stamp the next store gets.
    pub fn next_stamp(&self) -> u32 {
        self.next_stamp
    }

    /// Records a store and returns its stamp.
    pub fn push(&mut self, slot: Slot, block_hash: SequenceHash) -> u32 {
        let stamp = self.next_stamp;
        self.next_stamp = self.next_stamp.wrapping_add(1);
        self.items.push_back(Queued {
            block_hash,
            slot,
            stamp,
        });
        stamp
    }

    pub fn pop_oldest(&mut self) -> Option<Queued> {
        self.items.pop_front()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Keeps only items `is_live` accepts (order kept).
    pub fn compact(&mut self, mut is_live: impl FnMut(&Queued) -> bool) {
        self.items.retain(|q| is_live(q));
    }

    /// Rebuilds the queue from live items (any order) and the counter, as after a restore.
    pub fn rebuild(mut items: Vec<Queued>, next_stamp: u32) -> Self {
        // Oldest first: the largest distance back from the counter.
        items.sort_unstable_by_key(|q| std::cmp::Reverse(next_stamp.wrapping_sub(q.stamp)));
        Self {
            items: items.into(),
            next_stamp,
        }
    }

    pub fn bytes(&self) -> usize {
        self.items.capacity() * std::mem::size_of::<Queued>()
    }
}
