//! Overlap queries: for a prompt's local block hashes, how many leading blocks each
//! (worker, dp rank) holds, split by tier.

use kvroute_common::hashing::{LocalBlockHash, local_block_hashes, seed_for_lora};
use kvroute_common::messages::WorkerMatch;

use super::radix::RadixIndex;
use super::tree::{ROOT, Slot, owner_slot, owner_tiers};

/// The answer to one query.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// One row per (worker, dp rank) holding at least the first block, sorted by worker then
    /// rank. `device + host + disk` is the number of consecutive leading blocks held; each
    /// block counts in the best tier the worker holds it in (device, then host, then disk).
    /// `total_blocks` is everything that pair holds (for tie-breaks).
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

    /// Leading blocks matched by a row, in any tier.
    pub fn matched(m: &WorkerMatch) -> u32 {
        m.device + m.host + m.disk
    }
}

/// A worker still on the path, with its counts by tier.
#[derive(Debug, Clone, Copy)]
struct Run {
    slot: Slot,
    by_tier: [u32; 3],
    /// Best tier on the last node merged.
    tier: usize,
}

#[inline]
fn best_tier(tiers: u8) -> usize {
    tiers.trailing_zeros() as usize
}

/// Credits `pending` more blocks to every live run, in the tier of its last node.
#[inline]
fn flush(runs: &mut [Run], live: &[u32], pending: &mut u32) {
    if *pending > 0 {
        for &i in live {
            let run = &mut runs[i as usize];
            run.by_tier[run.tier] += *pending;
        }
        *pending = 0;
    }
}

/// `a == b` for owner lists, without a call to `memcmp` for the short lists most nodes have.
#[inline(always)]
fn same_owners(a: &[u32], b: &[u32]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if a.len() <= 4 {
        return a.iter().zip(b).all(|(x, y)| x == y);
    }
    a == b
}

impl RadixIndex {
    /// Matches a prompt given as local block hashes (`tokens_hash` of each full block).
    ///
    /// Walks the query's path once and stops as soon as no worker remains on it; a miss on the
    /// first block costs one hash lookup.
    pub fn find_matches(&self, local_hashes: &[LocalBlockHash]) -> OverlapScores {
        let query_blocks = u32::try_from(local_hashes.len()).unwrap_or(u32::MAX);
        let Some((&first, rest)) = local_hashes.split_first() else {
            return OverlapScores::default();
        };
        let Some(mut node) = self.tree.child(ROOT, first) else {
            return OverlapScores {
                matches: Vec::new(),
                query_blocks,
            };
        };
        let owners = self.tree.owners(node);
        let mut runs: Vec<Run> = owners
            .iter()
            .map(|&e| {
                let tier = best_tier(owner_tiers(e));
                let mut by_tier = [0; 3];
                by_tier[tier] = 1;
                Run {
                    slot: owner_slot(e),
                    by_tier,
                    tier,
                }
            })
            .collect();
        // A run of nodes with identical owner lists (a prefix shared by the same workers in the
        // same tiers) is counted once at its end: one slice compare per node instead of a merge.
        let mut prev: &[u32] = owners;
        let mut pending = 0u32;
        // Indices into `runs` of workers still on the path, in slot order (as owners are).
        let mut live: Vec<u32> = (0..runs.len() as u32).collect();
        for &h in rest {
            let Some(child) = self.tree.child(node, h) else {
                break;
            };
            node = child;
            let owners = self.tree.owners(node);
            if same_owners(owners, prev) {
                pending += 1;
                continue;
            }
            flush(&mut runs, &live, &mut pending);
            prev = owners;
            let mut kept = 0;
            if live.len() * 16 < owners.len() {
                // Few workers left on a crowded node: look each one up.
                for i in 0..live.len() {
                    let run = &mut runs[live[i] as usize];
                    if let Ok(k) = owners.binary_search_by_key(&run.slot, |&e| owner_slot(e)) {
                        run.tier = best_tier(owner_tiers(owners[k]));
                        run.by_tier[run.tier] += 1;
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
                        run.tier = best_tier(owner_tiers(owners[k]));
                        run.by_tier[run.tier] += 1;
                        live[kept] = live[i];
                        kept += 1;
                        k += 1;
                    }
                }
            }
            live.truncate(kept);
            if live.is_empty() {
                break;
            }
        }
        flush(&mut runs, &live, &mut pending);
        let row = |r: &Run| {
            let s = self.workers.get(r.slot).expect("owner slot in use");
            WorkerMatch {
                worker_id: s.worker_id,
                dp_rank: s.dp_rank,
                device: r.by_tier[0],
                host: r.by_tier[1],
                disk: r.by_tier[2],
                total_blocks: s.blocks.len() as u64,
            }
        };
        // Sorted by (worker, dp rank): place by rank when many matched, else sort the few.
        let pairs = self.workers.len();
        let matches: Vec<WorkerMatch> = if runs.len() * 8 >= pairs {
            let mut at = vec![u32::MAX; pairs];
            for (i, r) in runs.iter().enumerate() {
                at[self.workers.rank(r.slot) as usize] = i as u32;
            }
            // Sized up front: a filtered iterator's size hint is 0, so `collect` would grow the
            // answer by doubling (about eight reallocations and copies at 1,024 workers).
            let mut rows = Vec::with_capacity(runs.len());
            rows.extend(
                at.iter()
                    .filter(|&&i| i != u32::MAX)
                    .map(|&i| row(&runs[i as usize])),
            );
            rows
        } else {
            runs.sort_unstable_by_key(|r| self.workers.rank(r.slot));
            runs.iter().map(row).collect()
        };
        OverlapScores {
            matches,
            query_blocks,
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
