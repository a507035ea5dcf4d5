use std::collections::{BTreeSet, HashMap};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const BS: usize = 4;

fn id(n: u128) -> RequestId {
    RequestId::from_u128(n)
}

fn hashes(tokens: &[u32]) -> BlockHashes {
    BlockHashes::of_tokens(tokens, BS, None)
}

fn cache(num_blocks: u64) -> KvCache {
    KvCache::new(CacheConfig {
        num_blocks,
        block_size: BS as u32,
    })
}

/// The indexer's view of one worker, as simple as it gets.
#[derive(Default)]
struct NaiveWorker {
    held: HashMap<SequenceHash, Option<SequenceHash>>,
}

impl NaiveWorker {
    fn apply(&mut self, event: &KvEventData) {
        match event {
            KvEventData::Stored {
                parent_hash,
                blocks,
                tier,
            } => {
                assert_eq!(*tier, StorageTier::Device);
                assert!(!blocks.is_empty(), "empty Stored event");
                let mut parent = *parent_hash;
                if let Some(p) = parent {
                    assert!(
                        self.held.contains_key(&p),
                        "Stored under unknown parent {p:#x}"
                    );
                }
                for b in blocks {
                    let old = self.held.insert(b.block_hash, parent);
                    assert!(old.is_none(), "block {:#x} stored twice", b.block_hash);
                    parent = Some(b.block_hash);
                }
            }
            KvEventData::Removed { block_hashes, tier } => {
                assert_eq!(*tier, StorageTier::Device);
                for h in block_hashes {
                    assert!(
                        self.held.remove(h).is_some(),
                        "removed unknown block {h:#x}"
                    );
                    assert!(
                        !self.held.values().any(|p| *p == Some(*h)),
                        "removed {h:#x} while a child is held"
                    );
                }
            }
            KvEventData::Cleared => self.held.clear(),
        }
    }

    fn set(&self) -> BTreeSet<SequenceHash> {
        self.held.keys().copied().collect()
    }
}

#[test]
fn reuses_a_held_prefix() {
    let mut c = cache(16);
    let a: Vec<u32> = (0..12).collect();
    let mut b = a[..8].to_vec();
    b.extend([100, 101, 102, 103]);
    let first = c.admit(id(1), &hashes(&a), 1).unwrap();
    assert_eq!((first.cached_blocks, first.new_blocks), (0, 3));
    // While `a` runs, its blocks are shared too.
    let second = c.admit(id(2), &hashes(&b), 0).unwrap();
    assert_eq!((second.cached_blocks, second.new_blocks), (2, 1));
    assert_eq!(c.used_blocks(), 5);
    assert!(c.release(id(1)));
    assert!(c.release(id(2)));
    assert!(!c.release(id(2)));
    assert_eq!(
        c.used_blocks(),
        4,
        "released blocks stay cached, private ones go"
    );
    assert_eq!(c.evictable_blocks(), 4);
    let third = c.admit(id(3), &hashes(&a), 0).unwrap();
    assert_eq!((third.cached_blocks, third.new_blocks), (3, 0));
    let events = c.drain_events();
    assert_eq!(events.len(), 2, "nothing stored for a full hit: {events:?}");
}

#[test]
fn evicts_least_recently_used_unpinned_blocks_children_first() {
    let mut c = cache(4);
    let a: Vec<u32> = (0..8).collect(); // 2 blocks
    let b: Vec<u32> = (10..18).collect(); // 2 blocks
    let ha = hashes(&a);
    let hb = hashes(&b);
    c.admit(id(1), &ha, 0).unwrap();
    c.release(id(1));
    c.admit(id(2), &hb, 0).unwrap();
    c.release(id(2));
    c.drain_events();
    // `a` is older: its tail goes first, then its head.
    let d: Vec<u32> = (20..24).collect();
    c.admit(id(3), &hashes(&d), 0).unwrap();
    let ev = c.drain_events();
    assert_eq!(
        ev[0],
        KvEventData::Removed {
            block_hashes: vec![ha.sequence[1]],
            tier: StorageTier::Device
        }
    );
    // Touch `a`'s head: now `b` is the oldest.
    c.admit(id(4), &hashes(&a[..4]), 0).unwrap();
    c.release(id(4));
    c.drain_events();
    c.admit(id(5), &hashes(&(30..38).collect::<Vec<_>>()), 0)
        .unwrap();
    let ev = c.drain_events();
    assert_eq!(
        ev[0],
        KvEventData::Removed {
            block_hashes: vec![hb.sequence[1], hb.sequence[0]],
            tier: StorageTier::Device
        }
    );
}

#[test]
fn pinned_blocks_are_never_evicted() {
    let mut c = cache(4);
    c.admit(id(1), &hashes(&(0..12).collect::<Vec<_>>()), 0)
        .unwrap();
    let err = c
        .admit(id(2), &hashes(&(50..58).collect::<Vec<_>>()), 0)
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::Full {
            request_id: id(2),
            needed: 2,
            available: 1
        }
    );
    let err = c.admit(id(3), &hashes(&[0; 16]), 1).unwrap_err();
    assert!(
        matches!(err, CacheError::TooLarge { needed: 5, .. }),
        "{err}"
    );
    assert!(matches!(
        c.admit(id(1), &hashes(&[]), 0),
        Err(CacheError::AlreadyAdmitted { .. })
    ));
    assert_eq!(
        c.drain_events().len(),
        1,
        "failed admissions change nothing"
    );
}

/// A long random workload with shared prefixes, evictions and concurrent requests: the events
/// must describe the cache exactly, and so must a snapshot.
#[test]
fn the_event_stream_equals_the_cache_contents() {
    for seed in 0..8 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut c = cache(48);
        let mut model = NaiveWorker::default();
        let prefixes: Vec<Vec<u32>> = (0..6)
            .map(|p| (0..rng.random_range(0..20)).map(|t| p * 1000 + t).collect())
            .collect();
        let mut running: Vec<RequestId> = Vec::new();
        let (mut admitted, mut removed) = (0, 0);
        for n in 0..3000u128 {
            if !running.is_empty() && (rng.random_bool(0.4) || running.len() > 6) {
                let i = rng.random_range(0..running.len());
                assert!(c.release(running.swap_remove(i)));
            }
            let mut tokens = prefixes[rng.random_range(0..prefixes.len())].clone();
            let extra = rng.random_range(0..16);
            tokens.extend((0..extra).map(|_| rng.random_range(0..3u32)));
            let private = rng.random_range(0..3);
            match c.admit(id(n), &hashes(&tokens), private) {
                Ok(_) => {
                    running.push(id(n));
                    admitted += 1;
                }
                Err(CacheError::Full { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            for e in c.drain_events() {
                removed += usize::from(matches!(e, KvEventData::Removed { .. }));
                model.apply(&e);
            }
            assert_eq!(model.set(), c.held_blocks(), "seed {seed}, request {n}");
            assert!(c.used_blocks() <= 48);
        }
        assert!(admitted > 1000, "seed {seed}: only {admitted} admitted");
        assert!(removed > 100, "seed {seed}: only {removed} evictions");

        let mut fresh = NaiveWorker::default();
        fresh.apply(&KvEventData::Cleared);
        for e in c.snapshot_events() {
            fresh.apply(&e);
        }
        assert_eq!(fresh.set(), c.held_blocks(), "seed {seed}: snapshot");
        assert_eq!(fresh.held, model.held, "seed {seed}: snapshot parents");
    }
}

#[test]
fn snapshot_chains_are_maximal() {
    let mut c = cache(16);
    let a: Vec<u32> = (0..16).collect();
    let mut b = a[..8].to_vec();
    b.extend(200..208);
    c.admit(id(1), &hashes(&a), 0).unwrap();
    c.admit(id(2), &hashes(&b), 0).unwrap();
    let snap = c.snapshot_events();
    // One chain for the shared head, one for each branch.
    assert_eq!(snap.len(), 3, "{snap:?}");
    let lens: Vec<usize> = snap
        .iter()
        .map(|e| match e {
            KvEventData::Stored { blocks, .. } => blocks.len(),
            _ => panic!("{e:?}"),
        })
        .collect();
    assert_eq!(lens.iter().sum::<usize>(), 6);
    assert_eq!(lens[0], 2);
}
