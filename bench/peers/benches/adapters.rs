//! One adapter per index: converts the shared workload into that index's own event and query
//! types ahead of time (untimed), then applies and queries through its public API.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer, RadixTree};
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use kvroute_common::messages::KvEventData;
use kvroute_indexer::workload::WorkloadEvent;
use kvroute_indexer::{IndexConfig, RadixIndex, SharedIndex};

/// Sorted `(worker, leading blocks)` of one answer, to check the indexes agree.
pub type Answer = Vec<(u64, u32)>;

pub fn ours_answer(ix: &SharedIndex, q: &[u64]) -> Answer {
    ix.find_matches(q)
        .matches
        .iter()
        .map(|m| (m.worker_id, m.device + m.host + m.disk))
        .collect()
}

// ---- dynamo-kv-router ----------------------------------------------------------------------

pub fn to_router_events(events: &[WorkloadEvent]) -> Vec<RouterEvent> {
    let mut next_id: HashMap<u64, u64> = HashMap::new();
    events
        .iter()
        .map(|e| {
            let id = next_id.entry(e.worker_id).or_default();
            *id += 1;
            let data = match &e.data {
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                    ..
                } => KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent_hash.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|b| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(b.block_hash),
                            tokens_hash: LocalBlockHash(b.tokens_hash),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
                KvEventData::Removed { block_hashes, .. } => {
                    KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: block_hashes
                            .iter()
                            .map(|&h| ExternalSequenceBlockHash(h))
                            .collect(),
                    })
                }
                KvEventData::Cleared => KvCacheEventData::Cleared,
            };
            RouterEvent::new(
                e.worker_id,
                KvCacheEvent {
                    event_id: *id,
                    data,
                    dp_rank: 0,
                },
            )
        })
        .collect()
}

pub fn to_local(q: &[u64]) -> Vec<LocalBlockHash> {
    q.iter().map(|&h| LocalBlockHash(h)).collect()
}

pub fn dynamo_answer(scores: dynamo_kv_router::protocols::OverlapScores) -> Answer {
    let mut a: Answer = scores
        .scores
        .iter()
        .filter(|&(_, &s)| s > 0)
        .map(|(w, &s)| (w.worker_id, s))
        .collect();
    a.sort_unstable();
    a
}

pub fn radix_tree(events: Vec<RouterEvent>) -> RadixTree {
    let mut t = RadixTree::new();
    for e in events {
        let _ = t.apply_event(e);
    }
    t
}

/// A thread-pool indexer (their concurrent trees are driven this way) with one writer thread.
pub fn pooled<T: SyncIndexer>(
    backend: T,
    events: Vec<RouterEvent>,
    rt: &tokio::runtime::Runtime,
) -> ThreadPoolIndexer<T> {
    let pool = ThreadPoolIndexer::new(backend, 1, 16);
    feed_pool(&pool, events, rt);
    pool
}

pub fn feed_pool<T: SyncIndexer>(
    pool: &ThreadPoolIndexer<T>,
    events: Vec<RouterEvent>,
    rt: &tokio::runtime::Runtime,
) {
    for e in events {
        pool.enqueue_event(e).expect("enqueue");
    }
    rt.block_on(pool.flush_and_wait()).expect("flush");
}

pub fn crtc() -> ConcurrentRadixTreeCompressed {
    ConcurrentRadixTreeCompressed::new()
}

pub fn positional() -> PositionalIndexer {
    PositionalIndexer::new(32)
}

// ---- kv-index ------------------------------------------------------------------------------

/// The writer's side of a kv-index `ChainIndex`: one block map per worker.
pub struct ChainWriter {
    pub index: Arc<ChainIndex>,
    maps: HashMap<u64, (u32, ChainBlockMap)>,
}

pub enum ChainEvent {
    Stored(u64, Option<SequenceHash>, Vec<StoredBlock>),
    Removed(u64, Vec<SequenceHash>),
}

pub fn to_chain_events(events: &[WorkloadEvent]) -> Vec<ChainEvent> {
    events
        .iter()
        .map(|e| match &e.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => ChainEvent::Stored(
                e.worker_id,
                parent_hash.map(SequenceHash),
                blocks
                    .iter()
                    .map(|b| StoredBlock {
                        seq_hash: SequenceHash(b.block_hash),
                        content_hash: ContentHash(b.tokens_hash),
                    })
                    .collect(),
            ),
            KvEventData::Removed { block_hashes, .. } => ChainEvent::Removed(
                e.worker_id,
                block_hashes.iter().map(|&h| SequenceHash(h)).collect(),
            ),
            KvEventData::Cleared => unreachable!("the workload never clears"),
        })
        .collect()
}

impl ChainWriter {
    pub fn new(workers: usize) -> Self {
        Self {
            index: Arc::new(ChainIndex::with_max_workers(workers)),
            maps: HashMap::new(),
        }
    }

    pub fn apply(&mut self, e: &ChainEvent) {
        let (w, _) = match e {
            ChainEvent::Stored(w, ..) | ChainEvent::Removed(w, _) => (*w, ()),
        };
        let index = &self.index;
        let (id, map) = self.maps.entry(w).or_insert_with(|| {
            let id = index.intern_worker(&w.to_string()).expect("worker slots");
            (id, ChainBlockMap::new())
        });
        match e {
            ChainEvent::Stored(_, parent, blocks) => {
                let _ = index.apply_stored(*id, blocks, *parent, map);
            }
            ChainEvent::Removed(_, hashes) => index.apply_removed(*id, hashes, map),
        }
    }

    /// Interned id → worker id.
    pub fn worker_ids(&self) -> HashMap<u32, u64> {
        self.maps.iter().map(|(&w, (id, _))| (*id, w)).collect()
    }
}

pub fn to_content(q: &[u64]) -> Vec<ContentHash> {
    q.iter().map(|&h| ContentHash(h)).collect()
}

pub fn chain_answer(scores: kv_index::OverlapScores, ids: &HashMap<u32, u64>) -> Answer {
    let mut a: Answer = scores
        .scores
        .iter()
        .filter(|&(_, &s)| s > 0)
        .map(|(id, &s)| (ids[id], s))
        .collect();
    a.sort_unstable();
    a
}

// ---- ours ----------------------------------------------------------------------------------

pub fn ours(events: &[WorkloadEvent]) -> RadixIndex {
    let mut ix = RadixIndex::new(IndexConfig::default());
    for e in events {
        let _ = ix.apply(e.worker_id, 0, &e.data);
    }
    ix
}

pub fn ours_shared(events: &[WorkloadEvent]) -> SharedIndex {
    SharedIndex::from_index(ours(events))
}
