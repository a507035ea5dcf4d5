//! Overlap queries: for a prompt's local block hashes, how many leading blocks each
//! (worker, dp rank) holds, split by tier, and how many the shared tier holds.
//!
//! The shared tier (LMCache, a remote store) is one store for the whole fleet, announced in
//! parts: each worker announces the blocks it wrote there. Its prefix is therefore chained
//! across pairs — block `i` counts if *some* pair holds it in the shared tier — where a pair's
//! own tiers count only from the first block on. A worker that continued a conversation
//! another worker wrote to the store announces only the new blocks, and the chain still
//! reaches them.
//!
//! Considered instead: the store as one fleet-wide holder (a reserved pair every worker's
//! shared events apply to). Rejected: workers name blocks by their own hashes (a hash one
//! engine stored another cannot remove), a store's parent need not be in the store, and the
//! per-pair rules (event ids, `Cleared`, worker removal, resyncs) would have no owner. What the
//! chosen way costs: a departed worker's announcements go with it (the prefix under-counts,
//! never over-counts), and the chain is not scoped by model (models whose prompts hash alike
//! would credit each other's stores). The shared tier is a fourth tier bit in an owner's mask,
//! which leaves room for 2^28 (worker, rank) pairs.
//!
//! The walk's buffers are a per-thread scratch reused by the next query on that thread (no
//! allocation per query once warm); nothing in it outlives a query. Rows come out sorted by
//! (worker, rank) through a per-pair rank the view keeps incrementally (a full sort per new
//! pair made restoring 10,000 workers quadratic).

use std::sync::atomic::Ordering;

use kvroute_common::hashing::{LocalBlockHash, local_block_hashes, seed_for_lora};
use kvroute_common::messages::WorkerMatch;

use super::view::{Owner, ROOT, SHARED_BIT, Slot, View, owner_end, owner_slot, owner_tiers};

/// The answer to one query.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// One row per (worker, dp rank) holding at least the first block, sorted by worker then
    /// rank. `device + host + disk` is the number of consecutive leading blocks held in the
    /// pair's own tiers; each block counts in the best tier the worker holds it in (device,
    /// then host, then disk; a block the pair holds only in the shared tier counts in none).
    /// `shared` is the same in every row: the query's shared-tier prefix
    /// ([`OverlapScores::shared_prefix`]). `total_blocks` is everything that pair holds (for
    /// tie-breaks).
    pub matches: Vec<WorkerMatch>,
    /// Full blocks in the query.
    pub query_blocks: u32,
}

impl OverlapScores {
    /// The row of one (worker, dp rank), if it matched anything.
    pub fn get(
        &self,
        worker_id: kvroute_common::WorkerId,
        dp_rank: kvroute_common::DpRank,
    ) -> Option<&WorkerMatch> {
        self.matches
            .binary_search_by_key(&(worker_id, dp_rank), |m| (m.worker_id, m.dp_rank))
            .ok()
            .map(|i| &self.matches[i])
    }

    /// Leading blocks matched by a row in the pair's own tiers (device, host, disk).
    pub fn matched(m: &WorkerMatch) -> u32 {
        m.device + m.host + m.disk
    }

    /// Leading blocks of the query the shared tier holds: every block of the prefix is held
    /// in the shared tier by some pair (not necessarily the same one). 0 without rows.
    pub fn shared_prefix(&self) -> u32 {
        self.matches.first().map_or(0, |m| m.shared)
    }
}

/// A pair met on the path, with its blocks by best tier (the last, shared, is not reported).
#[derive(Debug, Clone, Copy)]
struct Run {
    slot: Slot,
    by_tier: [u32; 4],
}

/// The shared-tier blocks of a run that the query matched `m` blocks of: the longest prefix
/// any owner holds in the shared tier.
#[inline]
fn shared_cover(owners: &[Owner], m: u32) -> u32 {
    owners
        .iter()
        .filter(|&&o| owner_tiers(o) & SHARED_BIT != 0)
        .map(|&o| owner_end(o).min(m))
        .max()
        .unwrap_or(0)
}

/// A query's working memory, kept per thread and reused: at 1,024 workers a query's pairs
/// need tens of kilobytes, and allocating them afresh each time made the allocator return and
/// fault in pages on every query. Nothing survives from one query to the next.
#[derive(Debug, Default)]
struct Scratch {
    runs: Vec<Run>,
    live: Vec<u32>,
    at: Vec<u32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Credits `owner`'s part of a run of which the query matched `m` blocks; true if the pair
/// holds the whole run.
#[inline(always)]
fn credit(run: &mut Run, o: Owner, m: u32, len: u32) -> bool {
    let end = owner_end(o);
    run.by_tier[owner_tiers(o).trailing_zeros() as usize] += end.min(m);
    end == len
}

impl View {
    /// Matches a prompt given as local block hashes (`tokens_hash` of each full block).
    ///
    /// Walks the query's path once, comparing it with each run's hashes, and stops as soon as
    /// no pair remains on it; a miss on the first block costs one hash lookup.
    pub fn find_matches(&self, local_hashes: &[LocalBlockHash]) -> OverlapScores {
        let query_blocks = u32::try_from(local_hashes.len()).unwrap_or(u32::MAX);
        let Some(&first) = local_hashes.first() else {
            return OverlapScores::default();
        };
        let Some(node) = self.child(ROOT, first) else {
            return OverlapScores {
                matches: Vec::new(),
                query_blocks,
            };
        };
        let matches = SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.walk(node, local_hashes, &mut s),
            // Only if a query ran inside another on this thread.
            Err(_) => self.walk(node, local_hashes, &mut Scratch::default()),
        });
        OverlapScores {
            matches,
            query_blocks,
        }
    }

    /// The walk of [`View::find_matches`] from the first node on; returns the rows.
    fn walk(
        &self,
        mut node: super::view::NodeId,
        local_hashes: &[LocalBlockHash],
        scratch: &mut Scratch,
    ) -> Vec<WorkerMatch> {
        let Scratch { runs, live, at } = scratch;
        runs.clear();
        // Indices into `runs` of the pairs still on the path, in slot order (as owners are).
        live.clear();
        let mut pos = 0usize;
        // The shared-tier prefix so far, and whether every block so far was in it: the walk
        // goes on while it is, even with no pair left on the path.
        let mut shared = 0u32;
        let mut shared_on = true;
        loop {
            let n = self.node(node);
            let tokens = self.arena.run(n.start, n.len);
            let rest = &local_hashes[pos..];
            let limit = tokens.len().min(rest.len());
            // The first block matched already (it is how the node was found).
            let mut m = 1;
            while m < limit && tokens[m].load(Ordering::Relaxed) == rest[m] {
                m += 1;
            }
            let owners = self.owners(node);
            // Pairs holding the whole run go on only if the query goes past it.
            let goes_on = m == n.len as usize && pos + m < local_hashes.len();
            let m = m as u32;
            if runs.is_empty() {
                // The first run: every owner is met anyway, so the shared cover comes along.
                runs.reserve_exact(owners.len());
                let mut cover = 0;
                for &o in owners {
                    let mut run = Run {
                        slot: owner_slot(o),
                        by_tier: [0; 4],
                    };
                    if owner_tiers(o) & SHARED_BIT != 0 {
                        cover = cover.max(owner_end(o).min(m));
                    }
                    if credit(&mut run, o, m, n.len) && goes_on {
                        live.push(runs.len() as u32);
                    }
                    runs.push(run);
                }
                shared = cover;
                shared_on = cover == n.len;
            } else {
                if shared_on {
                    let cover = shared_cover(owners, m);
                    shared += cover;
                    shared_on = cover == n.len;
                }
                let mut kept = 0;
                if live.len() * 16 < owners.len() {
                    // Few pairs left on a crowded run: look each one up.
                    for i in 0..live.len() {
                        let run = &mut runs[live[i] as usize];
                        if let Ok(k) = owners.binary_search_by_key(&run.slot, |&o| owner_slot(o))
                            && credit(run, owners[k], m, n.len)
                            && goes_on
                        {
                            live[kept] = live[i];
                            kept += 1;
                        }
                    }
                } else {
                    // Merge the two slot-ordered lists.
                    let mut k = 0;
                    for i in 0..live.len() {
                        let run = &mut runs[live[i] as usize];
                        while k < owners.len() && owner_slot(owners[k]) < run.slot {
                            k += 1;
                        }
                        if k < owners.len() && owner_slot(owners[k]) == run.slot {
                            if credit(run, owners[k], m, n.len) && goes_on {
                                live[kept] = live[i];
                                kept += 1;
                            }
                            k += 1;
                        }
                    }
                }
                live.truncate(kept);
            }
            if (live.is_empty() && !shared_on) || !goes_on {
                break;
            }
            pos += m as usize;
            match self.child(node, local_hashes[pos]) {
                Some(c) => node = c,
                None => break,
            }
        }
        self.rows(runs, at, shared)
    }

    /// The answer's rows, sorted by (worker, dp rank), each with the shared prefix.
    fn rows(&self, runs: &mut [Run], at: &mut Vec<u32>, shared: u32) -> Vec<WorkerMatch> {
        let row = |r: &Run| {
            let p = self.pair(r.slot);
            WorkerMatch {
                worker_id: p.worker_id,
                dp_rank: p.dp_rank,
                device: r.by_tier[0],
                host: r.by_tier[1],
                disk: r.by_tier[2],
                shared,
                total_blocks: p.blocks,
            }
        };
        let pairs = self.pairs_used();
        // Place by rank when many matched, else sort the few.
        if runs.len() * 8 >= pairs {
            at.clear();
            at.resize(pairs, u32::MAX);
            for (i, r) in runs.iter().enumerate() {
                at[self.pair(r.slot).rank as usize] = i as u32;
            }
            // Sized up front: a filtered iterator's size hint is 0.
            let mut rows = Vec::with_capacity(runs.len());
            rows.extend(
                at.iter()
                    .filter(|&&i| i != u32::MAX)
                    .map(|&i| row(&runs[i as usize])),
            );
            rows
        } else {
            runs.sort_unstable_by_key(|r| self.pair(r.slot).rank);
            runs.iter().map(row).collect()
        }
    }

    /// Matches a prompt given as token ids: hashes its full blocks of `block_size` tokens with
    /// the seed of `lora_name` (see `kvroute_common::hashing`), then [`Self::find_matches`].
    pub fn find_matches_for_tokens(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora_name: Option<&str>,
    ) -> OverlapScores {
        let hashes = local_block_hashes(tokens, block_size, seed_for_lora(lora_name));
        self.find_matches(&hashes)
    }
}
