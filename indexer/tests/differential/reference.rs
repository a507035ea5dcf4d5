//! The deliberately naive model: per (worker, rank), a map from block hash to the block's full
//! tokens path and tier mask. Every query is answered by brute force.

use std::collections::BTreeMap;

use kvroute_common::messages::{KvEventData, WorkerMatch};
use kvroute_indexer::{ApplyError, ApplyOk};

#[derive(Debug, Clone)]
struct Held {
    path: Vec<u64>,
    tiers: u8,
    stamp: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Reference {
    cap: Option<usize>,
    pairs: BTreeMap<(u64, u32), BTreeMap<u64, Held>>,
    clock: u64,
}

impl Reference {
    pub fn new(cap: Option<usize>) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.pairs.values().map(BTreeMap::len).sum()
    }

    pub fn workers(&self) -> Vec<(u64, u32)> {
        self.pairs.keys().copied().collect()
    }

    /// Block hashes a pair holds (for generating plausible events).
    pub fn hashes_of(&self, pair: (u64, u32)) -> Vec<u64> {
        self.pairs
            .get(&pair)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Distinct prefixes of every held path: exactly the blocks the tree must hold.
    pub fn prefixes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        for m in self.pairs.values() {
            for h in m.values() {
                for k in 1..=h.path.len() {
                    seen.insert(&h.path[..k]);
                }
            }
        }
        seen.len()
    }

    /// Every held path (for generating plausible queries).
    pub fn paths(&self) -> Vec<Vec<u64>> {
        self.pairs
            .values()
            .flat_map(|m| m.values().map(|h| h.path.clone()))
            .collect()
    }

    pub fn apply(&mut self, w: u64, d: u32, ev: &KvEventData) -> Result<ApplyOk, ApplyError> {
        let mut ok = ApplyOk::default();
        match ev {
            KvEventData::Stored {
                parent_hash,
                blocks,
                tier,
            } => {
                let mut path = match parent_hash {
                    None => Vec::new(),
                    Some(p) => match self.pairs.get(&(w, d)).and_then(|m| m.get(p)) {
                        Some(h) => h.path.clone(),
                        None => {
                            return Err(ApplyError::ParentUnknown {
                                worker_id: w,
                                dp_rank: d,
                                parent_hash: *p,
                            });
                        }
                    },
                };
                let bit = 1u8 << tier.index();
                for b in blocks {
                    path.push(b.tokens_hash);
                    self.clock += 1;
                    let clock = self.clock;
                    let m = self.pairs.entry((w, d)).or_default();
                    let alias = m
                        .iter()
                        .find(|(_, h)| h.path == path)
                        .map(|(&k, h)| (k, h.tiers));
                    match alias {
                        Some((_, tiers)) if tiers & bit != 0 => ok.unchanged += 1,
                        _ => ok.stored += 1,
                    }
                    match m.get_mut(&b.block_hash) {
                        Some(h) if h.path == path => {
                            h.tiers |= bit;
                            h.stamp = clock;
                        }
                        _ => {
                            m.remove(&b.block_hash);
                            if let Some((k, _)) = alias {
                                m.get_mut(&k).unwrap().tiers |= bit;
                            } else {
                                m.insert(
                                    b.block_hash,
                                    Held {
                                        path: path.clone(),
                                        tiers: bit,
                                        stamp: clock,
                                    },
                                );
                            }
                        }
                    }
                    ok.evicted += self.evict();
                }
                self.drop_empty();
            }
            KvEventData::Removed { block_hashes, tier } => {
                let bit = 1u8 << tier.index();
                for h in block_hashes {
                    let m = self.pairs.entry((w, d)).or_default();
                    match m.get_mut(h) {
                        Some(held) if held.tiers & bit != 0 => {
                            held.tiers &= !bit;
                            if held.tiers == 0 {
                                m.remove(h);
                            }
                            ok.removed += 1;
                        }
                        _ => ok.unchanged += 1,
                    }
                }
                self.drop_empty();
            }
            KvEventData::Cleared => {
                ok.removed = self.pairs.remove(&(w, d)).map_or(0, |m| m.len() as u32);
            }
        }
        Ok(ok)
    }

    fn evict(&mut self) -> u32 {
        let Some(cap) = self.cap else { return 0 };
        let mut n = 0;
        while self.len() > cap {
            let oldest = self
                .pairs
                .iter()
                .flat_map(|(&p, m)| m.iter().map(move |(&k, h)| (h.stamp, p, k)))
                .min()
                .unwrap();
            self.pairs.get_mut(&oldest.1).unwrap().remove(&oldest.2);
            n += 1;
        }
        self.drop_empty();
        n
    }

    fn drop_empty(&mut self) {
        self.pairs.retain(|_, m| !m.is_empty());
    }

    pub fn remove_worker(&mut self, w: u64) {
        self.pairs.retain(|&(pw, _), _| pw != w);
    }

    pub fn remove_worker_dp_rank(&mut self, w: u64, d: u32) {
        self.pairs.remove(&(w, d));
    }

    pub fn find_matches(&self, query: &[u64]) -> Vec<WorkerMatch> {
        let mut out = Vec::new();
        for (&(w, d), m) in &self.pairs {
            let mut row = WorkerMatch {
                worker_id: w,
                dp_rank: d,
                total_blocks: m.len() as u64,
                ..WorkerMatch::default()
            };
            let mut held = 0;
            for depth in 1..=query.len() {
                let Some(h) = m.values().find(|h| h.path == query[..depth]) else {
                    break;
                };
                held += 1;
                match h.tiers.trailing_zeros() {
                    0 => row.device += 1,
                    1 => row.host += 1,
                    2 => row.disk += 1,
                    _ => {}
                }
            }
            if held > 0 {
                out.push(row);
            }
        }
        // The shared tier's prefix: each block held in the shared tier by some pair.
        let shared_bit = 1u8 << 3;
        let shared = (1..=query.len())
            .take_while(|&depth| {
                self.pairs.values().any(|m| {
                    m.values()
                        .any(|h| h.path == query[..depth] && h.tiers & shared_bit != 0)
                })
            })
            .count() as u32;
        for row in &mut out {
            row.shared = shared;
        }
        out
    }
}
