//! A simulated paged KV cache: fixed-size blocks named by sequence hash, prefix reuse, pins for
//! running requests, LRU eviction of unpinned blocks, and the KV events such a cache publishes.
//!
//! *Invariant:* the held blocks are prefix-closed (a held block's parent is held), and the
//! events drained so far, applied in order to an empty set, give exactly [`KvCache::held_blocks`].

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvroute_common::RequestId;
use kvroute_common::hashing::{BlockHashes, LocalBlockHash, SequenceHash};
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};

/// Size of a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Blocks the cache holds.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u32,
}

/// What [`KvCache::admit`] did for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Leading hashed blocks that were already held (prefix hits).
    pub cached_blocks: u32,
    /// Hashed blocks allocated for this request (to be computed).
    pub new_blocks: u32,
    /// Private, unhashed blocks reserved for this request (partial tail and output).
    pub private_blocks: u32,
}

/// Why a request could not be admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// Not enough free or evictable blocks now; retry after running requests release theirs.
    #[error("request {request_id}: needs {needed} free blocks, {available} available")]
    Full {
        request_id: RequestId,
        needed: u64,
        available: u64,
    },
    /// The request needs more blocks than the whole cache has; it can never be admitted.
    #[error("request {request_id}: needs {needed} blocks, the cache has {capacity}")]
    TooLarge {
        request_id: RequestId,
        needed: u64,
        capacity: u64,
    },
    #[error("request {request_id} is already admitted")]
    AlreadyAdmitted { request_id: RequestId },
}

#[derive(Debug)]
struct Block {
    parent: Option<SequenceHash>,
    tokens_hash: LocalBlockHash,
    /// Running requests pinning this block.
    refs: u32,
    /// Position in the LRU list while `refs == 0`.
    lru_tick: Option<u64>,
}

#[derive(Debug)]
struct Pinned {
    blocks: Vec<SequenceHash>,
    private_blocks: u64,
}

/// The cache of one (worker, dp rank). A plain state machine: no clock, no I/O.
#[derive(Debug)]
pub struct KvCache {
    config: CacheConfig,
    blocks: HashMap<SequenceHash, Block>,
    /// Unpinned blocks, oldest first. Keys are unique ticks.
    lru: BTreeMap<u64, SequenceHash>,
    next_tick: u64,
    requests: HashMap<RequestId, Pinned>,
    private_blocks: u64,
    events: Vec<KvEventData>,
}

impl KvCache {
    pub fn new(config: CacheConfig) -> Self {
        Self {
            config,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            requests: HashMap::new(),
            private_blocks: 0,
            events: Vec::new(),
        }
    }

    pub fn config(&self) -> CacheConfig {
        self.config
    }

    /// Leading blocks of `hashes` held now, without pinning or touching them.
    pub fn cached_prefix(&self, hashes: &BlockHashes) -> u32 {
        hashes
            .sequence
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count() as u32
    }

    /// Pins the request's leading held blocks, allocates the missing ones (evicting LRU unpinned
    /// blocks as needed) plus `private_blocks` unhashed blocks, and records a `Stored` event for
    /// the new blocks. All or nothing: on error nothing changes.
    pub fn admit(
        &mut self,
        request_id: RequestId,
        hashes: &BlockHashes,
        private_blocks: u32,
    ) -> Result<Admission, CacheError> {
        if self.requests.contains_key(&request_id) {
            return Err(CacheError::AlreadyAdmitted { request_id });
        }
        let total = hashes.sequence.len() as u64 + u64::from(private_blocks);
        if total > self.config.num_blocks {
            return Err(CacheError::TooLarge {
                request_id,
                needed: total,
                capacity: self.config.num_blocks,
            });
        }
        let cached = self.cached_prefix(hashes) as usize;
        // Held blocks this request pins that are evictable now stop being evictable.
        let unpinned_hits = hashes.sequence[..cached]
            .iter()
            .filter(|h| self.blocks[*h].refs == 0)
            .count() as u64;
        let new = (hashes.sequence.len() - cached) as u64;
        let needed = new + u64::from(private_blocks);
        let available = self.free_blocks() + self.lru.len() as u64 - unpinned_hits;
        if needed > available {
            return Err(CacheError::Full {
                request_id,
                needed,
                available,
            });
        }

        for h in &hashes.sequence[..cached] {
            let block = self.blocks.get_mut(h).expect("cached prefix is held");
            if let Some(tick) = block.lru_tick.take() {
                self.lru.remove(&tick);
            }
            block.refs += 1;
        }
        let shortfall = needed.saturating_sub(self.free_blocks());
        self.evict(shortfall);

        let mut stored = Vec::with_capacity(new as usize);
        let mut parent = cached.checked_sub(1).map(|i| hashes.sequence[i]);
        for (&block_hash, &tokens_hash) in hashes.sequence[cached..]
            .iter()
            .zip(&hashes.local[cached..])
        {
            debug_assert!(
                !self.blocks.contains_key(&block_hash),
                "held set is prefix-closed"
            );
            self.blocks.insert(
                block_hash,
                Block {
                    parent,
                    tokens_hash,
                    refs: 1,
                    lru_tick: None,
                },
            );
            stored.push(StoredBlock {
                block_hash,
                tokens_hash,
            });
            parent = Some(block_hash);
        }
        if !stored.is_empty() {
            self.events.push(KvEventData::Stored {
                parent_hash: cached.checked_sub(1).map(|i| hashes.sequence[i]),
                blocks: stored,
                tier: StorageTier::Device,
            });
        }
        self.private_blocks += u64::from(private_blocks);
        self.requests.insert(
            request_id,
            Pinned {
                blocks: hashes.sequence.clone(),
                private_blocks: u64::from(private_blocks),
            },
        );
        Ok(Admission {
            cached_blocks: cached as u32,
            new_blocks: new as u32,
            private_blocks,
        })
    }

    /// Unpins the request's blocks (they stay cached for reuse) and frees its private blocks.
    /// Returns false if the request was not admitted.
    pub fn release(&mut self, request_id: RequestId) -> bool {
        let Some(pinned) = self.requests.remove(&request_id) else {
            return false;
        };
        self.private_blocks -= pinned.private_blocks;
        // Deepest first, so a parent is always more recently used than its children and LRU
        // eviction never removes a parent before its children.
        for h in pinned.blocks.iter().rev() {
            let block = self.blocks.get_mut(h).expect("pinned blocks are held");
            block.refs -= 1;
            if block.refs == 0 {
                let tick = self.next_tick;
                self.next_tick += 1;
                block.lru_tick = Some(tick);
                self.lru.insert(tick, *h);
            }
        }
        true
    }

    /// Evicts `count` unpinned blocks, least recently used first, as one `Removed` event.
    fn evict(&mut self, count: u64) {
        if count == 0 {
            return;
        }
        let mut removed = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (_, h) = self
                .lru
                .pop_first()
                .expect("admit checked evictable blocks");
            self.blocks.remove(&h);
            removed.push(h);
        }
        self.events.push(KvEventData::Removed {
            block_hashes: removed,
            tier: StorageTier::Device,
        });
    }

    /// Events recorded since the last drain, oldest first.
    pub fn drain_events(&mut self) -> Vec<KvEventData> {
        std::mem::take(&mut self.events)
    }

    /// `Stored` events that recreate the current contents from empty (parents before children),
    /// for a resync: publish `Cleared`, then these. Deterministic for a given content.
    pub fn snapshot_events(&self) -> Vec<KvEventData> {
        let mut children: BTreeMap<Option<SequenceHash>, Vec<SequenceHash>> = BTreeMap::new();
        for (&h, block) in &self.blocks {
            children.entry(block.parent).or_default().push(h);
        }
        for list in children.values_mut() {
            list.sort_unstable();
        }
        let mut out = Vec::new();
        // Each stack entry starts a chain: (parent, first block). A chain goes on while its
        // last block has exactly one child.
        let mut stack: Vec<(Option<SequenceHash>, SequenceHash)> = children
            .get(&None)
            .map(|roots| roots.iter().rev().map(|&r| (None, r)).collect())
            .unwrap_or_default();
        while let Some((parent_hash, first)) = stack.pop() {
            let mut blocks = Vec::new();
            let mut cur = first;
            loop {
                blocks.push(StoredBlock {
                    block_hash: cur,
                    tokens_hash: self.blocks[&cur].tokens_hash,
                });
                match children.get(&Some(cur)).map(Vec::as_slice) {
                    Some([only]) => cur = *only,
                    Some(many) => {
                        stack.extend(many.iter().rev().map(|&c| (Some(cur), c)));
                        break;
                    }
                    None => break,
                }
            }
            out.push(KvEventData::Stored {
                parent_hash,
                blocks,
                tier: StorageTier::Device,
            });
        }
        out
    }

    /// The sequence hashes of every held block.
    pub fn held_blocks(&self) -> BTreeSet<SequenceHash> {
        self.blocks.keys().copied().collect()
    }

    /// Blocks in use: hashed blocks held (pinned or cached) plus private blocks.
    pub fn used_blocks(&self) -> u64 {
        self.blocks.len() as u64 + self.private_blocks
    }

    /// Blocks neither held nor reserved.
    pub fn free_blocks(&self) -> u64 {
        self.config.num_blocks - self.used_blocks()
    }

    /// Blocks that could be evicted now (held, pinned by no request).
    pub fn evictable_blocks(&self) -> u64 {
        self.lru.len() as u64
    }

    /// Blocks pinned by, or reserved for, running requests.
    pub fn pinned_blocks(&self) -> u64 {
        self.used_blocks() - self.evictable_blocks()
    }
}

#[cfg(test)]
mod tests;
