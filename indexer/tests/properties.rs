//! Property tests: the digest ignores history and layout; snapshots round-trip exactly;
//! damaged snapshots are refused.

use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_indexer::{IndexConfig, RadixIndex, SnapshotError};
use proptest::prelude::*;

/// A chain stored from the root by one (worker, rank): tokens per block and a tier.
type Chain = (u64, u32, Vec<u64>, u8);

fn tier(t: u8) -> StorageTier {
    StorageTier::ALL[usize::from(t % 3)]
}

/// The engine's block hash for a tokens path: a pure function of the path and the worker's
/// engine family, so storing chains in any order never rebinds a hash.
fn block_hash(worker: u64, path: &[u64]) -> u64 {
    path.iter().fold(0x1234 + worker % 2, |acc, &t| {
        (acc ^ t)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(23)
    })
}

fn stored(chain: &Chain) -> KvEventData {
    let (w, _, tokens, t) = chain;
    KvEventData::Stored {
        parent_hash: None,
        blocks: (0..tokens.len())
            .map(|i| StoredBlock {
                block_hash: block_hash(*w, &tokens[..=i]),
                tokens_hash: tokens[i],
            })
            .collect(),
        tier: tier(*t),
    }
}

fn build(chains: &[Chain], noise: bool) -> RadixIndex {
    let mut ix = RadixIndex::new(IndexConfig::default());
    for (i, chain) in chains.iter().enumerate() {
        if noise && i % 2 == 0 {
            // Another worker's blocks come and go, so node ids and free lists differ.
            ix.apply(999, 0, &stored(&(999, 0, vec![7, 7, i as u64], 0)))
                .unwrap();
        }
        ix.apply(chain.0, chain.1, &stored(chain)).unwrap();
    }
    ix.remove_worker(999);
    ix
}

fn chains() -> impl Strategy<Value = Vec<Chain>> {
    prop::collection::vec(
        (
            0u64..8,
            0u32..2,
            prop::collection::vec(0u64..4, 1..6),
            0u8..3,
        ),
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn digest_ignores_order_and_layout(
        (original, shuffled) in chains().prop_flat_map(|c| (Just(c.clone()), Just(c).prop_shuffle()))
    ) {
        let a = build(&original, false);
        let b = build(&shuffled, true);
        prop_assert_eq!(a.digest(), b.digest());
        prop_assert_eq!(a.stats().entries, b.stats().entries);
        // And it sees every fact: dropping one block changes it.
        let (w, d, tokens, t) = &original[0];
        let mut c = build(&original, false);
        let gone = KvEventData::Removed {
            block_hashes: vec![block_hash(*w, tokens)],
            tier: tier(*t),
        };
        c.apply(*w, *d, &gone).unwrap();
        prop_assert_ne!(a.digest(), c.digest());
    }

    #[test]
    fn snapshot_round_trips(
        chains in chains(),
        removals in prop::collection::vec((0usize..40, 0usize..6), 0..20),
        cap in prop::option::of(5usize..60),
    ) {
        let mut ix = RadixIndex::new(IndexConfig { max_entries: cap, ..IndexConfig::default() });
        for c in &chains {
            ix.apply(c.0, c.1, &stored(c)).unwrap();
        }
        for &(i, depth) in &removals {
            let (w, d, tokens, t) = &chains[i % chains.len()];
            let depth = depth % tokens.len();
            let ev = KvEventData::Removed {
                block_hashes: vec![block_hash(*w, &tokens[..=depth])],
                tier: tier(*t),
            };
            ix.apply(*w, *d, &ev).unwrap();
        }
        let bytes = ix.snapshot();
        let mut back = RadixIndex::restore(&bytes).unwrap();
        prop_assert_eq!(back.digest(), ix.digest());
        let (s1, s2) = (ix.stats(), back.stats());
        prop_assert_eq!((s1.nodes, s1.entries, &s1.blocks_per_worker, s1.anomalies),
                        (s2.nodes, s2.entries, &s2.blocks_per_worker, s2.anomalies));
        prop_assert_eq!(back.workers(), ix.workers());
        for (_, _, tokens, _) in &chains {
            let mut q = tokens.clone();
            q.push(3);
            prop_assert_eq!(back.find_matches(&q), ix.find_matches(&q));
        }
        // Both evolve identically afterwards, evictions included.
        for c in chains.iter().rev() {
            let mut c = c.clone();
            c.2.push(9);
            prop_assert_eq!(back.apply(c.0, c.1, &stored(&c)), ix.apply(c.0, c.1, &stored(&c)));
        }
        prop_assert_eq!(back.digest(), ix.digest());
    }
}

#[test]
fn damaged_snapshots_are_refused() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    ix.apply(1, 0, &stored(&(1, 0, vec![1, 2, 3], 0))).unwrap();
    let bytes = ix.snapshot();
    assert!(RadixIndex::restore(&bytes).is_ok());
    assert_eq!(
        RadixIndex::restore(b"nope").unwrap_err(),
        SnapshotError::BadMagic
    );
    for cut in [12, 20, bytes.len() - 1] {
        assert!(RadixIndex::restore(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    for i in 12..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x40;
        assert!(RadixIndex::restore(&bad).is_err(), "flipped byte {i}");
    }
    let mut newer = bytes.clone();
    newer[8] = 9;
    assert_eq!(
        RadixIndex::restore(&newer).unwrap_err(),
        SnapshotError::UnsupportedVersion { found: 9 }
    );
}
