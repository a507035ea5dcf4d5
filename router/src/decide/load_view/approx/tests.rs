use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;
use crate::testing::card;

fn rank(w: u64) -> WorkerRank {
    WorkerRank::new(w, 0)
}

/// A prompt of `len` blocks whose first `shared` blocks are the common prefix 0, 1, 2, …
fn prompt(shared: u64, len: u64, tail: u64) -> PromptPrefixes {
    let hashes: Vec<u64> = (0..len)
        .map(|i| if i < shared { i } else { tail * 1_000_000 + i })
        .collect();
    PromptPrefixes::of(&hashes)
}

fn without_events(worker_id: u64, total_kv_blocks: u64) -> WorkerCard {
    WorkerCard {
        kv_events: false,
        total_kv_blocks,
        ..card(worker_id)
    }
}

/// Workers 1 and 2 without events (`capacity` blocks each), worker 3 with them.
fn cache(ttl_ms: u64, capacity: u64) -> ApproxCache {
    let mut c = ApproxCache::new(ttl_ms);
    let cards = [
        without_events(1, capacity),
        without_events(2, capacity),
        card(3),
    ];
    c.set_workers(&cards);
    c
}

#[test]
fn a_decided_prompt_is_predicted_on_its_rank_only() {
    let mut c = cache(120_000, 10_000);
    assert!(c.is_enabled());
    assert!(c.tracks(rank(1)) && c.tracks(rank(2)) && !c.tracks(rank(3)));
    c.record(rank(1), &prompt(100, 100, 1), 1_000, 1_000);
    // A worker with events is not predicted here (its index says what it holds).
    c.record(rank(3), &prompt(100, 100, 1), 1_000, 1_000);
    assert_eq!(c.matches(&prompt(100, 100, 1), 2_000), [(rank(1), 100)]);
    // A longer prompt sharing it, or one sharing 50 blocks: the deepest scheduled depth of
    // the shared part (≥ 80 % of it).
    assert_eq!(c.matches(&prompt(100, 150, 2), 2_000), [(rank(1), 91)]);
    assert_eq!(c.matches(&prompt(50, 80, 3), 2_000), [(rank(1), 45)]);
    assert!(c.matches(&prompt(0, 80, 4), 2_000).is_empty());
    // Its blocks are counted once per distinct prefix.
    assert_eq!(c.used_blocks(rank(1)), Some(100));
    assert_eq!((c.ranks(), c.total_blocks()), (2, 100));
    c.record(rank(1), &prompt(100, 150, 2), 1_500, 1_500);
    assert_eq!(c.used_blocks(rank(1)), Some(100 + 150 - 91));
    assert_eq!(c.used_blocks(rank(3)), None);
}

#[test]
fn a_prefix_goes_a_ttl_after_it_was_last_decided() {
    let mut c = cache(10_000, 10_000);
    c.record(rank(1), &prompt(64, 64, 1), 0, 0);
    c.record(rank(2), &prompt(64, 64, 1), 5_000, 5_000);
    assert_eq!(
        c.matches(&prompt(64, 64, 1), 9_999),
        [(rank(1), 64), (rank(2), 64)]
    );
    assert_eq!(c.matches(&prompt(64, 64, 1), 10_000), [(rank(2), 64)]);
    // Decided again: kept from then on.
    c.record(rank(2), &prompt(64, 64, 1), 12_000, 12_000);
    assert_eq!(c.matches(&prompt(64, 64, 1), 21_000), [(rank(2), 64)]);
    // A decision that arrives past its TTL credits nothing.
    c.record(rank(1), &prompt(0, 8, 9), 1_000, 11_000);
    assert!(c.matches(&prompt(0, 8, 9), 11_000).is_empty());
    c.expire(22_000);
    assert_eq!((c.entries(rank(1)), c.used_blocks(rank(1))), (0, Some(0)));
    assert_eq!(c.matches(&prompt(64, 64, 1), 22_000), []);
    assert_eq!(c.used_blocks(rank(2)), Some(0));
}

#[test]
fn the_least_recently_decided_prefixes_go_first_within_the_capacity() {
    let mut c = cache(120_000, 300);
    c.record(rank(1), &prompt(128, 128, 1), 1, 1);
    c.record(rank(1), &prompt(0, 128, 2), 2, 2);
    // The first is decided again: the second is now the oldest.
    c.record(rank(1), &prompt(128, 128, 1), 3, 3);
    c.record(rank(1), &prompt(0, 128, 3), 4, 4);
    assert!(c.used_blocks(rank(1)).unwrap() <= 300);
    assert_eq!(c.matches(&prompt(128, 128, 1), 5), [(rank(1), 128)]);
    assert_eq!(c.matches(&prompt(0, 128, 3), 5), [(rank(1), 128)]);
    // The second lost its deepest blocks first: what is left is a prefix of it.
    let left = c.matches(&prompt(0, 128, 2), 5);
    assert!(left.iter().all(|&(_, d)| d < 128), "{left:?}");
    assert_eq!(
        c.used_blocks(rank(1)),
        Some(128 + 128 + left.first().map_or(0, |m| u64::from(m.1)))
    );
    // Rank 2 is untouched; a prompt larger than the cache keeps its leading blocks only.
    c.record(rank(2), &prompt(0, 1_000, 4), 5, 5);
    let m = c.matches(&prompt(0, 1_000, 4), 6);
    assert_eq!(m.len(), 1);
    assert!(m[0].1 <= 300 && m[0].1 >= 200, "{m:?}");
    assert!(c.used_blocks(rank(2)).unwrap() <= 300);
}

#[test]
fn cards_decide_which_ranks_are_predicted_and_their_capacity() {
    let mut c = cache(120_000, 1_000);
    c.record(rank(1), &prompt(500, 500, 1), 1, 1);
    c.record(rank(2), &prompt(500, 500, 1), 1, 1);
    // Worker 1 shrinks, worker 2 now publishes events, worker 4 (two ranks) joins.
    let wide = WorkerCard {
        dp_start_rank: 2,
        dp_size: 2,
        ..without_events(4, 50)
    };
    c.set_workers(&[without_events(1, 200), card(2), wide]);
    assert!(c.used_blocks(rank(1)).unwrap() <= 200);
    assert!(c.used_blocks(rank(1)).unwrap() > 0);
    assert!(!c.tracks(rank(2)));
    assert!(c.tracks(WorkerRank::new(4, 2)) && c.tracks(WorkerRank::new(4, 3)));
    assert!(!c.tracks(WorkerRank::new(4, 0)));
    c.remove_worker(4);
    assert!(!c.tracks(WorkerRank::new(4, 2)));
    // TTL 0: approximate mode off.
    let mut off = ApproxCache::new(0);
    off.set_workers(&[without_events(1, 100)]);
    assert!(!off.is_enabled());
}

/// Seeded decisions over a few prefix families: after each, the blocks held stay within the
/// capacity and equal the entries' sum, and the last decided prompt is held whole when it
/// fits.
#[test]
fn seeded_decisions_stay_within_the_capacity_and_keep_the_latest_prompt() {
    for seed in 0..20u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let capacity = rng.random_range(50..2_000);
        let mut c = cache(60_000, capacity);
        let mut now = 0u64;
        for _ in 0..300 {
            now += rng.random_range(0..500);
            let len = rng.random_range(1..600);
            let p = prompt(rng.random_range(0..=len), len, rng.random_range(0..20));
            let r = rank(rng.random_range(1..=2));
            c.record(r, &p, now, now);
            let cache = &c.ranks[&r];
            assert!(cache.used <= capacity, "seed {seed}");
            let sum: u64 = cache.entries.values().map(|e| u64::from(e.blocks)).sum();
            assert_eq!(sum, cache.used, "seed {seed}");
            assert_eq!(cache.entries.len(), cache.lru.len(), "seed {seed}");
            let held = c
                .matches(&p, now)
                .into_iter()
                .find(|&(m, _)| m == r)
                .map_or(0, |(_, d)| u64::from(d));
            if len <= capacity {
                assert_eq!(held, len, "seed {seed}: the latest prompt fits");
            } else {
                assert!(held <= capacity, "seed {seed}");
            }
        }
    }
}

/// Two replicas apply the same decisions in different orders (each its own at once, the
/// other's later): while the caches have room, they predict the same overlaps.
#[test]
fn replicas_applying_the_same_decisions_in_another_order_agree() {
    let mut rng = StdRng::seed_from_u64(7);
    let decisions: Vec<(WorkerRank, PromptPrefixes, u64)> = (0..200u64)
        .map(|i| {
            let len = rng.random_range(1..300);
            let p = prompt(rng.random_range(0..=len), len, rng.random_range(0..10));
            (rank(rng.random_range(1..=2)), p, i * 10)
        })
        .collect();
    let mut a = cache(120_000, 1 << 20);
    let mut b = cache(120_000, 1 << 20);
    let mut order: Vec<usize> = (0..decisions.len()).collect();
    for (r, p, ts) in &decisions {
        a.record(*r, p, *ts, *ts);
    }
    order.shuffle(&mut rng);
    for &i in &order {
        let (r, p, ts) = &decisions[i];
        b.record(*r, p, *ts, 2_000);
    }
    for (_, p, _) in &decisions {
        assert_eq!(a.matches(p, 2_000), b.matches(p, 2_000));
    }
    assert_eq!(a.used_blocks(rank(1)), b.used_blocks(rank(1)));
}

/// One step of the differential test.
#[derive(Debug, Clone)]
enum Op {
    /// A prompt of `len` blocks sharing `shared` with family `family`'s, on worker `worker`.
    Record {
        worker: u64,
        family: u64,
        shared: u64,
        len: u64,
        tail: u64,
        decided_ms: u64,
    },
    Expire,
    /// Worker 1's card now says `capacity` blocks.
    Resize {
        capacity: u64,
    },
    Advance {
        ms: u64,
    },
}

/// The naive model: every rank's prefixes in a list, the oldest found by a scan.
#[derive(Debug)]
struct Naive {
    ttl_ms: u64,
    ranks: std::collections::BTreeMap<WorkerRank, (u64, Vec<(u64, Entry)>)>,
}

impl Naive {
    fn alive(&self, e: &Entry, now_ms: u64) -> bool {
        e.last_ms + self.ttl_ms > now_ms
    }

    fn record(&mut self, rank: WorkerRank, p: &PromptPrefixes, decided_ms: u64, now_ms: u64) {
        if decided_ms + self.ttl_ms <= now_ms {
            return;
        }
        let Some((capacity, entries)) = self.ranks.get_mut(&rank) else {
            return;
        };
        let mut shallower = 0;
        for &(depth, chain) in p.depths() {
            match entries.iter_mut().find(|(c, _)| *c == chain) {
                Some((_, e)) => e.last_ms = e.last_ms.max(decided_ms),
                None => entries.push((
                    chain,
                    Entry {
                        depth,
                        blocks: depth - shallower,
                        last_ms: decided_ms,
                    },
                )),
            }
            shallower = depth;
        }
        evict(entries, *capacity);
    }

    fn matches(&self, p: &PromptPrefixes, now_ms: u64) -> Vec<(WorkerRank, u32)> {
        let mut out = Vec::new();
        for (rank, (_, entries)) in &self.ranks {
            let mut found = 0;
            for &(depth, chain) in p.depths() {
                match entries.iter().find(|(c, _)| *c == chain) {
                    Some((_, e)) if self.alive(e, now_ms) => found = depth,
                    _ => break,
                }
            }
            if found > 0 {
                out.push((*rank, found));
            }
        }
        out
    }
}

fn evict(entries: &mut Vec<(u64, Entry)>, capacity: u64) {
    while entries
        .iter()
        .map(|(_, e)| u64::from(e.blocks))
        .sum::<u64>()
        > capacity
    {
        let oldest = (0..entries.len())
            .min_by_key(|&i| entries[i].1.key(entries[i].0))
            .expect("over capacity means non-empty");
        entries.remove(oldest);
    }
}

fn family_prompt(family: u64, shared: u64, len: u64, tail: u64) -> PromptPrefixes {
    let hashes: Vec<u64> = (0..len)
        .map(|i| {
            if i < shared {
                family * 1_000_000 + i
            } else {
                (family * 100 + tail) * 1_000_000 + i
            }
        })
        .collect();
    PromptPrefixes::of(&hashes)
}

/// Runs `ops` on both; the first step at which they differ, if any.
fn diverges(ops: &[Op]) -> Option<usize> {
    let ttl_ms = 5_000;
    let mut real = ApproxCache::new(ttl_ms);
    let mut naive = Naive {
        ttl_ms,
        ranks: Default::default(),
    };
    let mut capacity = 200;
    let set = |real: &mut ApproxCache, naive: &mut Naive, capacity: u64| {
        let cards = [without_events(1, capacity), without_events(2, 150), card(3)];
        real.set_workers(&cards);
        for (rank, cap) in [(rank(1), capacity), (rank(2), 150)] {
            let (c, entries) = naive.ranks.entry(rank).or_insert((cap, Vec::new()));
            *c = cap;
            evict(entries, cap);
        }
    };
    set(&mut real, &mut naive, capacity);
    let mut now = 0u64;
    let probes: Vec<PromptPrefixes> = (0..4)
        .flat_map(|f| [family_prompt(f, 300, 300, 0), family_prompt(f, 40, 90, 9)])
        .collect();
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Record {
                worker,
                family,
                shared,
                len,
                tail,
                decided_ms,
            } => {
                let p = family_prompt(family, shared, len, tail);
                real.record(rank(worker), &p, decided_ms, now);
                naive.record(rank(worker), &p, decided_ms, now);
            }
            Op::Expire => {
                real.expire(now);
                for (_, entries) in naive.ranks.values_mut() {
                    entries.retain(|(_, e)| e.last_ms + ttl_ms > now);
                }
            }
            Op::Resize { capacity: c } => {
                capacity = c;
                set(&mut real, &mut naive, capacity);
            }
            Op::Advance { ms } => now += ms,
        }
        for r in [rank(1), rank(2)] {
            let naive_used: u64 = naive.ranks[&r]
                .1
                .iter()
                .map(|(_, e)| u64::from(e.blocks))
                .sum();
            let real_used = real.used_blocks(r).unwrap();
            // Expiry is lazy in the real cache (`expire` drops what a read already ignores):
            // compare what is held only after an expiry, and what matches always.
            if matches!(op, Op::Expire) && real_used != naive_used {
                return Some(step);
            }
        }
        if probes
            .iter()
            .any(|p| real.matches(p, now) != naive.matches(p, now))
        {
            return Some(step);
        }
    }
    None
}

/// The shortest failing prefix of `ops`, then without each op that is not needed.
fn shrink(mut ops: Vec<Op>) -> Vec<Op> {
    if let Some(step) = diverges(&ops) {
        ops.truncate(step + 1);
    }
    let mut i = 0;
    while i < ops.len() {
        let mut fewer = ops.clone();
        fewer.remove(i);
        if diverges(&fewer).is_some() {
            ops = fewer;
        } else {
            i += 1;
        }
    }
    ops
}

/// Seeded operations against the naive model; a failure prints a minimal list of them.
#[test]
fn the_cache_matches_a_naive_model_on_seeded_operations() {
    for seed in 0..200u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut now = 0u64;
        let ops: Vec<Op> = (0..150)
            .map(|_| match rng.random_range(0..10) {
                0 => Op::Expire,
                1 => Op::Resize {
                    capacity: rng.random_range(20..400),
                },
                2 | 3 => {
                    let ms = rng.random_range(0..3_000);
                    now += ms;
                    Op::Advance { ms }
                }
                _ => {
                    let len = rng.random_range(1..300);
                    Op::Record {
                        worker: rng.random_range(1..=3),
                        family: rng.random_range(0..4),
                        shared: rng.random_range(0..=len),
                        len,
                        tail: rng.random_range(0..5),
                        // Decisions arrive late and out of order, by up to 6 s.
                        decided_ms: now.saturating_sub(rng.random_range(0..6_000)),
                    }
                }
            })
            .collect();
        if diverges(&ops).is_some() {
            panic!("seed {seed}: diverges after {:#?}", shrink(ops));
        }
    }
}
