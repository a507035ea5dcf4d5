//! Applying events: `Stored`, `Removed`, `Cleared`, a worker's removal, and the evictions a
//! cap forces. Each block goes through these rules, in this order (the differential test
//! checks them against a naive model); odd input is counted in `IndexStats::anomalies` and
//! never corrupts the index:
//! - `Stored` under a parent the (worker, rank) does not hold: `Err(ParentUnknown)`, nothing
//!   applied;
//! - a stored block already held in that tier: no-op; `Removed` of an unknown block or tier:
//!   no-op — so applying an event twice leaves the same logical state;
//! - a block hash that already names a different block of the pair: the old block is dropped
//!   and the hash rebinds;
//! - a block the pair already holds under another hash: the first hash keeps naming it (the
//!   tier is added), so a pair names a block by at most one hash.

use kvroute_common::hashing::SequenceHash;
use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};

use super::Core;
use crate::index::arena::BlockSlot;
use crate::index::blockmap::Probe;
use crate::index::ops::Rec;
use crate::index::outcome::{ApplyError, ApplyOk};
use crate::index::view::{MAX_SLOTS, Slot};

/// Every tier.
const ALL_TIERS: u8 = 0b1111;

/// How many blocks ahead of the one being applied its map bucket is prefetched (measured best
/// of 8, 16 and 32 on the project's machine).
pub(crate) const AHEAD: usize = 16;

#[inline]
fn tier_bit(tier: StorageTier) -> u8 {
    1 << tier.index()
}

impl Core {
    /// Applies one event of `(worker_id, dp_rank)` to the view behind `rec`.
    pub fn apply(
        &mut self,
        rec: &mut Rec<'_>,
        worker_id: WorkerId,
        dp_rank: DpRank,
        event: &KvEventData,
    ) -> Result<ApplyOk, ApplyError> {
        let result = match event {
            KvEventData::Stored {
                parent_hash,
                blocks,
                tier,
            } => self.store(rec, worker_id, dp_rank, *parent_hash, blocks, *tier),
            KvEventData::Removed { block_hashes, tier } => {
                Ok(self.remove_blocks(rec, worker_id, dp_rank, block_hashes, *tier))
            }
            KvEventData::Cleared => Ok(self.clear(rec, worker_id, dp_rank)),
        };
        self.end_event(rec);
        result
    }

    /// Drops everything every dp rank of `worker_id` holds.
    pub fn remove_worker(&mut self, rec: &mut Rec<'_>, worker_id: WorkerId) {
        for slot in self.slots_of_worker(worker_id) {
            self.clear_slot(rec, slot);
        }
        self.end_event(rec);
    }

    /// Drops everything `(worker_id, dp_rank)` holds.
    pub fn remove_worker_dp_rank(
        &mut self,
        rec: &mut Rec<'_>,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) {
        self.clear(rec, worker_id, dp_rank);
        self.end_event(rec);
    }

    fn end_event(&mut self, rec: &mut Rec<'_>) {
        self.tidy(rec);
        self.publish_counts(rec);
    }

    fn store(
        &mut self,
        rec: &mut Rec<'_>,
        worker_id: WorkerId,
        dp_rank: DpRank,
        parent_hash: Option<SequenceHash>,
        blocks: &[StoredBlock],
        tier: StorageTier,
    ) -> Result<ApplyOk, ApplyError> {
        let parent = match parent_hash {
            None => None,
            Some(p) => {
                let found = self
                    .slot_of(worker_id, dp_rank)
                    .and_then(|s| self.pair(s)?.map.get(p))
                    .map(|(loc, _)| loc);
                match found {
                    Some(loc) => Some(loc),
                    None => {
                        self.anomalies.parent_unknown_events += 1;
                        self.anomalies.parent_unknown_blocks += blocks.len() as u64;
                        return Err(ApplyError::ParentUnknown {
                            worker_id,
                            dp_rank,
                            parent_hash: p,
                        });
                    }
                }
            }
        };
        let mut ok = ApplyOk::default();
        if blocks.is_empty() {
            return Ok(ok);
        }
        let slot =
            self.slot_or_assign(rec, worker_id, dp_rank)
                .ok_or(ApplyError::TooManyWorkers {
                    worker_id,
                    dp_rank,
                    limit: MAX_SLOTS,
                })?;
        self.before_map_change(slot);
        self.count(slot);
        self.reserve_map(slot, blocks.len());
        let map = self.map_mut(slot);
        for b in &blocks[..blocks.len().min(AHEAD)] {
            map.prefetch(b.block_hash);
        }
        self.place(rec, parent, blocks);
        let bit = tier_bit(tier);
        let locs = std::mem::take(&mut self.locs);
        for (k, (block, &loc)) in blocks.iter().zip(&locs).enumerate() {
            if let Some(ahead) = blocks.get(k + AHEAD) {
                self.map_mut(slot).prefetch(ahead.block_hash);
            }
            self.store_one(rec, slot, block.block_hash, loc, bit, &mut ok);
            if let Some(cap) = self.config.max_entries
                && self.entries > cap
            {
                ok.evicted += self.evict_to(rec, cap);
            }
        }
        self.locs = locs;
        self.compact_queue_if_stale();
        Ok(ok)
    }

    /// Records that `slot` holds block `loc` in tier `bit` under `block_hash`.
    fn store_one(
        &mut self,
        rec: &mut Rec<'_>,
        slot: Slot,
        block_hash: SequenceHash,
        loc: BlockSlot,
        bit: u8,
        ok: &mut ApplyOk,
    ) {
        let held = self.own(rec, loc, slot, bit);
        if held & bit == 0 {
            ok.stored += 1;
        } else {
            ok.unchanged += 1;
        }
        let capped = self.capped();
        match self.map_mut(slot).probe(block_hash) {
            Probe::Found(i) => {
                let old = self.map_mut(slot).slot_at(i);
                if old == loc {
                    if held & bit != 0 {
                        self.anomalies.duplicate_stored_blocks += 1;
                    }
                    if capped {
                        let stamp = self.queue.push(slot, block_hash);
                        self.map_mut(slot).set_at(i, loc, stamp);
                    }
                    return;
                }
                // The hash named another block: that block is gone for this pair.
                self.anomalies.rebound_blocks += 1;
                if held != 0 {
                    // Already held under another hash: the first name stays.
                    self.anomalies.aliased_blocks += 1;
                    self.map_mut(slot).remove_at(i);
                    self.entries -= 1;
                } else {
                    let stamp = if capped {
                        self.queue.push(slot, block_hash)
                    } else {
                        0
                    };
                    self.map_mut(slot).set_at(i, loc, stamp);
                }
                self.disown(rec, old, slot, ALL_TIERS);
            }
            Probe::Vacant(i) => {
                if held != 0 {
                    self.anomalies.aliased_blocks += 1;
                    return;
                }
                let stamp = if capped {
                    self.queue.push(slot, block_hash)
                } else {
                    0
                };
                self.map_mut(slot).insert_at(i, block_hash, loc, stamp);
                self.entries += 1;
            }
        }
    }

    fn remove_blocks(
        &mut self,
        rec: &mut Rec<'_>,
        worker_id: WorkerId,
        dp_rank: DpRank,
        block_hashes: &[SequenceHash],
        tier: StorageTier,
    ) -> ApplyOk {
        let mut ok = ApplyOk::default();
        let Some(slot) = self.slot_of(worker_id, dp_rank) else {
            ok.unchanged = block_hashes.len() as u32;
            self.anomalies.removed_unknown_blocks += block_hashes.len() as u64;
            return ok;
        };
        self.before_map_change(slot);
        self.count(slot);
        for &h in &block_hashes[..block_hashes.len().min(AHEAD)] {
            self.map_mut(slot).prefetch(h);
        }
        let bit = tier_bit(tier);
        for (k, &h) in block_hashes.iter().enumerate() {
            if let Some(&ahead) = block_hashes.get(k + AHEAD) {
                self.map_mut(slot).prefetch(ahead);
            }
            let Some(i) = self.map_mut(slot).find(h) else {
                ok.unchanged += 1;
                self.anomalies.removed_unknown_blocks += 1;
                continue;
            };
            let loc = self.map_mut(slot).slot_at(i);
            let held = self.disown(rec, loc, slot, bit);
            if held & bit == 0 {
                ok.unchanged += 1;
                self.anomalies.removed_unknown_blocks += 1;
                continue;
            }
            if held & !bit == 0 {
                self.map_mut(slot).remove_at(i);
                self.entries -= 1;
            }
            ok.removed += 1;
        }
        self.drop_if_empty(rec, slot);
        ok
    }

    fn clear(&mut self, rec: &mut Rec<'_>, worker_id: WorkerId, dp_rank: DpRank) -> ApplyOk {
        match self.slot_of(worker_id, dp_rank) {
            Some(slot) => ApplyOk {
                removed: self.clear_slot(rec, slot),
                ..ApplyOk::default()
            },
            None => ApplyOk::default(),
        }
    }

    /// Drops every entry of `slot` and frees it. Returns how many entries it had.
    fn clear_slot(&mut self, rec: &mut Rec<'_>, slot: Slot) -> u32 {
        let Some(pair) = self.free_pair(rec, slot) else {
            return 0;
        };
        let n = pair.map.len();
        // The pair's owner entries are on the nodes of the blocks it names, once each.
        let mut nodes: Vec<_> = pair
            .map
            .iter()
            .map(|(_, loc, _)| self.node_of(loc))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        for node in nodes {
            rec.op(crate::index::ops::Op::SetOwner {
                node,
                slot,
                tiers: 0,
                end: 0,
            });
            self.touch(node);
        }
        self.entries -= n;
        n as u32
    }

    /// Evicts the oldest stores until at most `cap` entries remain. Returns how many.
    fn evict_to(&mut self, rec: &mut Rec<'_>, cap: usize) -> u32 {
        let mut evicted = 0;
        while self.entries > cap {
            let Some(q) = self.queue.pop_oldest() else {
                break;
            };
            let Some(pair) = self.pair(q.slot) else {
                continue;
            };
            let Some(i) = pair.map.find(q.block_hash) else {
                continue;
            };
            if pair.map.stamp_at(i) != q.stamp {
                continue;
            }
            let loc = pair.map.slot_at(i);
            self.before_map_change(q.slot);
            self.count(q.slot);
            self.map_mut(q.slot).remove_at(i);
            self.entries -= 1;
            self.disown(rec, loc, q.slot, ALL_TIERS);
            self.drop_if_empty(rec, q.slot);
            self.anomalies.evicted_entries += 1;
            evicted += 1;
        }
        evicted
    }

    /// Drops queued stores that no longer name a live entry once they outnumber live entries,
    /// so the queue stays within twice the entries under endless churn.
    fn compact_queue_if_stale(&mut self) {
        if self.queue.len() > 2 * self.entries + 1024 {
            let pairs = &self.pairs;
            self.queue.compact(|q| {
                pairs
                    .get(q.slot as usize)
                    .and_then(Option::as_ref)
                    .and_then(|p| p.map.find(q.block_hash).map(|i| p.map.stamp_at(i)))
                    .is_some_and(|stamp| stamp == q.stamp)
            });
        }
    }
}
