use kvroute_common::hashing::{BLOCK_HASH_SEED, local_block_hashes, seed_for_lora};
use kvroute_indexer::{IndexConfig, RadixIndex};
use proptest::prelude::*;

use super::*;
use crate::wire::{EngineEvent, Removed, Stored};

const BS: u32 = 2;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> EngineEvent {
    EngineEvent::Stored(Stored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS,
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

fn removed(hashes: &[u64], medium: &str) -> EngineEvent {
    EngineEvent::Removed(Removed {
        block_hashes: hashes.to_vec(),
        medium: Some(medium.into()),
        ..Default::default()
    })
}

fn offload(hashes: &[u64], medium: &str) -> EngineEvent {
    EngineEvent::Stored(Stored {
        block_hashes: hashes.to_vec(),
        medium: Some(medium.into()),
        ..Default::default()
    })
}

fn run(m: &mut RankMirror, events: &[EngineEvent]) -> Translation {
    let mut t = Translation::default();
    for e in events {
        m.apply(e, &mut t);
    }
    t
}

/// The index fed with `events` (after the `Cleared` every rank starts with), and how many of
/// them it refused.
fn index_of(events: &[KvEventData]) -> (RadixIndex, usize) {
    let mut index = RadixIndex::new(IndexConfig::default());
    index.apply(1, 0, &KvEventData::Cleared).unwrap();
    let refused = events
        .iter()
        .filter(|e| index.apply(1, 0, e).is_err())
        .count();
    (index, refused)
}

/// The live events apply cleanly, and the mirror's resync recreates exactly what they built.
fn assert_resync_equals_live(m: &RankMirror, live: &[KvEventData]) {
    let (a, refused_live) = index_of(live);
    let (b, refused_resync) = index_of(&m.chains());
    assert_eq!((refused_live, refused_resync), (0, 0));
    assert_eq!(
        a.digest(),
        b.digest(),
        "resync state differs from the live state"
    );
    assert_eq!(a.stats().entries, m.len());
}

#[test]
fn a_chain_becomes_one_stored_event_with_kvroute_tokens_hashes() {
    let mut m = RankMirror::new(100);
    let t = run(&mut m, &[stored(&[10, 11], None, &[1, 2, 3, 4])]);
    let local = local_block_hashes(&[1, 2, 3, 4], 2, BLOCK_HASH_SEED);
    assert_eq!(
        t.events,
        vec![KvEventData::Stored {
            parent_hash: None,
            blocks: vec![
                StoredBlock {
                    block_hash: 10,
                    tokens_hash: local[0]
                },
                StoredBlock {
                    block_hash: 11,
                    tokens_hash: local[1]
                },
            ],
            tier: StorageTier::Device,
        }]
    );
    assert_eq!(m.len(), 2);
}

#[test]
fn two_copies_of_one_hash_are_removed_only_with_the_last() {
    let mut m = RankMirror::new(100);
    let mut t = run(
        &mut m,
        &[stored(&[10], None, &[1, 2]), stored(&[10], None, &[1, 2])],
    );
    assert_eq!(t.events.len(), 1);
    assert_eq!(t.duplicate_copies, 1);
    t = run(&mut m, &[removed(&[10], "GPU")]);
    assert!(t.events.is_empty(), "a copy remains: {t:?}");
    assert_eq!(t.duplicate_copies, 1);
    t = run(&mut m, &[removed(&[10], "GPU")]);
    assert_eq!(
        t.events,
        vec![KvEventData::Removed {
            block_hashes: vec![10],
            tier: StorageTier::Device
        }]
    );
    t = run(&mut m, &[removed(&[10], "GPU")]);
    assert_eq!(t.ignored, vec![("removed_unknown", 1)]);
    assert_eq!(m.nodes(), 0);
}

#[test]
fn token_less_offload_stores_add_a_tier_to_known_blocks() {
    let mut m = RankMirror::new(100);
    run(&mut m, &[stored(&[10, 11], None, &[1, 2, 3, 4])]);
    let t = run(&mut m, &[offload(&[10, 11, 99], "CPU")]);
    let local = local_block_hashes(&[1, 2, 3, 4], 2, BLOCK_HASH_SEED);
    assert_eq!(
        t.events,
        vec![KvEventData::Stored {
            parent_hash: None,
            blocks: vec![
                StoredBlock {
                    block_hash: 10,
                    tokens_hash: local[0]
                },
                StoredBlock {
                    block_hash: 11,
                    tokens_hash: local[1]
                },
            ],
            tier: StorageTier::Host,
        }]
    );
    assert_eq!(t.ignored, vec![("offload_unknown_block", 1)]);
    // Evicted from the GPU, the blocks stay on the host.
    let t = run(&mut m, &[removed(&[11, 10], "GPU")]);
    assert_eq!(
        t.events,
        vec![KvEventData::Removed {
            block_hashes: vec![11, 10],
            tier: StorageTier::Device
        }]
    );
    assert_eq!(m.len(), 2);
    let mut fresh = RankMirror::new(100);
    let history = [
        stored(&[10, 11], None, &[1, 2, 3, 4]),
        offload(&[10, 11], "CPU_PINNED"),
        removed(&[11, 10], "GPU"),
    ];
    let live = run(&mut fresh, &history).events;
    assert_resync_equals_live(&fresh, &live);
}

#[test]
fn only_the_full_attention_group_is_indexed() {
    let mut m = RankMirror::new(100);
    let group = |g: i64, kind: &str, hashes: &[u64]| {
        EngineEvent::Stored(Stored {
            block_hashes: hashes.to_vec(),
            token_ids: vec![1, 2],
            block_size: BS,
            group_idx: Some(g),
            kv_cache_spec_kind: Some(kind.into()),
            ..Default::default()
        })
    };
    let t = run(
        &mut m,
        &[
            group(0, "sliding_window", &[10]),
            group(1, "full_attention", &[10]),
            group(2, "full_attention", &[10]),
        ],
    );
    assert_eq!(t.events.len(), 1);
    assert_eq!(t.ignored, vec![("other_group", 2)]);
    let rm = |g: i64| {
        EngineEvent::Removed(Removed {
            block_hashes: vec![10],
            group_idx: Some(g),
            ..Default::default()
        })
    };
    let t = run(&mut m, &[rm(0), rm(2)]);
    assert!(t.events.is_empty());
    let t = run(&mut m, &[rm(1)]);
    assert_eq!(t.events.len(), 1);
}

#[test]
fn media_and_locality_map_to_tiers_or_are_ignored() {
    assert_eq!(tier_of(None, None), Ok(StorageTier::Device));
    for m in ["CPU", "CPU_PINNED", "CPU_TIER1", "cpu"] {
        assert_eq!(tier_of(Some(m), None), Ok(StorageTier::Host), "{m}");
    }
    for m in ["STORAGE", "DISK", "CPU_TIER2", "NVME"] {
        assert_eq!(tier_of(Some(m), None), Ok(StorageTier::Disk), "{m}");
    }
    assert_eq!(tier_of(Some("EXTERNAL"), None), Ok(StorageTier::Shared));
    // vLLM's network-backed offload tiers: any medium with locality REMOTE.
    assert_eq!(
        tier_of(Some("STORAGE"), Some("REMOTE")),
        Ok(StorageTier::Shared)
    );
    assert_eq!(
        tier_of(Some("CPU"), Some("remote")),
        Ok(StorageTier::Shared)
    );
    assert_eq!(tier_of(Some("GPU"), Some("LOCAL")), Ok(StorageTier::Device));
    assert_eq!(tier_of(Some("TAPE"), None), Err("unknown_medium"));
}

#[test]
fn shared_media_become_the_shared_tier_or_are_ignored_when_it_is_off() {
    let remote = |hashes: &[u64], parent, tokens: &[u32]| match stored(hashes, parent, tokens) {
        EngineEvent::Stored(mut s) => {
            s.medium = Some("STORAGE".into());
            s.locality = Some("REMOTE".into());
            EngineEvent::Stored(s)
        }
        e => e,
    };
    let history = [
        stored(&[1, 2], None, &[1, 1, 2, 2]),
        // A chain in the shared store: a copy of the device blocks and one more.
        remote(&[1, 2, 3], None, &[1, 1, 2, 2, 3, 3]),
        offload(&[2], "EXTERNAL"),
        removed(&[3], "EXTERNAL"),
    ];
    let mut on = RankMirror::new(100);
    let t = run(&mut on, &history);
    assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    let tiers: Vec<_> = t.events.iter().filter_map(KvEventData::tier).collect();
    assert_eq!(
        tiers,
        [
            StorageTier::Device,
            StorageTier::Shared,
            StorageTier::Shared
        ]
    );
    assert_eq!(t.duplicate_copies, 1, "block 2 was already shared");
    assert_eq!(on.len(), 2);
    assert_resync_equals_live(&on, &t.events);
    let (index, _) = index_of(&t.events);
    let hashes = local_block_hashes(&[1, 1, 2, 2, 3, 3], 2, BLOCK_HASH_SEED);
    let m = index.find_matches(&hashes).matches[0];
    assert_eq!((m.device, m.shared), (2, 2));

    let mut off = RankMirror::new(100).with_shared_tier(false);
    let t = run(&mut off, &history);
    assert_eq!(t.events.len(), 1, "only the device store");
    assert_eq!(t.ignored, [("remote", 3), ("external", 2)]);
}

#[test]
fn extra_keys_and_salts_never_match_plain_text_but_a_lora_name_alone_is_the_seed() {
    let mut m = RankMirror::new(100);
    let plain = local_block_hashes(&[1, 2], 2, BLOCK_HASH_SEED)[0];
    let lora = local_block_hashes(&[1, 2], 2, seed_for_lora(Some("a")))[0];
    let tokens_hash = |t: &Translation| match &t.events[0] {
        KvEventData::Stored { blocks, .. } => blocks[0].tokens_hash,
        e => panic!("{e:?}"),
    };
    let with = |hash: u64, f: &dyn Fn(&mut Stored)| {
        let mut s = Stored {
            block_hashes: vec![hash],
            token_ids: vec![1, 2],
            block_size: BS,
            ..Default::default()
        };
        f(&mut s);
        EngineEvent::Stored(s)
    };
    assert_eq!(tokens_hash(&run(&mut m, &[with(1, &|_| {})])), plain);
    assert_eq!(
        tokens_hash(&run(
            &mut m,
            &[with(2, &|s| s.lora_name = Some("a".into()))]
        )),
        lora
    );
    let mm = tokens_hash(&run(
        &mut m,
        &[with(3, &|s| {
            s.extra_keys = vec![vec![0x05, 1, 0, 0, 0, b'x']]
        })],
    ));
    assert_ne!(mm, plain);
    assert_eq!(
        mm,
        fold_extra(plain, &[0x05, 1, 0, 0, 0, b'x'], BLOCK_HASH_SEED)
    );
    let salted = tokens_hash(&run(
        &mut m,
        &[with(4, &|s| s.cache_salt = Some("x".into()))],
    ));
    // A salt folds like the same string among the extra keys.
    assert_eq!(salted, mm);
}

#[test]
fn a_store_under_an_unknown_parent_is_refused_like_the_index_refuses_it() {
    let mut m = RankMirror::new(100);
    let t = run(&mut m, &[stored(&[11], Some(10), &[1, 2])]);
    assert!(t.events.is_empty());
    assert_eq!(t.ignored, vec![("parent_unknown", 1)]);
    let t = run(&mut m, &[stored(&[11], None, &[1, 2, 3])]);
    assert_eq!(t.ignored, vec![("token_count_mismatch", 1)]);
}

#[test]
fn a_removed_parent_stays_as_a_ghost_until_its_children_go() {
    let mut m = RankMirror::new(100);
    let events = [
        stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6]),
        removed(&[10], "GPU"),
    ];
    let live = run(&mut m, &events).events;
    assert_eq!((m.len(), m.nodes()), (2, 3));
    assert_resync_equals_live(&m, &live);
    run(&mut m, &[removed(&[12], "GPU")]);
    assert_eq!((m.len(), m.nodes()), (1, 2));
    run(&mut m, &[removed(&[11], "GPU")]);
    assert_eq!((m.len(), m.nodes()), (0, 0), "nothing left behind");
}

#[test]
fn the_bound_evicts_the_oldest_and_says_so() {
    let mut m = RankMirror::new(3);
    let t = run(
        &mut m,
        &[
            stored(&[10, 11], None, &[1, 2, 3, 4]),
            stored(&[20, 21], None, &[5, 6, 7, 8]),
        ],
    );
    assert_eq!(m.len(), 3);
    assert_eq!(t.ignored, vec![("mirror_full", 1)]);
    assert!(t.events.contains(&KvEventData::Removed {
        block_hashes: vec![10],
        tier: StorageTier::Device
    }));
    assert_resync_equals_live(&m, &t.events);
}

/// A chain longer than one `KvEventBatch` holds (30,000 blocks: ~1.26 MB as one event) is split
/// across events, live and in the resync, each of which encodes within the batch limit.
#[test]
fn a_chain_longer_than_one_message_is_split_across_events() {
    use kvroute_common::codec::encode;
    use kvroute_common::messages::{KvEvent, KvEventBatch};
    let n = 30_000u64;
    let hashes: Vec<u64> = (1..=n).collect();
    let tokens: Vec<u32> = (0..n as u32 * BS).collect();
    let mut m = RankMirror::new(100_000);
    let mut live = run(&mut m, &[stored(&hashes, None, &tokens)]).events;
    live.extend(run(&mut m, &[removed(&hashes[..20_000], "GPU")]).events);
    for events in [&live, &m.chains()] {
        assert!(events.len() >= 4, "{} events", events.len());
        for (i, data) in events.iter().enumerate() {
            let batch = KvEventBatch {
                v: KvEventBatch::required_version(&[]),
                worker_id: 1,
                dp_rank: 0,
                events: vec![KvEvent {
                    event_id: i as u64,
                    data: data.clone(),
                }],
                ts: 0,
            };
            encode(&batch).expect("each event fits a KvEventBatch");
        }
    }
    assert_resync_equals_live(&m, &live);
    assert_eq!(m.len(), 10_000);
}

/// Hash lookahead: one engine block per (prefix, tokens, next tokens); the same tokens with
/// another continuation are another block, and each differs from the plain block.
#[test]
fn lookahead_tokens_fold_into_the_tokens_hash() {
    let with = |hash: u64, ahead: &[u32]| {
        let mut e = stored(&[hash], None, &[1, 2]);
        if let EngineEvent::Stored(s) = &mut e {
            s.lookahead_token_ids = vec![ahead.to_vec()];
        }
        e
    };
    let mut m = RankMirror::new(100);
    let t = run(
        &mut m,
        &[with(10, &[3]), with(11, &[4]), stored(&[12], None, &[1, 2])],
    );
    let hashes: Vec<u64> = t
        .events
        .iter()
        .map(|e| match e {
            KvEventData::Stored { blocks, .. } => blocks[0].tokens_hash,
            _ => panic!(),
        })
        .collect();
    let local = local_block_hashes(&[1, 2], 2, BLOCK_HASH_SEED)[0];
    assert_eq!(hashes[2], local);
    assert_eq!(
        hashes[0],
        fold_extra(local, &lookahead_key(&[3]), BLOCK_HASH_SEED)
    );
    assert_ne!(hashes[0], hashes[1]);
    assert_eq!(
        lookahead_key(&[3]),
        [7, 1, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_resync_equals_live(&m, &t.events);
}

#[test]
fn all_blocks_cleared_empties_the_mirror() {
    let mut m = RankMirror::new(100);
    run(&mut m, &[stored(&[10, 11], None, &[1, 2, 3, 4])]);
    let t = run(&mut m, &[EngineEvent::AllCleared]);
    assert_eq!(t.events, vec![KvEventData::Cleared]);
    assert!(m.is_empty());
    assert_eq!(m.nodes(), 0);
}

/// A random engine history over a small hash space: stores (chains under a held parent or at the
/// root, sometimes a second copy), token-less offloads, removals per tier, clears.
fn history() -> impl Strategy<Value = Vec<(u8, u64, u64, u8)>> {
    proptest::collection::vec((0u8..10, 0u64..12, 0u64..12, 0u8..4), 1..80)
}

proptest! {
    /// The resync after any history recreates exactly the state the live events built, and the
    /// mirror's node count never exceeds what is held plus ghosts with children.
    #[test]
    fn resync_recreates_the_live_state(ops in history(), bound in 3usize..40) {
        let mut m = RankMirror::new(bound);
        let mut live = Vec::new();
        let media = ["GPU", "CPU", "DISK", "EXTERNAL"];
        for (op, a, b, tier) in ops {
            let medium = media[tier as usize];
            let event = match op {
                0..=3 => {
                    let parent = if op == 0 { None } else { Some(b) };
                    EngineEvent::Stored(Stored {
                        block_hashes: vec![a + 100, a + 200],
                        parent_block_hash: parent,
                        token_ids: vec![a as u32, 1, a as u32, 2],
                        block_size: 2,
                        medium: Some(medium.into()),
                        ..Default::default()
                    })
                }
                4 => EngineEvent::Stored(Stored {
                    block_hashes: vec![a],
                    parent_block_hash: Some(b + 100),
                    token_ids: vec![a as u32, 7],
                    block_size: 2,
                    medium: Some(medium.into()),
                    ..Default::default()
                }),
                5 => offload(&[a + 100, a + 200, a], medium),
                6..=8 => removed(&[a + 100 * (op as u64 - 6), b], medium),
                _ if a == 0 => EngineEvent::AllCleared,
                _ => removed(&[a + 200], medium),
            };
            let mut t = Translation::default();
            m.apply(&event, &mut t);
            live.extend(t.events);
            prop_assert!(m.len() <= bound);
        }
        // The live events start after the last Cleared, as the index sees them.
        let after = live.iter().rposition(|e| *e == KvEventData::Cleared).map_or(0, |i| i + 1);
        let (a, refused_live) = index_of(&live[after..]);
        let (b, refused_resync) = index_of(&m.chains());
        prop_assert_eq!((refused_live, refused_resync), (0, 0));
        prop_assert_eq!(a.digest(), b.digest());
        prop_assert_eq!(a.stats().entries, m.len());
    }
}
