//! Predicted overlap: between a decision and its worker's KV events there is a blind window
//! (the engine has not even started the prefill), in which the second request of a burst
//! sharing a prefix would not see that the first one's worker is about to hold it. Each
//! decision's prompt is recorded as predicted for its rank for a short TTL; a later prompt
//! sharing its prefix sees it as device overlap on that rank (the larger of the index's and
//! the prediction's), until the TTL ends — by then the worker's own events say what it holds.
//! Every replica records every decision it applies, its own and the others', so replicas share
//! predictions: a decision carries its prompt's [`prefix_hashes`].
//!
//! Prefixes are keyed by a chain hash over the prompt's local block hashes, taken at a fixed
//! geometric schedule of depths (`round(2^(k/4))`: 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, …)
//! plus the prompt's full length — 32 hashes for 512 blocks, 48 for 8,192 — so recording and
//! matching cost a few dozen map operations however long the prompt, and a decision grows by a
//! few hundred bytes. A shared prefix of length L is seen as the deepest scheduled depth ≤ L
//! (at least 80 % of L), or exactly L when the earlier prompt is all of it (its full length
//! is recorded). Pure: time comes in as `now_ms`.

use std::collections::{HashMap, VecDeque};
use std::sync::LazyLock;

use kvroute_common::hashing::LocalBlockHash;

use crate::signals::Overlap;
use crate::worker::WorkerRank;

/// Chain hashes remembered at most (the oldest go first beyond it).
const MAX_ENTRIES: usize = 1 << 20;

/// The depths at which prefixes are recorded, ascending (the full length is added per
/// prompt): `round(2^(k/4))` without repeats, up to 2^40 blocks, computed once.
static SCHEDULE: LazyLock<Vec<usize>> = LazyLock::new(|| {
    let mut depths: Vec<usize> = Vec::new();
    for k in 0..=160u32 {
        let depth = 2f64.powf(f64::from(k) / 4.0).round() as usize;
        if depths.last().is_none_or(|&last| depth > last) {
            depths.push(depth);
        }
    }
    depths
});

#[cfg(test)]
fn schedule() -> impl Iterator<Item = usize> {
    SCHEDULE.iter().copied()
}

fn mix(chain: u64, block: LocalBlockHash) -> u64 {
    let x = (chain ^ block.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 31)
}

/// A prompt's chain hashes at the scheduled depths up to its length and at its full length,
/// in depth order: computed once per decision, for matching and for the decision's
/// `prefix_hashes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptPrefixes(Vec<(u32, u64)>);

impl PromptPrefixes {
    pub fn of(hashes: &[LocalBlockHash]) -> Self {
        let mut out = Vec::new();
        let mut depths = SCHEDULE.iter().copied().peekable();
        let mut chain = 0x6B76_726F_7574_6521u64;
        for (i, &h) in hashes.iter().enumerate() {
            chain = mix(chain, h);
            let depth = i + 1;
            while depths.peek().is_some_and(|&d| d < depth) {
                depths.next();
            }
            if depths.peek() == Some(&depth) || depth == hashes.len() {
                out.push((u32::try_from(depth).unwrap_or(u32::MAX), chain));
            }
        }
        Self(out)
    }

    /// The chain hashes alone, as a decision carries them.
    pub fn hashes(&self) -> Vec<u64> {
        self.0.iter().map(|&(_, chain)| chain).collect()
    }

    /// A decision's `prefix_hashes` with their depths, which follow from the prompt's length
    /// in blocks (`request_blocks`); `None` when the count does not fit that length.
    pub fn of_decision(prefix_hashes: &[u64], request_blocks: u32) -> Option<Self> {
        let n = request_blocks as usize;
        let mut depths: Vec<u32> = SCHEDULE
            .iter()
            .take_while(|&&d| d < n)
            .map(|&d| d as u32)
            .collect();
        if n > 0 {
            depths.push(request_blocks);
        }
        (depths.len() == prefix_hashes.len()).then(|| {
            Self(
                depths
                    .into_iter()
                    .zip(prefix_hashes.iter().copied())
                    .collect(),
            )
        })
    }

    /// (depth in blocks, chain hash) pairs, in depth order.
    pub fn depths(&self) -> &[(u32, u64)] {
        &self.0
    }
}

/// The chain hashes a decision carries for the prompt `hashes`.
#[cfg(test)]
fn prefix_hashes(hashes: &[LocalBlockHash]) -> Vec<u64> {
    PromptPrefixes::of(hashes).hashes()
}

/// Predicted prefixes per rank, with their expiry.
#[derive(Debug)]
pub struct PredictedOverlap {
    ttl_ms: u64,
    /// Chain hash → the ranks predicted to hold that prefix, each until its expiry.
    entries: HashMap<u64, Vec<(WorkerRank, u64)>>,
    /// (expiry, chain hash) in recording order, for expiry and the size cap.
    order: VecDeque<(u64, u64)>,
}

impl PredictedOverlap {
    /// `ttl_ms` 0 turns predictions off.
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            ttl_ms,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.ttl_ms > 0
    }

    /// Chain hashes held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records that `rank` will hold the prompt whose [`prefix_hashes`] are `prefixes`,
    /// decided at `decided_ms`.
    pub fn record(&mut self, rank: WorkerRank, prefixes: &[u64], decided_ms: u64, now_ms: u64) {
        if !self.is_enabled() || prefixes.is_empty() {
            return;
        }
        let expires = decided_ms.saturating_add(self.ttl_ms);
        if expires <= now_ms {
            return;
        }
        self.expire(now_ms);
        for &chain in prefixes {
            let ranks = self.entries.entry(chain).or_default();
            match ranks.iter_mut().find(|(r, _)| *r == rank) {
                Some((_, until)) => *until = (*until).max(expires),
                None => ranks.push((rank, expires)),
            }
            self.order.push_back((expires, chain));
        }
        while self.entries.len() > MAX_ENTRIES {
            match self.order.pop_front() {
                Some((_, chain)) => {
                    self.entries.remove(&chain);
                }
                None => break,
            }
        }
    }

    /// Drops every rank's predictions of departed worker `worker_id`.
    pub fn remove_worker(&mut self, worker_id: kvroute_common::WorkerId) {
        self.entries.retain(|_, ranks| {
            ranks.retain(|(r, _)| r.worker_id != worker_id);
            !ranks.is_empty()
        });
    }

    /// Drops what expired by `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(expires, chain)) = self.order.front() {
            if expires > now_ms {
                break;
            }
            self.order.pop_front();
            if let Some(ranks) = self.entries.get_mut(&chain) {
                ranks.retain(|(_, until)| *until > now_ms);
                if ranks.is_empty() {
                    self.entries.remove(&chain);
                }
            }
        }
    }

    /// The predicted leading blocks of the prompt per rank, at `now_ms` (ranks with none are
    /// left out).
    pub fn matches(&self, prompt: &PromptPrefixes, now_ms: u64) -> Vec<(WorkerRank, u32)> {
        let mut found: Vec<(WorkerRank, u32)> = Vec::new();
        if self.entries.is_empty() {
            return found;
        }
        for &(depth, chain) in &prompt.0 {
            let Some(ranks) = self.entries.get(&chain) else {
                break;
            };
            let mut any = false;
            for &(rank, until) in ranks {
                if until <= now_ms {
                    continue;
                }
                any = true;
                match found.iter_mut().find(|(r, _)| *r == rank) {
                    Some((_, d)) => *d = depth,
                    None => found.push((rank, depth)),
                }
            }
            if !any {
                break;
            }
        }
        found
    }
}

/// `overlap` (the index's) with `predicted` leading blocks on the device: the device tier
/// grows to the prediction, and the host and disk tiers keep only what lies beyond it.
pub fn with_predicted(overlap: Overlap, predicted: u32) -> Overlap {
    if predicted <= overlap.device {
        return overlap;
    }
    let host_end = overlap.device + overlap.host;
    let disk_end = host_end + overlap.disk;
    let host_from = host_end.max(predicted);
    Overlap {
        device: predicted,
        host: host_end.saturating_sub(predicted),
        disk: disk_end.saturating_sub(host_from),
        shared: overlap.shared,
        cached_blocks: overlap.cached_blocks.max(u64::from(predicted)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(w: u64) -> WorkerRank {
        WorkerRank::new(w, 0)
    }

    fn prompt(shared: u64, len: u64, tail: u64) -> Vec<u64> {
        (0..len)
            .map(|i| if i < shared { i } else { tail * 1_000_000 + i })
            .collect()
    }

    #[test]
    fn a_decision_carries_a_few_dozen_prefix_hashes() {
        assert_eq!(prefix_hashes(&prompt(512, 512, 1)).len(), 32);
        assert_eq!(prefix_hashes(&prompt(8192, 8192, 1)).len(), 48);
        assert_eq!(prefix_hashes(&prompt(500, 500, 1)).len(), 32);
        assert_eq!(prefix_hashes(&prompt(9, 9, 1)).len(), 9);
        assert!(prefix_hashes(&[]).is_empty());
    }

    #[test]
    fn a_decision_s_prefix_hashes_get_their_depths_back() {
        for len in [1u64, 2, 8, 9, 16, 100, 512, 513] {
            let p = PromptPrefixes::of(&prompt(len, len, 1));
            let back = PromptPrefixes::of_decision(&p.hashes(), len as u32);
            assert_eq!(back.as_ref(), Some(&p), "{len}");
        }
        let p = PromptPrefixes::of(&prompt(100, 100, 1));
        assert_eq!(PromptPrefixes::of_decision(&p.hashes(), 200), None);
        assert_eq!(PromptPrefixes::of_decision(&p.hashes(), 0), None);
        assert_eq!(
            PromptPrefixes::of_decision(&[], 0),
            Some(PromptPrefixes::default())
        );
    }

    #[test]
    fn the_schedule_is_geometric_and_dense_at_the_start() {
        let depths: Vec<usize> = schedule().take_while(|&d| d <= 64).collect();
        assert_eq!(
            depths,
            [
                1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 23, 27, 32, 38, 45, 54, 64
            ]
        );
        // Consecutive depths at most 25 % apart beyond 4 (22 % beyond 16): a shared prefix is
        // seen as at least 80 % of its length.
        let mut last = 4usize;
        for d in schedule()
            .skip_while(|&d| d <= 4)
            .take_while(|&d| d <= 1 << 20)
        {
            let bound = if last >= 16 { 1.22 } else { 1.25 };
            assert!(d as f64 / last as f64 <= bound, "{last} → {d}");
            last = d;
        }
    }

    #[test]
    fn a_later_prompt_sees_the_shared_prefix_on_the_decided_rank_until_the_ttl() {
        let mut p = PredictedOverlap::new(2_000);
        p.record(rank(1), &prefix_hashes(&prompt(512, 512, 1)), 1_000, 1_000);
        // The same prompt: all of it.
        assert_eq!(
            p.matches(&PromptPrefixes::of(&prompt(512, 512, 1)), 1_500),
            [(rank(1), 512)]
        );
        // A prompt sharing 300 blocks then diverging: the deepest scheduled depth ≤ 300.
        let m = p.matches(&PromptPrefixes::of(&prompt(300, 400, 2)), 1_500);
        assert_eq!(m.len(), 1);
        assert!((256..=300).contains(&m[0].1), "{m:?}");
        // A prompt that is a prefix of the recorded one: the deepest scheduled depth.
        assert_eq!(
            p.matches(&PromptPrefixes::of(&prompt(100, 100, 3)), 1_500),
            [(rank(1), 91)]
        );
        // A prompt extending the recorded one: all of the recorded one.
        assert_eq!(
            p.matches(&PromptPrefixes::of(&prompt(512, 600, 3)), 1_500),
            [(rank(1), 512)]
        );
        // Nothing shared.
        assert!(
            p.matches(&PromptPrefixes::of(&prompt(0, 50, 4)), 1_500)
                .is_empty()
        );
        // Past the TTL: gone, and expiry frees the entries.
        assert!(
            p.matches(&PromptPrefixes::of(&prompt(512, 512, 1)), 3_000)
                .is_empty()
        );
        p.expire(3_000);
        assert!(p.is_empty());
    }

    #[test]
    fn ranks_holding_prefixes_of_different_lengths_each_get_theirs() {
        let mut p = PredictedOverlap::new(5_000);
        p.record(rank(1), &prefix_hashes(&prompt(64, 64, 1)), 0, 0);
        p.record(rank(2), &prefix_hashes(&prompt(200, 200, 2)), 0, 0);
        let mut m = p.matches(&PromptPrefixes::of(&prompt(200, 300, 3)), 10);
        m.sort();
        assert_eq!(m, [(rank(1), 64), (rank(2), 181)]);
        p.remove_worker(2);
        assert_eq!(
            p.matches(&PromptPrefixes::of(&prompt(200, 300, 3)), 10),
            [(rank(1), 64)]
        );
        // Off: records nothing.
        let mut off = PredictedOverlap::new(0);
        off.record(rank(1), &prefix_hashes(&prompt(64, 64, 1)), 0, 0);
        assert!(
            off.matches(&PromptPrefixes::of(&prompt(64, 64, 1)), 0)
                .is_empty()
        );
    }

    #[test]
    fn a_prediction_grows_the_device_tier_and_keeps_the_tiers_disjoint() {
        let index = Overlap {
            device: 10,
            host: 20,
            disk: 10,
            shared: 30,
            cached_blocks: 100,
        };
        assert_eq!(with_predicted(index, 5), index);
        assert_eq!(
            with_predicted(index, 25),
            Overlap {
                device: 25,
                host: 5,
                disk: 10,
                shared: 30,
                cached_blocks: 100
            }
        );
        assert_eq!(
            with_predicted(index, 35),
            Overlap {
                device: 35,
                host: 0,
                disk: 5,
                shared: 30,
                cached_blocks: 100
            }
        );
        assert_eq!(
            with_predicted(Overlap::default(), 7),
            Overlap {
                device: 7,
                host: 0,
                disk: 0,
                shared: 0,
                cached_blocks: 7
            }
        );
    }
}
