//! The documented outcome of each kind of input, one scenario per test.

use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_indexer::{ApplyError, ApplyOk, IndexConfig, RadixIndex};

fn blk(block_hash: u64, tokens_hash: u64) -> StoredBlock {
    StoredBlock {
        block_hash,
        tokens_hash,
    }
}

fn stored(parent: Option<u64>, blocks: &[(u64, u64)], tier: StorageTier) -> KvEventData {
    KvEventData::Stored {
        parent_hash: parent,
        blocks: blocks.iter().map(|&(b, t)| blk(b, t)).collect(),
        tier,
    }
}

fn removed(hashes: &[u64], tier: StorageTier) -> KvEventData {
    KvEventData::Removed {
        block_hashes: hashes.to_vec(),
        tier,
    }
}

/// (worker, rank, device, host, disk) of every row.
fn rows(index: &RadixIndex, query: &[u64]) -> Vec<(u64, u32, u32, u32, u32)> {
    index
        .find_matches(query)
        .matches
        .iter()
        .map(|m| (m.worker_id, m.dp_rank, m.device, m.host, m.disk))
        .collect()
}

#[test]
fn engines_that_hash_differently_share_nodes_by_tokens() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &[(100, 1), (101, 2), (102, 3)], dev))
        .unwrap();
    ix.apply(2, 0, &stored(None, &[(900, 1), (901, 2)], dev))
        .unwrap();
    ix.apply(2, 1, &stored(None, &[(900, 1)], dev)).unwrap();
    assert_eq!(ix.stats().nodes, 3);
    assert_eq!(
        rows(&ix, &[1, 2, 3, 4]),
        vec![(1, 0, 3, 0, 0), (2, 0, 2, 0, 0), (2, 1, 1, 0, 0)]
    );
    // Worker 2 extends its chain under its own hash of block 2.
    ix.apply(2, 0, &stored(Some(901), &[(902, 3)], dev))
        .unwrap();
    assert_eq!(
        rows(&ix, &[1, 2, 3]),
        vec![(1, 0, 3, 0, 0), (2, 0, 3, 0, 0), (2, 1, 1, 0, 0)]
    );
    let s = ix.find_matches(&[1]);
    assert_eq!(s.get(2, 0).unwrap().total_blocks, 3);
    assert_eq!(s.query_blocks, 1);
    assert!(ix.find_matches(&[7]).matches.is_empty());
    assert!(ix.find_matches(&[]).matches.is_empty());
}

#[test]
fn tiers_count_each_block_in_its_best_tier() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    ix.apply(
        1,
        0,
        &stored(None, &[(10, 1), (11, 2), (12, 3)], StorageTier::Disk),
    )
    .unwrap();
    ix.apply(1, 0, &stored(None, &[(10, 1)], StorageTier::Device))
        .unwrap();
    ix.apply(1, 0, &stored(Some(10), &[(11, 2)], StorageTier::Host))
        .unwrap();
    assert_eq!(rows(&ix, &[1, 2, 3]), vec![(1, 0, 1, 1, 1)]);
    // Dropping the device copy leaves the disk one.
    ix.apply(1, 0, &removed(&[10], StorageTier::Device))
        .unwrap();
    assert_eq!(rows(&ix, &[1, 2, 3]), vec![(1, 0, 0, 1, 2)]);
    assert_eq!(ix.len(), 3);
}

#[test]
fn unknown_parent_is_refused_and_changes_nothing() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    ix.apply(1, 0, &stored(None, &[(10, 1)], StorageTier::Device))
        .unwrap();
    let digest = ix.digest();
    let err = ix
        .apply(1, 0, &stored(Some(99), &[(11, 2)], StorageTier::Device))
        .unwrap_err();
    assert_eq!(
        err,
        ApplyError::ParentUnknown {
            worker_id: 1,
            dp_rank: 0,
            parent_hash: 99
        }
    );
    // Another worker's blocks are not this worker's parents.
    assert!(
        ix.apply(2, 0, &stored(Some(10), &[(11, 2)], StorageTier::Device))
            .is_err()
    );
    assert_eq!(ix.digest(), digest);
    let a = ix.stats().anomalies;
    assert_eq!((a.parent_unknown_events, a.parent_unknown_blocks), (2, 2));
    assert_eq!(ix.workers(), vec![(1, 0)]);
}

#[test]
fn duplicates_and_unknown_removals_are_counted_no_ops() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let ev = stored(None, &[(10, 1), (11, 2)], StorageTier::Device);
    ix.apply(1, 0, &ev).unwrap();
    let digest = ix.digest();
    let again = ix.apply(1, 0, &ev).unwrap();
    assert_eq!(
        again,
        ApplyOk {
            unchanged: 2,
            ..ApplyOk::default()
        }
    );
    assert_eq!(ix.digest(), digest);
    let rm = removed(&[55, 11], StorageTier::Device);
    assert_eq!(ix.apply(1, 0, &rm).unwrap().removed, 1);
    assert_eq!(ix.apply(1, 0, &rm).unwrap().unchanged, 2);
    assert_eq!(ix.apply(7, 0, &rm).unwrap().unchanged, 2);
    let a = ix.stats().anomalies;
    assert_eq!(a.duplicate_stored_blocks, 2);
    assert_eq!(a.removed_unknown_blocks, 5);
}

#[test]
fn rebound_and_aliased_hashes_follow_the_documented_rules() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &[(10, 1), (11, 2)], dev))
        .unwrap();
    // Hash 11 now names tokens 3 under 10: the old block (tokens 2) is gone for worker 1.
    ix.apply(1, 0, &stored(Some(10), &[(11, 3)], dev)).unwrap();
    assert_eq!(rows(&ix, &[1, 2]), vec![(1, 0, 1, 0, 0)]);
    assert_eq!(rows(&ix, &[1, 3]), vec![(1, 0, 2, 0, 0)]);
    assert_eq!(ix.stats().nodes, 2);
    // Same tokens path under a new hash: the first hash (10) keeps naming it.
    ix.apply(1, 0, &stored(None, &[(20, 1)], StorageTier::Host))
        .unwrap();
    assert!(ix.apply(1, 0, &removed(&[20], dev)).unwrap().unchanged == 1);
    assert_eq!(rows(&ix, &[1, 3]), vec![(1, 0, 2, 0, 0)]);
    ix.apply(1, 0, &removed(&[10], dev)).unwrap();
    assert_eq!(rows(&ix, &[1, 3]), vec![(1, 0, 1, 1, 0)]);
    let a = ix.stats().anomalies;
    assert_eq!((a.rebound_blocks, a.aliased_blocks), (1, 1));
}

#[test]
fn removal_frees_nodes_but_keeps_structure_under_held_children() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &[(10, 1), (11, 2), (12, 3)], dev))
        .unwrap();
    ix.apply(1, 0, &removed(&[10], dev)).unwrap();
    assert!(rows(&ix, &[1, 2, 3]).is_empty());
    assert_eq!(ix.stats().nodes, 3);
    // The worker can still extend under a block whose ancestor it evicted.
    ix.apply(1, 0, &stored(Some(12), &[(13, 4)], dev)).unwrap();
    ix.apply(1, 0, &removed(&[13, 12, 11], dev)).unwrap();
    assert_eq!(ix.stats().nodes, 0);
    assert!(ix.workers().is_empty());
}

#[test]
fn cleared_and_remove_worker_drop_only_their_pairs() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    for (w, r) in [(1, 0), (1, 1), (2, 0)] {
        ix.apply(w, r, &stored(None, &[(10, 1), (11, 2)], dev))
            .unwrap();
    }
    ix.apply(1, 1, &KvEventData::Cleared).unwrap();
    assert_eq!(ix.workers(), vec![(1, 0), (2, 0)]);
    ix.remove_worker(1);
    assert_eq!(ix.workers(), vec![(2, 0)]);
    ix.remove_worker_dp_rank(2, 0);
    assert!(ix.workers().is_empty());
    assert_eq!(ix.stats().nodes, 0);
    assert_eq!(ix.len(), 0);
}

#[test]
fn cap_evicts_the_oldest_store_first() {
    let mut ix = RadixIndex::new(IndexConfig {
        max_entries: Some(3),
        ..IndexConfig::default()
    });
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &[(10, 1), (11, 2)], dev))
        .unwrap();
    ix.apply(2, 0, &stored(None, &[(20, 1)], dev)).unwrap();
    // Re-storing 10 makes 11 the oldest.
    ix.apply(1, 0, &stored(None, &[(10, 1)], dev)).unwrap();
    let ok = ix.apply(2, 0, &stored(Some(20), &[(21, 2)], dev)).unwrap();
    assert_eq!(ok.evicted, 1);
    assert_eq!(ix.len(), 3);
    assert_eq!(rows(&ix, &[1, 2]), vec![(1, 0, 1, 0, 0), (2, 0, 2, 0, 0)]);
    assert_eq!(ix.stats().anomalies.evicted_entries, 1);
}

#[test]
fn tokens_variant_hashes_with_the_lora_seed() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let tokens: Vec<u32> = (0..40).collect();
    let h = kvroute_common::hashing::BlockHashes::of_tokens(&tokens, 16, Some("a"));
    let blocks: Vec<_> = h
        .sequence
        .iter()
        .zip(&h.local)
        .map(|(&s, &l)| (s, l))
        .collect();
    ix.apply(3, 0, &stored(None, &blocks, StorageTier::Device))
        .unwrap();
    assert_eq!(
        ix.find_matches_for_tokens(&tokens, 16, Some("a")).matches[0].device,
        2
    );
    assert!(
        ix.find_matches_for_tokens(&tokens, 16, None)
            .matches
            .is_empty()
    );
}

/// Blocks `first..=last` as (block hash, tokens hash) pairs: block hash `1000 + t`.
fn chain(first: u64, last: u64) -> Vec<(u64, u64)> {
    (first..=last).map(|t| (1000 + t, t)).collect()
}

fn runs(ix: &RadixIndex) -> usize {
    let s = ix.stats();
    assert!(!ix.has_unused_node());
    s.runs
}

#[test]
fn a_chain_leaving_a_run_inside_it_splits_the_run() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &chain(1, 10), dev)).unwrap();
    assert_eq!(runs(&ix), 1);
    let mut other = chain(1, 4);
    other.extend([(2099, 99), (2100, 100)]);
    ix.apply(2, 0, &stored(None, &other, dev)).unwrap();
    assert_eq!(
        runs(&ix),
        3,
        "the common prefix, the rest of the run, the new branch"
    );
    assert_eq!(ix.stats().nodes, 12);
    let q: Vec<u64> = (1..=10).collect();
    assert_eq!(rows(&ix, &q), vec![(1, 0, 10, 0, 0), (2, 0, 4, 0, 0)]);
    assert_eq!(
        rows(&ix, &[1, 2, 3, 4, 99, 100]),
        vec![(1, 0, 4, 0, 0), (2, 0, 6, 0, 0)]
    );
    // The branch gone, the two halves are one run again.
    ix.apply(2, 0, &removed(&[2100, 2099, 1004, 1003, 1002, 1001], dev))
        .unwrap();
    assert_eq!(runs(&ix), 1);
    assert_eq!(rows(&ix, &q), vec![(1, 0, 10, 0, 0)]);
}

#[test]
fn a_hole_in_the_middle_of_a_run_stops_the_match_there() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &chain(1, 10), dev)).unwrap();
    ix.apply(2, 0, &stored(None, &chain(1, 10), dev)).unwrap();
    ix.apply(1, 0, &removed(&[1005], dev)).unwrap();
    assert_eq!(runs(&ix), 2);
    let q: Vec<u64> = (1..=10).collect();
    assert_eq!(rows(&ix, &q), vec![(1, 0, 4, 0, 0), (2, 0, 10, 0, 0)]);
    // Blocks after the hole are still held (and counted), just not matched through it.
    assert_eq!(ix.find_matches(&q).get(1, 0).unwrap().total_blocks, 9);
    ix.apply(1, 0, &stored(Some(1004), &chain(5, 5), dev))
        .unwrap();
    assert_eq!(rows(&ix, &q), vec![(1, 0, 10, 0, 0), (2, 0, 10, 0, 0)]);
    assert_eq!(runs(&ix), 1, "filled again, the run is whole");
}

#[test]
fn owners_holding_part_of_a_run_keep_one_run() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &chain(1, 10), dev)).unwrap();
    ix.apply(2, 0, &stored(None, &chain(1, 4), dev)).unwrap();
    ix.apply(3, 0, &stored(None, &chain(1, 7), dev)).unwrap();
    assert_eq!(runs(&ix), 1);
    let q: Vec<u64> = (1..=10).collect();
    assert_eq!(
        rows(&ix, &q),
        vec![(1, 0, 10, 0, 0), (2, 0, 4, 0, 0), (3, 0, 7, 0, 0)]
    );
    // Leaf-first eviction of the longest holder shortens the run to what others hold.
    ix.apply(1, 0, &removed(&[1010, 1009, 1008, 1007, 1006], dev))
        .unwrap();
    assert_eq!(runs(&ix), 1);
    assert_eq!(ix.stats().nodes, 7);
    assert_eq!(
        rows(&ix, &q),
        vec![(1, 0, 5, 0, 0), (2, 0, 4, 0, 0), (3, 0, 7, 0, 0)]
    );
}

#[test]
fn a_tier_change_inside_a_run_splits_it_and_merges_back() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let (dev, host) = (StorageTier::Device, StorageTier::Host);
    ix.apply(1, 0, &stored(None, &chain(1, 10), host)).unwrap();
    ix.apply(1, 0, &stored(Some(1003), &chain(4, 6), dev))
        .unwrap();
    assert_eq!(runs(&ix), 3, "blocks 4..=6 in another set of tiers");
    let q: Vec<u64> = (1..=10).collect();
    assert_eq!(rows(&ix, &q), vec![(1, 0, 3, 7, 0)]);
    ix.apply(1, 0, &removed(&[1004, 1005, 1006], dev)).unwrap();
    assert_eq!(rows(&ix, &q), vec![(1, 0, 0, 10, 0)]);
    assert_eq!(runs(&ix), 1);
}

#[test]
fn a_decode_storing_a_block_at_a_time_grows_a_few_runs() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let dev = StorageTier::Device;
    ix.apply(1, 0, &stored(None, &chain(1, 4), dev)).unwrap();
    for t in 5..=200 {
        ix.apply(1, 0, &stored(Some(1000 + t - 1), &chain(t, t), dev))
            .unwrap();
    }
    let q: Vec<u64> = (1..=200).collect();
    assert_eq!(rows(&ix, &q), vec![(1, 0, 200, 0, 0)]);
    assert!(runs(&ix) <= 7, "{} runs for 200 blocks", runs(&ix));
}

#[test]
fn the_shared_tier_prefix_chains_across_workers_and_stops_at_the_first_block_nobody_shares() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let (dev, shared) = (StorageTier::Device, StorageTier::Shared);
    // Worker 1 computed blocks 1..=3 and wrote them to the shared store.
    ix.apply(1, 0, &stored(None, &chain(1, 3), dev)).unwrap();
    ix.apply(1, 0, &stored(None, &chain(1, 3), shared)).unwrap();
    // Worker 2 loaded them, continued the conversation and wrote only the new blocks 4..=5.
    ix.apply(2, 0, &stored(None, &chain(1, 5), dev)).unwrap();
    ix.apply(2, 0, &stored(Some(1003), &chain(4, 5), shared))
        .unwrap();
    // Worker 2 then lost blocks 1..=3 from its device: it holds 4..=5 only in the shared tier.
    ix.apply(2, 0, &removed(&[1001, 1002, 1003], dev)).unwrap();
    let prefix = |ix: &RadixIndex, q: &[u64]| ix.find_matches(q).shared_prefix();
    assert_eq!(
        prefix(&ix, &[1, 2, 3, 4, 5, 6]),
        5,
        "1..=3 by worker 1, 4..=5 by worker 2"
    );
    assert_eq!(prefix(&ix, &[1, 2, 9]), 2);
    assert_eq!(prefix(&ix, &[7]), 0);
    // Every row carries it; the pairs' own tiers count from the first block only.
    let s = ix.find_matches(&[1, 2, 3, 4, 5]);
    assert!(s.matches.iter().all(|m| m.shared == 5));
    assert_eq!(rows(&ix, &[1, 2, 3, 4, 5]), vec![(1, 0, 3, 0, 0)]);
    // A hole in the shared chain (worker 1 evicted block 2 from the store) stops it there,
    // although worker 1 still holds block 2 on its device.
    ix.apply(1, 0, &removed(&[1002], shared)).unwrap();
    assert_eq!(prefix(&ix, &[1, 2, 3, 4, 5]), 1);
    assert_eq!(rows(&ix, &[1, 2, 3]), vec![(1, 0, 3, 0, 0)]);
    // A block held only in the shared tier is in no row's own tiers.
    let mut only = RadixIndex::new(IndexConfig::default());
    only.apply(3, 0, &stored(None, &chain(1, 2), shared))
        .unwrap();
    let s = only.find_matches(&[1, 2]);
    assert_eq!(rows(&only, &[1, 2]), vec![(3, 0, 0, 0, 0)]);
    assert_eq!(s.shared_prefix(), 2);
}

#[test]
fn snapshots_are_v2_without_the_shared_tier_and_v3_with_it() {
    let version = |ix: &RadixIndex| u32::from_le_bytes(ix.snapshot()[8..12].try_into().unwrap());
    let mut ix = RadixIndex::new(IndexConfig::default());
    ix.apply(1, 0, &stored(None, &chain(1, 3), StorageTier::Host))
        .unwrap();
    assert_eq!(
        version(&ix),
        2,
        "readable by replicas older than the shared tier"
    );
    ix.apply(2, 0, &stored(None, &chain(1, 4), StorageTier::Shared))
        .unwrap();
    assert_eq!(version(&ix), 3);
    let back = RadixIndex::restore(&ix.snapshot()).unwrap();
    assert_eq!(back.digest(), ix.digest());
    assert_eq!(back.find_matches(&[1, 2, 3, 4]).shared_prefix(), 4);
    // The digest tells the shared tier from the others.
    let mut host = RadixIndex::new(IndexConfig::default());
    host.apply(1, 0, &stored(None, &chain(1, 3), StorageTier::Host))
        .unwrap();
    let mut both = host.clone();
    both.apply(1, 0, &stored(None, &chain(1, 3), StorageTier::Shared))
        .unwrap();
    assert_ne!(host.digest(), both.digest());
    // A v2 snapshot claiming the shared tier is corrupt.
    let mut bytes = ix.snapshot();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    let body = bytes.len() - 8;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes[..body]);
    bytes[body..].copy_from_slice(&sum.to_le_bytes());
    assert!(RadixIndex::restore(&bytes).is_err());
}
