//! The index's layout may change; its logical state may not. Digests and snapshots written by
//! an earlier layout (`tests/fixtures/`, written with `KVROUTE_WRITE_FIXTURES=1` by the build
//! that introduced them) must still hold: the same steps give the same digest, and an old
//! snapshot restores into an index that answers every query as a freshly built one does.

use std::path::PathBuf;

use kvroute_indexer::{IndexConfig, RadixIndex};

use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};

use super::harness::{Op, Rng, Step, gen_steps};

/// (seed, steps, cap) of the recorded cases.
/// Seeds `0x10_xxxx_xxxx` are [`long_chain_steps`] with that many requests. A snapshot is
/// kept for the short cases and the first long-chain case (the files stay small).
const CASES: [(u64, usize, Option<usize>); 9] = [
    (0x5eed, 300, None),
    (0x5eee, 300, None),
    (0x5eef, 600, None),
    (0xfeed, 300, Some(12)),
    (0xfeee, 300, Some(40)),
    (0xc0de, 1000, None),
    (0x10_0000_0001, 30, None),
    (0x10_0000_0002, 300, None),
    (0x10_0000_0003, 200, Some(20_000)),
];

fn keeps_snapshot(seed: u64) -> bool {
    seed >> 32 != 0x10 || seed == 0x10_0000_0001
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn build(steps: &[Step], cap: Option<usize>) -> RadixIndex {
    let mut ix = RadixIndex::new(IndexConfig {
        max_entries: cap,
        ..IndexConfig::default()
    });
    for step in steps {
        match &step.op {
            Op::Event(w, d, ev) => {
                let _ = ix.apply(*w, *d, ev);
            }
            Op::RemoveWorker(w) => ix.remove_worker(*w),
            Op::RemoveRank(w, d) => ix.remove_worker_dp_rank(*w, *d),
        }
    }
    ix
}

/// Long chains, as engines store them: requests of up to 900 blocks under five shared prefixes
/// of 200 blocks, on 8 workers (2 ranks), some offloaded to host or disk, tails evicted leaf
/// first, now and then a worker cleared. Engine hashes are chain hashes, per worker family.
pub fn long_chain_steps(seed: u64, requests: usize) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut held: Vec<Vec<Vec<u64>>> = vec![Vec::new(); 16];
    let mut steps = Vec::new();
    for r in 0..requests {
        let pair = rng.below(16) as usize;
        let (w, d) = ((pair / 2) as u64, (pair % 2) as u32);
        let prefix = rng.below(5);
        let shared = rng.below(201);
        let own = 1 + rng.below(700);
        let tokens: Vec<u64> = (0..shared)
            .map(|i| prefix << 32 | i)
            .chain((0..own).map(|i| (r as u64 + 1) << 40 | i))
            .collect();
        let mut prev = w % 3;
        let blocks: Vec<StoredBlock> = tokens
            .iter()
            .map(|&t| {
                prev = (prev ^ t)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .rotate_left(23);
                StoredBlock {
                    block_hash: prev,
                    tokens_hash: t,
                }
            })
            .collect();
        let tier = match rng.below(10) {
            0 => StorageTier::Host,
            1 => StorageTier::Disk,
            _ => StorageTier::Device,
        };
        held[pair].push(blocks.iter().map(|b| b.block_hash).collect());
        steps.push(Step {
            op: Op::Event(
                w,
                d,
                KvEventData::Stored {
                    parent_hash: None,
                    blocks,
                    tier,
                },
            ),
            query: tokens[..tokens.len() / 2].to_vec(),
        });
        if rng.below(3) == 0 && !held[pair].is_empty() {
            // Evict the tail of one of this pair's chains, leaf first.
            let k = rng.below(held[pair].len() as u64) as usize;
            let chain = &mut held[pair][k];
            let cut = rng.below(chain.len() as u64 + 1) as usize;
            let block_hashes: Vec<u64> = chain.drain(cut..).rev().collect();
            steps.push(Step {
                op: Op::Event(
                    w,
                    d,
                    KvEventData::Removed {
                        block_hashes,
                        tier: StorageTier::Device,
                    },
                ),
                query: tokens.clone(),
            });
        }
        if rng.below(40) == 0 {
            held[pair].clear();
            steps.push(Step {
                op: Op::Event(w, d, KvEventData::Cleared),
                query: tokens,
            });
        }
    }
    steps
}

fn snapshot_file(seed: u64) -> PathBuf {
    fixtures().join(format!("index-v1-{seed:x}.snap"))
}

#[test]
fn digests_and_snapshots_of_the_earlier_layout_still_hold() {
    let write = std::env::var_os("KVROUTE_WRITE_FIXTURES").is_some();
    let digests_file = fixtures().join("digests-v2.txt");
    let mut lines = Vec::new();
    let recorded = std::fs::read_to_string(&digests_file).unwrap_or_default();
    for (i, &(seed, len, cap)) in CASES.iter().enumerate() {
        let steps = if seed >> 32 == 0x10 {
            long_chain_steps(seed, len)
        } else {
            gen_steps(seed, len, cap, false)
        };
        let ix = build(&steps, cap);
        let line = format!(
            "{seed:#x} {len} {} {:#018x} {}",
            cap.map_or("none".to_string(), |c| c.to_string()),
            ix.digest(),
            ix.len()
        );
        if write {
            std::fs::create_dir_all(fixtures()).unwrap();
            if keeps_snapshot(seed) {
                std::fs::write(snapshot_file(seed), ix.snapshot()).unwrap();
            }
        } else {
            let want = recorded.lines().nth(i).expect("a recorded digest per case");
            assert_eq!(
                line, want,
                "case {i}: digest or size differs from the earlier layout"
            );
            if !keeps_snapshot(seed) {
                lines.push(line);
                continue;
            }
            let old = std::fs::read(snapshot_file(seed)).expect("recorded snapshot");
            let back = RadixIndex::restore(&old).expect("an earlier snapshot restores");
            assert_eq!(back.digest(), ix.digest(), "case {i}: restored digest");
            assert_eq!(back.len(), ix.len());
            assert_eq!(back.workers(), ix.workers());
            assert_eq!(back.stats().anomalies, ix.stats().anomalies);
            for step in &steps {
                assert_eq!(
                    back.find_matches(&step.query),
                    ix.find_matches(&step.query),
                    "case {i}: query {:?}",
                    step.query
                );
            }
            // And it goes on as the fresh index does.
            let (mut a, mut b) = (back, ix);
            for step in gen_steps(seed ^ 0xabc, 100, cap, false) {
                if let Op::Event(w, d, ev) = &step.op {
                    assert_eq!(a.apply(*w, *d, ev), b.apply(*w, *d, ev));
                }
            }
            assert_eq!(a.digest(), b.digest());
        }
        lines.push(line);
    }
    if write {
        std::fs::write(&digests_file, lines.join("\n") + "\n").unwrap();
    }
}
