//! Endless churn keeps memory flat: blocks stored and removed forever leave no nodes behind,
//! and a cap bounds an index whose removals never arrive.
//!
//! CI (debug) runs about a million block events; more with `KVROUTE_CHURN_EVENTS=50000000`.

use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_indexer::{IndexConfig, RadixIndex};

const WORKERS: u64 = 8;
/// Live chains per worker at any time.
const LIVE_CHAINS: usize = 32;
const CHAIN_BLOCKS: u64 = 16;

fn events() -> u64 {
    std::env::var("KVROUTE_CHURN_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

/// A chain of fresh content under a shared 4-block system prompt; returns its block hashes.
fn store_chain(ix: &mut RadixIndex, worker: u64, serial: u64) -> Vec<u64> {
    let mut blocks: Vec<StoredBlock> = (0..4)
        .map(|i| StoredBlock {
            block_hash: 1 + i,
            tokens_hash: 100 + i,
        })
        .collect();
    for i in 0..CHAIN_BLOCKS {
        let unique = serial << 8 | i;
        blocks.push(StoredBlock {
            block_hash: unique.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1 << 63,
            tokens_hash: unique,
        });
    }
    let hashes = blocks[4..].iter().map(|b| b.block_hash).collect();
    let ev = KvEventData::Stored {
        parent_hash: None,
        blocks,
        tier: StorageTier::Device,
    };
    ix.apply(worker, 0, &ev).unwrap();
    hashes
}

#[test]
fn churn_leaves_no_nodes_behind_and_memory_flat() {
    let mut ix = RadixIndex::new(IndexConfig::default());
    let mut live: Vec<std::collections::VecDeque<Vec<u64>>> =
        vec![Default::default(); WORKERS as usize];
    let mut serial = 0u64;
    let mut block_events = 0u64;
    let mut warm_bytes = None;
    let mut peak_bytes = 0;
    let total = events();
    while block_events < total {
        for w in 0..WORKERS {
            let q = &mut live[w as usize];
            if q.len() == LIVE_CHAINS {
                // Evict the oldest chain, leaf first, as engines do.
                let mut chain = q.pop_front().unwrap();
                chain.reverse();
                block_events += chain.len() as u64;
                let ev = KvEventData::Removed {
                    block_hashes: chain,
                    tier: StorageTier::Device,
                };
                assert_eq!(ix.apply(w, 0, &ev).unwrap().removed, CHAIN_BLOCKS as u32);
            }
            serial += 1;
            q.push_back(store_chain(&mut ix, w, serial));
            block_events += CHAIN_BLOCKS;
        }
        if serial == WORKERS * LIVE_CHAINS as u64 * 2 {
            warm_bytes = Some(ix.stats().bytes_in_use);
        }
        if serial.is_multiple_of(4096) {
            let s = ix.stats();
            peak_bytes = peak_bytes.max(s.bytes_in_use);
            // Exactly the working set: shared prompt (4 nodes) + live chains.
            assert_eq!(
                s.nodes as u64,
                4 + WORKERS * LIVE_CHAINS as u64 * CHAIN_BLOCKS
            );
        }
    }
    let s = ix.stats();
    let warm = warm_bytes.expect("warmed up");
    let entries = (WORKERS * (4 + LIVE_CHAINS as u64 * CHAIN_BLOCKS)) as usize;
    assert_eq!(s.entries, entries);
    assert!(
        peak_bytes.max(s.bytes_in_use) <= warm * 2,
        "memory grew under churn: warm {warm} B, peak {peak_bytes} B, now {} B",
        s.bytes_in_use
    );
    // A fixed bound from the working set alone: 256 bytes per entry plus fixed tables.
    assert!(
        s.bytes_in_use <= entries * 256 + 64 * 1024,
        "{} B for {entries} entries",
        s.bytes_in_use
    );
    eprintln!(
        "churn: {block_events} block events, {} B for {entries} entries (warm {warm} B)",
        s.bytes_in_use
    );
    // Everything leaves: nothing stays behind.
    for w in 0..WORKERS {
        ix.apply(w, 0, &KvEventData::Cleared).unwrap();
    }
    assert_eq!((ix.stats().nodes, ix.len()), (0, 0));
}

#[test]
fn cap_bounds_an_index_whose_removals_never_come() {
    let cap = 20_000;
    let mut ix = RadixIndex::new(IndexConfig {
        max_entries: Some(cap),
        ..IndexConfig::default()
    });
    let mut serial = 0;
    let mut bytes_at_cap = None;
    let rounds = events() / 4 / CHAIN_BLOCKS;
    for _ in 0..rounds {
        serial += 1;
        store_chain(&mut ix, serial % WORKERS, serial);
        if ix.len() == cap && bytes_at_cap.is_none() && serial > 4 * cap as u64 / CHAIN_BLOCKS {
            bytes_at_cap = Some(ix.stats().bytes_in_use);
        }
        assert!(ix.len() <= cap);
    }
    let s = ix.stats();
    assert!(s.nodes <= cap + 4);
    assert!(s.anomalies.evicted_entries > 0);
    let at_cap = bytes_at_cap.expect("reached the cap");
    assert!(
        s.bytes_in_use <= at_cap * 2,
        "{} B vs {at_cap} B at the cap",
        s.bytes_in_use
    );
}
