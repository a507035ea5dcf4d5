//! [`RadixIndex`]: the single-writer core. Applies KV events and answers overlap queries.
//!
//! *Invariant:* the index never performs I/O, reads a clock, or keeps global state; every
//! change comes through [`RadixIndex::apply`] (or the `remove_worker*` calls), and a refused
//! event changes nothing.

use hashbrown::hash_table;
use kvroute_common::hashing::SequenceHash;
use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{KvEventBatch, KvEventData, StorageTier, StoredBlock};

use super::config::IndexConfig;
use super::eviction::EvictionQueue;
use super::outcome::{ApplyError, ApplyOk, BatchOutcome};
use super::stats::{Anomalies, IndexStats, WorkerBlocks};
use super::tree::{MAX_SLOTS, NodeId, ROOT, Slot, Tree, mix};
use super::workers::{Entry, Workers};

/// The exact prefix index: which (worker, dp rank) holds which chain of blocks.
///
/// Single writer: mutate through `&mut self`; share between threads with
/// [`crate::SharedIndex`].
#[derive(Debug, Clone)]
pub struct RadixIndex {
    pub(crate) config: IndexConfig,
    pub(crate) tree: Tree,
    pub(crate) workers: Workers,
    pub(crate) entries: usize,
    pub(crate) queue: EvictionQueue,
    pub(crate) anomalies: Anomalies,
}

#[inline]
fn tier_bit(tier: StorageTier) -> u8 {
    1 << tier.index()
}

impl RadixIndex {
    /// An empty index.
    ///
    /// # Panics
    /// If `config` fails [`IndexConfig::validate`]; validate it at startup.
    pub fn new(config: IndexConfig) -> Self {
        if let Err(e) = config.validate() {
            panic!("invalid IndexConfig: {e}");
        }
        Self {
            config,
            tree: Tree::new(),
            workers: Workers::default(),
            entries: 0,
            queue: EvictionQueue::default(),
            anomalies: Anomalies::default(),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Applies one event of `(worker_id, dp_rank)`. See [`ApplyOk`] and [`ApplyError`] for
    /// the outcome of each kind of input; applying the same event twice leaves the same
    /// logical state.
    pub fn apply(
        &mut self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        event: &KvEventData,
    ) -> Result<ApplyOk, ApplyError> {
        match event {
            KvEventData::Stored {
                parent_hash,
                blocks,
                tier,
            } => self.store(worker_id, dp_rank, *parent_hash, blocks, *tier),
            KvEventData::Removed { block_hashes, tier } => {
                Ok(self.remove_blocks(worker_id, dp_rank, block_hashes, *tier))
            }
            KvEventData::Cleared => Ok(self.clear(worker_id, dp_rank)),
        }
    }

    /// Applies every event of a batch in order; a refused event does not stop the rest.
    pub fn apply_batch(&mut self, batch: &KvEventBatch) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        for event in &batch.events {
            outcome.record(self.apply(batch.worker_id, batch.dp_rank, &event.data));
        }
        outcome
    }

    /// Drops everything every dp rank of `worker_id` holds.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        for slot in self.workers.slots_of_worker(worker_id) {
            self.clear_slot(slot);
        }
    }

    /// Drops everything `(worker_id, dp_rank)` holds (same as a `Cleared` event).
    pub fn remove_worker_dp_rank(&mut self, worker_id: WorkerId, dp_rank: DpRank) {
        self.clear(worker_id, dp_rank);
    }

    /// Every (worker, dp rank) holding at least one block, sorted.
    pub fn workers(&self) -> Vec<(WorkerId, DpRank)> {
        let mut out: Vec<_> = self
            .workers
            .iter()
            .map(|(_, s)| (s.worker_id, s.dp_rank))
            .collect();
        out.sort_unstable();
        out
    }

    /// Total (block, worker, dp rank) entries.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Sizes, memory and anomaly counters. Walks the tables: O(nodes + workers).
    pub fn stats(&self) -> IndexStats {
        let mut blocks_per_worker: Vec<WorkerBlocks> = self
            .workers
            .iter()
            .map(|(_, s)| WorkerBlocks {
                worker_id: s.worker_id,
                dp_rank: s.dp_rank,
                blocks: s.blocks.len() as u64,
            })
            .collect();
        blocks_per_worker.sort_unstable_by_key(|w| (w.worker_id, w.dp_rank));
        IndexStats {
            nodes: self.tree.len(),
            entries: self.entries,
            blocks_per_worker,
            bytes_in_use: std::mem::size_of::<Self>()
                + self.tree.bytes()
                + self.workers.bytes()
                + self.queue.bytes(),
            anomalies: self.anomalies,
        }
    }

    fn store(
        &mut self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        parent_hash: Option<SequenceHash>,
        blocks: &[StoredBlock],
        tier: StorageTier,
    ) -> Result<ApplyOk, ApplyError> {
        let parent = match parent_hash {
            None => ROOT,
            Some(p) => {
                let found = self
                    .workers
                    .slot_of(worker_id, dp_rank)
                    .and_then(|s| self.workers.get(s)?.get(p))
                    .map(|e| e.node);
                match found {
                    Some(node) => node,
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
            self.workers
                .slot_or_assign(worker_id, dp_rank)
                .ok_or(ApplyError::TooManyWorkers {
                    worker_id,
                    dp_rank,
                    limit: MAX_SLOTS,
                })?;
        let bit = tier_bit(tier);
        let mut cur = parent;
        for block in blocks {
            let child = self.tree.child_or_insert(cur, block.tokens_hash);
            self.store_one(slot, block.block_hash, child, bit, &mut ok);
            if let Some(cap) = self.config.max_entries
                && self.entries > cap
            {
                ok.evicted += self.evict_to(cap);
            }
            cur = child;
        }
        self.compact_queue_if_stale();
        Ok(ok)
    }

    /// Records that `slot` holds `node` in tier `bit` under `block_hash`.
    fn store_one(
        &mut self,
        slot: Slot,
        block_hash: SequenceHash,
        node: NodeId,
        bit: u8,
        ok: &mut ApplyOk,
    ) {
        let capped = self.config.max_entries.is_some();
        let held = self.tree.tiers_of(node, slot);
        // The node gains its owner before anything is released, so neither it nor its
        // ancestors can be freed below.
        if held & bit == 0 {
            self.tree.set_tiers(node, slot, held | bit);
            ok.stored += 1;
        } else {
            ok.unchanged += 1;
        }
        let sb = self.workers.get_mut(slot).expect("slot assigned");
        let entry = sb.blocks.entry(
            mix(block_hash),
            |e| e.block_hash == block_hash,
            |e| mix(e.block_hash),
        );
        match entry {
            hash_table::Entry::Occupied(mut o) => {
                let old = o.get().node;
                if old == node {
                    if held & bit != 0 {
                        self.anomalies.duplicate_stored_blocks += 1;
                    }
                    if capped {
                        o.get_mut().stamp = self.queue.push(slot, block_hash);
                    }
                    return;
                }
                // The hash named another block: that block is gone for this worker.
                self.anomalies.rebound_blocks += 1;
                if held != 0 {
                    // Already held under another hash: the first name stays.
                    self.anomalies.aliased_blocks += 1;
                    o.remove();
                    self.entries -= 1;
                } else {
                    let stamp = if capped {
                        self.queue.push(slot, block_hash)
                    } else {
                        0
                    };
                    *o.get_mut() = Entry {
                        block_hash,
                        node,
                        stamp,
                    };
                }
                self.tree.set_tiers(old, slot, 0);
            }
            hash_table::Entry::Vacant(v) => {
                if held != 0 {
                    self.anomalies.aliased_blocks += 1;
                    return;
                }
                let stamp = if capped {
                    self.queue.push(slot, block_hash)
                } else {
                    0
                };
                v.insert(Entry {
                    block_hash,
                    node,
                    stamp,
                });
                self.entries += 1;
            }
        }
    }

    fn remove_blocks(
        &mut self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        block_hashes: &[SequenceHash],
        tier: StorageTier,
    ) -> ApplyOk {
        let mut ok = ApplyOk::default();
        let Some(slot) = self.workers.slot_of(worker_id, dp_rank) else {
            ok.unchanged = block_hashes.len() as u32;
            self.anomalies.removed_unknown_blocks += block_hashes.len() as u64;
            return ok;
        };
        let bit = tier_bit(tier);
        for &h in block_hashes {
            let sb = self.workers.get_mut(slot).expect("slot assigned");
            let Some(node) = sb.get(h).map(|e| e.node) else {
                ok.unchanged += 1;
                self.anomalies.removed_unknown_blocks += 1;
                continue;
            };
            let held = self.tree.tiers_of(node, slot);
            if held & bit == 0 {
                ok.unchanged += 1;
                self.anomalies.removed_unknown_blocks += 1;
                continue;
            }
            let left = held & !bit;
            if left == 0 {
                sb.remove(h);
                self.entries -= 1;
            }
            self.tree.set_tiers(node, slot, left);
            ok.removed += 1;
        }
        self.workers.drop_if_empty(slot);
        ok
    }

    fn clear(&mut self, worker_id: WorkerId, dp_rank: DpRank) -> ApplyOk {
        match self.workers.slot_of(worker_id, dp_rank) {
            Some(slot) => ApplyOk {
                removed: self.clear_slot(slot),
                ..ApplyOk::default()
            },
            None => ApplyOk::default(),
        }
    }

    /// Drops every entry of `slot` and frees it. Returns how many entries it had.
    fn clear_slot(&mut self, slot: Slot) -> u32 {
        let Some(sb) = self.workers.take(slot) else {
            return 0;
        };
        let n = sb.blocks.len();
        for e in sb.blocks.iter() {
            self.tree.set_tiers(e.node, slot, 0);
        }
        self.entries -= n;
        n as u32
    }

    /// Evicts the oldest stores until at most `cap` entries remain. Returns how many.
    fn evict_to(&mut self, cap: usize) -> u32 {
        let mut evicted = 0;
        while self.entries > cap {
            let Some(q) = self.queue.pop_oldest() else {
                break;
            };
            let Some(sb) = self.workers.get_mut(q.slot) else {
                continue;
            };
            let node = match sb.get(q.block_hash) {
                Some(e) if e.stamp == q.stamp => e.node,
                _ => continue,
            };
            sb.remove(q.block_hash);
            self.entries -= 1;
            self.tree.set_tiers(node, q.slot, 0);
            self.workers.drop_if_empty(q.slot);
            self.anomalies.evicted_entries += 1;
            evicted += 1;
        }
        evicted
    }

    /// Drops queued stores that no longer name a live entry once they outnumber live entries,
    /// so the queue stays within twice the entries under endless churn.
    fn compact_queue_if_stale(&mut self) {
        if self.queue.len() > 2 * self.entries + 1024 {
            let workers = &self.workers;
            self.queue.compact(|q| {
                workers
                    .get(q.slot)
                    .and_then(|s| s.get(q.block_hash))
                    .is_some_and(|e| e.stamp == q.stamp)
            });
        }
    }
}
