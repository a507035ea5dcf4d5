//! The mocker's impersonated engines and the bridge speak one vocabulary (kvroute-engine-wire):
//! what the engine face writes for a KV event, in either engine's dialect and either event
//! form, the bridge decodes back to the same blocks, tokens, medium and rank.

use kvroute_bridge::EngineKind;
use kvroute_bridge::wire::{EngineEvent, decode_batch};
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_engine_wire::media::tier_of;
use kvroute_mocker::engine_face::{EventFormat, EventWriter};
use proptest::prelude::*;

fn kinds() -> impl Strategy<Value = EngineKind> {
    prop_oneof![Just(EngineKind::Vllm), Just(EngineKind::Sglang)]
}

fn formats() -> impl Strategy<Value = EventFormat> {
    prop_oneof![Just(EventFormat::Maps), Just(EventFormat::Arrays)]
}

fn tiers() -> impl Strategy<Value = StorageTier> {
    prop_oneof![
        Just(StorageTier::Device),
        Just(StorageTier::Host),
        Just(StorageTier::Disk),
        Just(StorageTier::Shared),
    ]
}

/// Writes `event` as the engine face does and decodes the batch as the bridge does.
fn round_trip(
    writer: &EventWriter,
    event: &KvEventData,
    tokens: &[(u64, Vec<u32>)],
    lora: Option<&str>,
    rank: u32,
) -> Vec<EngineEvent> {
    let lookup = |h: u64| {
        tokens
            .iter()
            .find(|(k, _)| *k == h)
            .map(|(_, t)| (t.as_slice(), lora))
    };
    let events = writer.events(event, lookup).unwrap();
    let payload = writer.batch(1.25, events, rank);
    let batch = decode_batch(writer.engine, &payload).unwrap();
    assert!(batch.skipped.is_empty(), "skipped: {:?}", batch.skipped);
    assert_eq!(batch.ts, 1.25);
    assert_eq!(batch.dp_rank, Some(rank));
    batch.events
}

proptest! {
    #[test]
    fn what_the_engine_face_writes_the_bridge_reads(
        engine in kinds(),
        format in formats(),
        tier in tiers(),
        block_size in 1u32..5,
        hashes in prop::collection::hash_set(any::<u64>(), 1..6),
        parent in prop::option::of(any::<u64>()),
        token_seed in any::<u32>(),
        lora in prop::option::of("[a-z][a-z0-9-]{0,11}"),
        rank in 0u32..64,
    ) {
        let writer = EventWriter { engine, format, block_size };
        let hashes: Vec<u64> = hashes.into_iter().collect();
        let tokens: Vec<(u64, Vec<u32>)> = hashes
            .iter()
            .enumerate()
            .map(|(i, &h)| {
                let t = (0..block_size)
                    .map(|j| token_seed.wrapping_add(i as u32 * block_size + j))
                    .collect();
                (h, t)
            })
            .collect();
        let stored = KvEventData::Stored {
            parent_hash: parent,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock { block_hash: h, tokens_hash: 0 })
                .collect(),
            tier,
        };
        let events = round_trip(&writer, &stored, &tokens, lora.as_deref(), rank);
        prop_assert_eq!(events.len(), 1);
        let EngineEvent::Stored(s) = &events[0] else {
            panic!("not a store: {:?}", events[0]);
        };
        prop_assert_eq!(&s.block_hashes, &hashes);
        prop_assert_eq!(s.parent_block_hash, parent);
        let all_tokens: Vec<u32> = tokens.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        prop_assert_eq!(&s.token_ids, &all_tokens);
        prop_assert_eq!(s.block_size, block_size);
        prop_assert_eq!(s.lora_id, None);
        // The adapter the blocks were computed under, by name (as vLLM's and SGLang's
        // publishers name it; the bridge hashes the tokens under its seed).
        prop_assert_eq!(s.lora_name.as_deref(), lora.as_deref());
        prop_assert!(s.extra_keys.is_empty() && s.cache_salt.is_none());
        prop_assert!(s.lookahead_token_ids.is_empty());
        prop_assert_eq!(tier_of(s.medium.as_deref(), s.locality.as_deref()), Ok(tier));

        let removed = KvEventData::Removed { block_hashes: hashes.clone(), tier };
        let events = round_trip(&writer, &removed, &tokens, lora.as_deref(), rank);
        let mut seen = Vec::new();
        for e in &events {
            let EngineEvent::Removed(r) = e else {
                panic!("not a removal: {e:?}");
            };
            prop_assert_eq!(tier_of(r.medium.as_deref(), r.locality.as_deref()), Ok(tier));
            seen.extend_from_slice(&r.block_hashes);
        }
        prop_assert_eq!(seen, hashes);

        let events = round_trip(&writer, &KvEventData::Cleared, &tokens, lora.as_deref(), rank);
        prop_assert_eq!(events, vec![EngineEvent::AllCleared]);
    }
}
