//! Approximate cache: for workers that publish no KV events (card `kv_events: false`), each
//! router replica predicts what their caches hold from the decisions it applies — its own and
//! every other replica's, from the decisions subject, so replicas agree — and the cost model
//! reads that prediction as the rank's device overlap, unchanged otherwise.
//!
//! A rank's prediction is the prefixes of the prompts decided for it, keyed like the predicted
//! overlap ([`PromptPrefixes`]: chain hashes at a geometric schedule of depths). An entry at
//! depth `d` stands for the blocks between the previous scheduled depth and `d`, so a prefix
//! two prompts share is counted once; the entries' blocks are kept within the card's
//! `total_kv_blocks` (per rank, as the busy thresholds read it) by evicting the least recently
//! decided first — within one decision the deepest first, so a kept entry's shallower prefixes
//! are kept too — and an entry not decided again for the TTL goes. Order is by the decisions'
//! own `ts`, not by arrival, so replicas that applied the same decisions hold the same entries.
//! Pure: time comes in as arguments.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use kvroute_common::WorkerId;
use kvroute_common::messages::WorkerCard;

use super::predicted::PromptPrefixes;
use crate::worker::WorkerRank;

/// One remembered prefix of a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    depth: u32,
    /// Blocks it adds to its next shallower scheduled prefix.
    blocks: u32,
    /// The latest decision `ts` that included it.
    last_ms: u64,
}

impl Entry {
    fn key(&self, chain: u64) -> (u64, Reverse<u32>, u64) {
        (self.last_ms, Reverse(self.depth), chain)
    }
}

/// One rank's predicted cache.
#[derive(Debug)]
struct RankCache {
    capacity: u64,
    used: u64,
    entries: HashMap<u64, Entry>,
    /// Eviction order: oldest decision first, then deepest first.
    lru: BTreeSet<(u64, Reverse<u32>, u64)>,
}

impl RankCache {
    fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            entries: HashMap::new(),
            lru: BTreeSet::new(),
        }
    }

    fn touch(&mut self, depth: u32, blocks: u32, chain: u64, decided_ms: u64) {
        match self.entries.get_mut(&chain) {
            Some(e) => {
                if decided_ms > e.last_ms {
                    self.lru.remove(&e.key(chain));
                    e.last_ms = decided_ms;
                    self.lru.insert(e.key(chain));
                }
            }
            None => {
                let e = Entry {
                    depth,
                    blocks,
                    last_ms: decided_ms,
                };
                self.entries.insert(chain, e);
                self.lru.insert(e.key(chain));
                self.used += u64::from(blocks);
            }
        }
    }

    fn pop_oldest(&mut self) -> bool {
        let Some(key) = self.lru.pop_first() else {
            return false;
        };
        if let Some(e) = self.entries.remove(&key.2) {
            self.used -= u64::from(e.blocks);
        }
        true
    }

    fn evict_to_capacity(&mut self) {
        while self.used > self.capacity && self.pop_oldest() {}
    }

    /// Drops entries past their TTL at `now_ms`.
    fn expire(&mut self, ttl_ms: u64, now_ms: u64) {
        while self
            .lru
            .first()
            .is_some_and(|&(last, _, _)| !alive(last, ttl_ms, now_ms))
        {
            self.pop_oldest();
        }
    }

    /// The deepest prefix of `prompt` held at `now_ms`.
    fn deepest(&self, prompt: &PromptPrefixes, ttl_ms: u64, now_ms: u64) -> u32 {
        let mut found = 0;
        for &(depth, chain) in prompt.depths() {
            match self.entries.get(&chain) {
                Some(e) if alive(e.last_ms, ttl_ms, now_ms) => found = depth,
                _ => break,
            }
        }
        found
    }
}

/// Whether something last decided at `last_ms` is still within the TTL at `now_ms`.
fn alive(last_ms: u64, ttl_ms: u64, now_ms: u64) -> bool {
    last_ms.saturating_add(ttl_ms) > now_ms
}

/// The predicted caches of the ranks of workers without KV events.
#[derive(Debug)]
pub struct ApproxCache {
    ttl_ms: u64,
    ranks: HashMap<WorkerRank, RankCache>,
}

impl ApproxCache {
    /// `ttl_ms` 0 turns approximate mode off (workers without events are then routed on load).
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            ttl_ms,
            ranks: HashMap::new(),
        }
    }

    /// Whether any rank is predicted.
    pub fn is_enabled(&self) -> bool {
        !self.ranks.is_empty()
    }

    /// Whether `rank`'s cache is predicted.
    pub fn tracks(&self, rank: WorkerRank) -> bool {
        self.ranks.contains_key(&rank)
    }

    /// Ranks predicted.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Blocks predicted held, over every rank.
    pub fn total_blocks(&self) -> u64 {
        self.ranks.values().map(|r| r.used).sum()
    }

    /// Blocks predicted held on `rank` (`None` when it is not predicted).
    pub fn used_blocks(&self, rank: WorkerRank) -> Option<u64> {
        self.ranks.get(&rank).map(|r| r.used)
    }

    /// Prefixes held on `rank`.
    pub fn entries(&self, rank: WorkerRank) -> usize {
        self.ranks.get(&rank).map_or(0, |r| r.entries.len())
    }

    /// The registered workers are `cards`: the ranks of those without KV events are predicted
    /// (a new one empty, a known one keeping its prefixes within its card's capacity); every
    /// other rank is dropped.
    pub fn set_workers<'a>(&mut self, cards: impl IntoIterator<Item = &'a WorkerCard>) {
        if self.ttl_ms == 0 {
            return;
        }
        let mut wanted: HashMap<WorkerRank, u64> = HashMap::new();
        for card in cards.into_iter().filter(|c| !c.kv_events) {
            for dp_rank in card.dp_ranks() {
                wanted.insert(
                    WorkerRank::new(card.worker_id, dp_rank),
                    card.total_kv_blocks,
                );
            }
        }
        self.ranks.retain(|rank, _| wanted.contains_key(rank));
        for (rank, capacity) in wanted {
            let cache = self
                .ranks
                .entry(rank)
                .or_insert_with(|| RankCache::new(capacity));
            cache.capacity = capacity;
            cache.evict_to_capacity();
        }
    }

    /// Forgets every rank of a departed worker.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|rank, _| rank.worker_id != worker_id);
    }

    /// Credits `prompt` to `rank` (when predicted) as decided at `decided_ms`.
    pub fn record(
        &mut self,
        rank: WorkerRank,
        prompt: &PromptPrefixes,
        decided_ms: u64,
        now_ms: u64,
    ) {
        let Some(cache) = self.ranks.get_mut(&rank) else {
            return;
        };
        if !alive(decided_ms, self.ttl_ms, now_ms) {
            return;
        }
        let mut shallower = 0u32;
        for &(depth, chain) in prompt.depths() {
            cache.touch(depth, depth - shallower, chain, decided_ms);
            shallower = depth;
        }
        cache.evict_to_capacity();
    }

    /// Drops what was last decided a TTL or more before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        for cache in self.ranks.values_mut() {
            cache.expire(self.ttl_ms, now_ms);
        }
    }

    /// The predicted leading blocks of `prompt` per rank at `now_ms` (ranks with none left out).
    pub fn matches(&self, prompt: &PromptPrefixes, now_ms: u64) -> Vec<(WorkerRank, u32)> {
        let mut found: Vec<(WorkerRank, u32)> = self
            .ranks
            .iter()
            .map(|(rank, cache)| (*rank, cache.deepest(prompt, self.ttl_ms, now_ms)))
            .filter(|&(_, blocks)| blocks > 0)
            .collect();
        found.sort_unstable();
        found
    }
}

#[cfg(test)]
mod tests;
