//! LoRA adapter placement, run after eligibility for a request that names an adapter: which
//! of the eligible ranks are the adapter's home. The adapter needs about `share · slots`
//! replicas, `share` being its held share of its model's recent adapter requests
//! (`load_view::adapter_demand`) and `slots` the eligible ranks' adapter slots (1 for a rank
//! that reports none); at least 1, at most every rank. Its home is that many ranks, those
//! ranking highest for it by rendezvous hashing (a hash of the adapter's name and the rank):
//! every replica computes the same home without talking, a cold adapter always goes back to
//! the same rank, and a rank leaving or becoming busy moves only the adapters homed on it.
//! The request stays eligible on its adapter's home, on every rank where the adapter is
//! resident (nothing to load there) and on every rank that reports a free slot (loading there
//! evicts nothing: while the fleet's slots hold every adapter asked for, placement changes
//! nothing); the policy chooses among them.
//!
//! Why not the affinity score alone: it prefers a rank with the adapter resident or a free
//! slot, but when hot adapters exceed the fleet's slots every rank is full, and a cold adapter's
//! requests land wherever load is lowest, loading it anew each time. A home keeps the set of
//! adapters each rank sees small, so its LRU slots keep them.

use super::EligibleRank;
use crate::signals::{AdapterAffinity, SignalSource};
use crate::worker::WorkerRank;

/// The ranks of `ranks` that adapter `name` may be sent to (see the module docs); `ranks`
/// unchanged when `signals` gives no share (adapters are not placed).
pub fn adapter_home<'a>(
    name: &str,
    ranks: Vec<EligibleRank<'a>>,
    signals: &dyn SignalSource,
) -> Vec<EligibleRank<'a>> {
    let Some(share) = signals.adapter_share() else {
        return ranks;
    };
    let replicas = replicas(share, ranks.iter().map(|r| signals.adapter_slots(r.worker)));
    if replicas >= ranks.len() {
        return ranks;
    }
    let scores: Vec<u64> = ranks.iter().map(|r| rendezvous(name, r.worker)).collect();
    let mut order = scores.clone();
    let (_, &mut threshold, _) = order.select_nth_unstable_by(replicas - 1, |a, b| b.cmp(a));
    ranks
        .into_iter()
        .zip(scores)
        .filter(|(r, score)| {
            *score >= threshold
                || match signals.adapter(r.worker) {
                    Some(AdapterAffinity::Loaded) => true,
                    // A free slot loads the adapter without evicting another.
                    Some(AdapterAffinity::FreeSlot) => signals.adapter_slots(r.worker).is_some(),
                    _ => false,
                }
        })
        .map(|(r, _)| r)
        .collect()
}

/// Replicas for an adapter with `share` of demand over ranks with `slots` each: ⌈share ·
/// Σ slots⌉, at least 1 (a rank without a reported slot count counts 1).
pub fn replicas(share: f64, slots: impl Iterator<Item = Option<u32>>) -> usize {
    let total: u64 = slots.map(|s| u64::from(s.unwrap_or(1).max(1))).sum();
    let wanted = (share.clamp(0.0, 1.0) * total as f64).ceil();
    (wanted as usize).max(1)
}

/// Rank `rank`'s rendezvous score for adapter `name` (stable across processes and versions:
/// xxh3 of the name, seeded by the rank).
pub fn rendezvous(name: &str, rank: WorkerRank) -> u64 {
    let seed = rank
        .worker_id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(rank.dp_rank));
    xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), seed)
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerCard;

    use super::*;
    use crate::signals::Overlap;

    struct Placed {
        share: Option<f64>,
        slots: u32,
        loaded: Option<WorkerRank>,
        free: Option<WorkerRank>,
    }

    impl SignalSource for Placed {
        fn overlap(&self, _: WorkerRank) -> Overlap {
            Overlap::default()
        }
        fn load(&self, _: WorkerRank) -> Option<crate::signals::ObservedLoad> {
            None
        }
        fn adapter(&self, worker: WorkerRank) -> Option<AdapterAffinity> {
            Some(if Some(worker) == self.loaded {
                AdapterAffinity::Loaded
            } else if Some(worker) == self.free {
                AdapterAffinity::FreeSlot
            } else {
                AdapterAffinity::Full
            })
        }
        fn adapter_share(&self) -> Option<f64> {
            self.share
        }
        fn adapter_slots(&self, _: WorkerRank) -> Option<u32> {
            Some(self.slots)
        }
    }

    fn cards(n: u64) -> Vec<WorkerCard> {
        (1..=n).map(crate::testing::card).collect()
    }

    fn home(name: &str, cards: &[WorkerCard], signals: &Placed) -> Vec<u64> {
        let ranks = cards
            .iter()
            .map(|card| EligibleRank {
                worker: WorkerRank::new(card.worker_id, 0),
                card,
            })
            .collect();
        adapter_home(name, ranks, signals)
            .iter()
            .map(|r| r.worker.worker_id)
            .collect()
    }

    #[test]
    fn replicas_follow_the_share_of_slots() {
        let slots = |n, s| std::iter::repeat_n(Some(s), n);
        assert_eq!(replicas(0.0, slots(8, 4)), 1, "at least one");
        assert_eq!(replicas(0.01, slots(8, 4)), 1);
        assert_eq!(replicas(0.1, slots(8, 4)), 4, "⌈3.2⌉");
        assert_eq!(
            replicas(0.5, slots(8, 4)),
            16,
            "the caller caps at the ranks"
        );
        assert_eq!(
            replicas(0.5, std::iter::repeat_n(None, 8)),
            4,
            "unknown: 1 each"
        );
    }

    #[test]
    fn a_cold_adapter_has_one_home_and_keeps_it() {
        let cards = cards(8);
        let cold = Placed {
            share: Some(0.0),
            slots: 4,
            loaded: None,
            free: None,
        };
        let first = home("sql", &cards, &cold);
        assert_eq!(first.len(), 1);
        assert_eq!(home("sql", &cards, &cold), first, "the same every time");
        // Different adapters spread over the ranks.
        let homes: std::collections::BTreeSet<u64> = (0..64)
            .map(|i| home(&format!("a{i}"), &cards, &cold)[0])
            .collect();
        assert_eq!(homes.len(), 8, "{homes:?}");
        // A rank leaving moves only the adapters homed on it.
        let without: Vec<WorkerCard> = cards
            .iter()
            .filter(|c| c.worker_id != first[0])
            .cloned()
            .collect();
        for i in 0..64 {
            let name = format!("a{i}");
            let before = home(&name, &cards, &cold)[0];
            let after = home(&name, &without, &cold)[0];
            assert!(before == first[0] || after == before, "{name} moved");
        }
    }

    #[test]
    fn a_hot_adapter_spreads_and_resident_ranks_stay_eligible() {
        let cards = cards(8);
        let mut hot = Placed {
            share: Some(0.3),
            slots: 2,
            loaded: None,
            free: None,
        };
        let wide = home("chat", &cards, &hot);
        assert_eq!(wide.len(), 5, "⌈0.3 · 16⌉");
        // The home grows by adding ranks: the cold home is within it.
        hot.share = Some(0.0);
        let narrow = home("chat", &cards, &hot);
        assert!(wide.contains(&narrow[0]));
        // A rank holding the adapter outside its home stays eligible.
        let outside = (1..=8).find(|w| !narrow.contains(w)).unwrap();
        hot.loaded = Some(WorkerRank::new(outside, 0));
        let mut with = home("chat", &cards, &hot);
        with.sort_unstable();
        let mut expected = vec![narrow[0], outside];
        expected.sort_unstable();
        assert_eq!(with, expected);
        // And so does a rank with a free slot.
        let other = (1..=8)
            .find(|w| !narrow.contains(w) && *w != outside)
            .unwrap();
        hot.free = Some(WorkerRank::new(other, 0));
        assert_eq!(home("chat", &cards, &hot).len(), 3);
        hot.free = None;
        // Every rank once the share needs them all; no placement without a share.
        hot.share = Some(1.0);
        assert_eq!(home("chat", &cards, &hot).len(), 8);
        hot.share = None;
        assert_eq!(home("chat", &cards, &hot).len(), 8);
    }
}
