//! The shared KV tier of a simulated fleet (an LMCache-like store every engine loads from),
//! written through by the engine that computed a prompt. Pure: no clock, no I/O.
//!
//! Every worker has a quota of the store (`quota` blocks, least recently used out first), so a
//! worker's shared-tier events — `Stored` when it writes a block the store lacks, `Removed`
//! when its quota evicts one — are its own to publish, as an engine announces what it wrote.
//! A block any worker wrote serves every worker: [`SharedStore::prefix`] reads the whole store,
//! and a write of a block already there only refreshes it.

use std::collections::{BTreeMap, HashMap};

use kvroute_common::WorkerId;
use kvroute_common::hashing::{BlockHashes, SequenceHash};
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};

#[derive(Debug, Clone, Copy)]
struct Entry {
    writer: WorkerId,
    stamp: u64,
}

/// The store: blocks by sequence hash, and each writer's blocks in use order.
#[derive(Debug, Clone)]
pub struct SharedStore {
    quota: usize,
    entries: HashMap<SequenceHash, Entry>,
    by_writer: HashMap<WorkerId, BTreeMap<u64, SequenceHash>>,
    stamp: u64,
}

impl SharedStore {
    /// A store of `quota` blocks per writer (at least 1).
    pub fn new(quota: usize) -> Self {
        Self {
            quota: quota.max(1),
            entries: HashMap::new(),
            by_writer: HashMap::new(),
            stamp: 0,
        }
    }

    /// Blocks held, all writers together.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Leading blocks of a prompt the store holds.
    pub fn prefix(&self, hashes: &BlockHashes) -> u32 {
        hashes
            .sequence
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count() as u32
    }

    /// `writer` computed the prompt `hashes`: the blocks the store lacks become `writer`'s
    /// (evicting its least recently used beyond the quota); the others are refreshed. Returns
    /// `writer`'s shared-tier events, in order (the writer holds the whole prompt on its device
    /// when it writes, so every `Stored` has its parent).
    pub fn write(&mut self, writer: WorkerId, hashes: &BlockHashes) -> Vec<KvEventData> {
        let mut out = Vec::new();
        let mut run: Option<(Option<SequenceHash>, Vec<StoredBlock>)> = None;
        for (i, (&h, &tokens_hash)) in hashes.sequence.iter().zip(&hashes.local).enumerate() {
            self.stamp += 1;
            let stamp = self.stamp;
            if let Some(e) = self.entries.get_mut(&h) {
                let lru = self
                    .by_writer
                    .get_mut(&e.writer)
                    .expect("a writer of each entry");
                lru.remove(&e.stamp);
                lru.insert(stamp, h);
                e.stamp = stamp;
                flush(&mut run, &mut out);
                continue;
            }
            self.entries.insert(h, Entry { writer, stamp });
            let lru = self.by_writer.entry(writer).or_default();
            lru.insert(stamp, h);
            let block = StoredBlock {
                block_hash: h,
                tokens_hash,
            };
            match &mut run {
                Some((_, blocks)) => blocks.push(block),
                None => run = Some((i.checked_sub(1).map(|p| hashes.sequence[p]), vec![block])),
            }
            if lru.len() > self.quota {
                let (_, old) = lru.pop_first().expect("over the quota");
                self.entries.remove(&old);
                flush(&mut run, &mut out);
                out.push(KvEventData::Removed {
                    block_hashes: vec![old],
                    tier: StorageTier::Shared,
                });
            }
        }
        flush(&mut run, &mut out);
        out
    }

    /// Forgets what `writer` wrote (its cache was reset: its `Cleared` covers the tier).
    pub fn forget(&mut self, writer: WorkerId) {
        if let Some(lru) = self.by_writer.remove(&writer) {
            for h in lru.values() {
                self.entries.remove(h);
            }
        }
    }
}

fn flush(run: &mut Option<(Option<SequenceHash>, Vec<StoredBlock>)>, out: &mut Vec<KvEventData>) {
    if let Some((parent_hash, blocks)) = run.take() {
        out.push(KvEventData::Stored {
            parent_hash,
            blocks,
            tier: StorageTier::Shared,
        });
    }
}

#[cfg(test)]
mod tests {
    use kvroute_indexer::index::{IndexConfig, RadixIndex};

    use super::*;

    fn prompt(ids: &[u32]) -> BlockHashes {
        let tokens: Vec<u32> = ids.iter().flat_map(|&i| [i, i]).collect();
        BlockHashes::of_tokens(&tokens, 2, None)
    }

    /// The index after each writer's device holds its prompts and its shared events apply.
    fn apply(ix: &mut RadixIndex, worker: WorkerId, hashes: &BlockHashes, events: &[KvEventData]) {
        let device = KvEventData::Stored {
            parent_hash: None,
            blocks: hashes
                .sequence
                .iter()
                .zip(&hashes.local)
                .map(|(&block_hash, &tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect(),
            tier: StorageTier::Device,
        };
        ix.apply(worker, 0, &device).unwrap();
        for e in events {
            ix.apply(worker, 0, e).unwrap();
        }
    }

    #[test]
    fn a_continuation_written_by_another_worker_extends_the_indexed_prefix() {
        let mut store = SharedStore::new(100);
        let mut ix = RadixIndex::new(IndexConfig::default());
        let turn1 = prompt(&[1, 2, 3]);
        let turn2 = prompt(&[1, 2, 3, 4, 5]);
        let e1 = store.write(1, &turn1);
        assert_eq!(e1.len(), 1);
        apply(&mut ix, 1, &turn1, &e1);
        assert_eq!(store.prefix(&turn2), 3);
        // Worker 2 computed turn 2 (loading 1..=3): only blocks 4 and 5 are new.
        let e2 = store.write(2, &turn2);
        match &e2[..] {
            [
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                    ..
                },
            ] => {
                assert_eq!(*parent_hash, Some(turn2.sequence[2]));
                assert_eq!(blocks.len(), 2);
            }
            e => panic!("{e:?}"),
        }
        apply(&mut ix, 2, &turn2, &e2);
        assert_eq!(store.prefix(&turn2), 5);
        assert_eq!(ix.find_matches(&turn2.local).shared_prefix(), 5);
    }

    #[test]
    fn a_writer_evicts_only_its_own_blocks_and_says_so() {
        let mut store = SharedStore::new(3);
        let mut ix = RadixIndex::new(IndexConfig::default());
        let a = prompt(&[1, 2, 3]);
        let e = store.write(1, &a);
        apply(&mut ix, 1, &a, &e);
        // Worker 2's blocks count against its own quota.
        let b = prompt(&[7, 8]);
        let e = store.write(2, &b);
        apply(&mut ix, 2, &b, &e);
        assert_eq!(store.len(), 5);
        // Worker 1 writes one more block: its oldest (block 1) goes.
        let c = prompt(&[9]);
        let e = store.write(1, &c);
        assert!(matches!(
            &e[..],
            [KvEventData::Stored { .. }, KvEventData::Removed { .. }]
        ));
        apply(&mut ix, 1, &c, &e);
        assert_eq!(store.prefix(&a), 0);
        assert_eq!(ix.find_matches(&a.local).shared_prefix(), 0);
        assert_eq!(store.prefix(&b), 2);
        store.forget(2);
        assert_eq!((store.prefix(&b), store.len()), (0, 3));
    }
}
