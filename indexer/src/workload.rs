//! Trace-driven KV event streams for the benches and the peer comparison (feature `workload`).
//!
//! Each Mooncake request is expanded to engine blocks of `block_size` tokens
//! ([`TraceRequest::tokens`], hashed as in `kvroute_common::hashing`), sent to one of `workers`
//! simulated engines (a fixed pseudo-random choice per request), and replayed against that
//! engine's LRU cache of `cache_blocks` blocks: cached leading blocks are touched, the rest are
//! stored (`Stored` under the last cached block), and blocks evicted to make room are reported
//! first (`Removed`). Blocks are touched leaf-first, so eviction takes leaves before parents,
//! as engines do. Each request's local hashes are also kept as a query.

use std::collections::{BTreeMap, HashMap};

use kvroute_common::hashing::BlockHashes;
use kvroute_common::ids::WorkerId;
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_common::trace::TraceRequest;

/// How to replay a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadConfig {
    /// Simulated engines (worker ids `0..workers`, dp rank 0).
    pub workers: usize,
    /// Tokens per engine block (16 or 64 in the benches).
    pub block_size: usize,
    /// LRU capacity of each engine, in blocks. Longer prompts are cut to this length.
    pub cache_blocks: usize,
    /// Replay at most this many requests (`usize::MAX`: all).
    pub max_requests: usize,
}

/// One event of one worker, in replay order.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadEvent {
    pub worker_id: WorkerId,
    pub data: KvEventData,
}

/// The replayed stream.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    pub events: Vec<WorkloadEvent>,
    /// Each request's local block hashes, in trace order.
    pub queries: Vec<Vec<u64>>,
    /// Blocks named by all events (stored + removed).
    pub block_events: u64,
    /// Blocks cached across all engines at the end (= index entries after the replay).
    pub final_entries: usize,
}

/// An LRU of block hashes with integer ticks (oldest = smallest tick).
#[derive(Default)]
struct Lru {
    tick_of: HashMap<u64, u64>,
    by_tick: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(old) = self.tick_of.insert(hash, self.tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(self.tick, hash);
    }

    fn evict_oldest(&mut self) -> Option<u64> {
        let (_, hash) = self.by_tick.pop_first()?;
        self.tick_of.remove(&hash);
        Some(hash)
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Replays `requests` as described in the module docs.
pub fn build(requests: &[TraceRequest], config: &WorkloadConfig) -> Workload {
    let mut caches: Vec<Lru> = (0..config.workers).map(|_| Lru::default()).collect();
    let mut out = Workload::default();
    for (i, req) in requests.iter().take(config.max_requests).enumerate() {
        let worker = (mix(i as u64) % config.workers as u64) as usize;
        let mut h = BlockHashes::of_tokens(&req.tokens(), config.block_size, None);
        h.local.truncate(config.cache_blocks);
        h.sequence.truncate(config.cache_blocks);
        let lru = &mut caches[worker];
        let cached = h
            .sequence
            .iter()
            .take_while(|s| lru.tick_of.contains_key(s))
            .count();
        // Touch the cached prefix so eviction cannot take it, leaf first.
        for s in h.sequence[..cached].iter().rev() {
            lru.touch(*s);
        }
        let missing = h.sequence.len() - cached;
        let mut evicted = Vec::new();
        while lru.tick_of.len() + missing > config.cache_blocks {
            evicted.extend(lru.evict_oldest());
        }
        if !evicted.is_empty() {
            out.block_events += evicted.len() as u64;
            out.events.push(WorkloadEvent {
                worker_id: worker as WorkerId,
                data: KvEventData::Removed {
                    block_hashes: evicted,
                    tier: StorageTier::Device,
                },
            });
        }
        if missing > 0 {
            // Newly stored blocks are older than the prefix (touched leaf first).
            let new: Vec<u64> = h.sequence[cached..].to_vec();
            for s in new.iter().rev() {
                lru.touch(*s);
            }
            for s in h.sequence[..cached].iter().rev() {
                lru.touch(*s);
            }
            out.block_events += missing as u64;
            out.events.push(WorkloadEvent {
                worker_id: worker as WorkerId,
                data: KvEventData::Stored {
                    parent_hash: cached.checked_sub(1).map(|p| h.sequence[p]),
                    blocks: (cached..h.sequence.len())
                        .map(|j| StoredBlock {
                            block_hash: h.sequence[j],
                            tokens_hash: h.local[j],
                        })
                        .collect(),
                    tier: StorageTier::Device,
                },
            });
        }
        out.queries.push(h.local);
    }
    out.final_entries = caches.iter().map(|c| c.tick_of.len()).sum();
    out
}

/// The process's resident set, from /proc (0 if unknown): the benches measure memory as its
/// growth.
pub fn rss_bytes() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}
