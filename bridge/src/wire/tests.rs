use rmpv::Value;

use super::*;

fn s(v: &str) -> Value {
    Value::from(v)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn ints(v: &[u64]) -> Value {
    Value::Array(v.iter().map(|&x| Value::from(x)).collect())
}

fn vllm_stored(hashes: Value, parent: Value, tokens: &[u64]) -> Value {
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", hashes),
        ("parent_block_hash", parent),
        ("token_ids", ints(tokens)),
        ("block_size", Value::from(2)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
    ])
}

#[test]
fn vllm_batch_with_tagged_maps_and_omitted_rank() {
    let big = u64::MAX - 5;
    let batch = Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![
            vllm_stored(ints(&[big, 7]), Value::Nil, &[1, 2, 3, 4]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[7])),
                ("medium", s("GPU")),
            ]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]),
    ]);
    let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, None);
    assert!(b.skipped.is_empty());
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.block_hashes, vec![big, 7]);
    assert_eq!(st.parent_block_hash, None);
    assert_eq!(st.token_ids, vec![1, 2, 3, 4]);
    assert_eq!(st.block_size, 2);
    assert_eq!(st.medium.as_deref(), Some("GPU"));
    assert!(st.extra_keys.is_empty());
    assert_eq!(
        b.events[1],
        EngineEvent::Removed(Removed {
            block_hashes: vec![7],
            medium: Some("GPU".into()),
            ..Default::default()
        })
    );
    assert_eq!(b.events[2], EngineEvent::AllCleared);
}

#[test]
fn sglang_negative_hashes_and_map_envelope_with_attn_dp_rank() {
    let stored = map(vec![
        ("block_size", Value::from(2)),
        ("token_ids", ints(&[9, 9])),
        ("type", s("BlockStored")), // the tag need not come first
        ("block_hashes", Value::Array(vec![Value::from(-3i64)])),
        ("parent_block_hash", Value::from(-1i64)),
        ("lora_id", Value::Nil),
        ("cache_salt", s("tenant-a")),
        ("some_future_field", map(vec![("x", Value::from(1))])),
    ]);
    let batch = map(vec![
        ("events", Value::Array(vec![stored])),
        ("ts", Value::from(17)),
        ("attn_dp_rank", Value::from(3)),
        ("unknown", s("ignored")),
    ]);
    let b = decode_batch(EngineKind::Sglang, &bytes(&batch)).unwrap();
    assert_eq!(b.dp_rank, Some(3));
    assert_eq!(b.ts, 17.0);
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.block_hashes, vec![(-3i64) as u64]);
    assert_eq!(st.parent_block_hash, Some(u64::MAX));
    assert_eq!(st.cache_salt.as_deref(), Some("tenant-a"));
}

#[test]
fn bytes_hashes_reduce_by_xxh3() {
    let h = vec![0xabu8; 32];
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![vllm_stored(
            Value::Array(vec![Value::Binary(h.clone())]),
            Value::Binary(vec![1, 2, 3]),
            &[1, 2],
        )]),
        Value::from(0),
    ]);
    let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.block_hashes, vec![xxhash_rust::xxh3::xxh3_64(&h)]);
    assert_eq!(
        st.parent_block_hash,
        Some(xxhash_rust::xxh3::xxh3_64(&[1, 2, 3]))
    );
    assert_eq!(b.dp_rank, Some(0));
}

#[test]
fn positional_events_per_engine_with_extra_slots() {
    // vLLM's slot 6 is lora_name; SGLang's is cache_salt, and lora_name is slot 8.
    let vllm = Value::Array(vec![
        s("BlockStored"),
        ints(&[5]),
        Value::Nil,
        ints(&[1, 2]),
        Value::from(2),
        Value::Nil,
        s("CPU"),
        s("sql-adapter"),
        Value::Nil,
        Value::from(1),
        s("full_attention"),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        s("a slot from the future"),
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        ints(&[5]),
        s("CPU"),
        Value::from(1),
        Value::Nil,
        Value::Nil,
        Value::from(9),
    ]);
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            vllm,
            removed,
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
        Value::from(1),
        s("extra"),
    ]);
    let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.lora_name.as_deref(), Some("sql-adapter"));
    assert_eq!(st.medium.as_deref(), Some("CPU"));
    assert_eq!(st.group_idx, Some(1));
    assert_eq!(st.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    let EngineEvent::Removed(rm) = &b.events[1] else {
        panic!()
    };
    assert_eq!(rm.group_idx, Some(1));
    assert_eq!(b.events[2], EngineEvent::AllCleared);
    assert_eq!(b.dp_rank, Some(1));

    let sglang = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(-9i64)]),
        Value::from(4),
        ints(&[1, 2]),
        Value::from(2),
        Value::Nil,
        s("GPU"),
        s("salt"),
        s("session-1"),
        s("adapter-b"),
    ]);
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![sglang]),
        Value::Nil,
    ]);
    let b = decode_batch(EngineKind::Sglang, &bytes(&batch)).unwrap();
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.cache_salt.as_deref(), Some("salt"));
    assert_eq!(st.lora_name.as_deref(), Some("adapter-b"));
    assert_eq!(st.parent_block_hash, Some(4));
    assert_eq!(b.dp_rank, None);
}

#[test]
fn extra_keys_beyond_the_lora_name_are_kept_canonically() {
    let with = |extra: Value, lora: Value| {
        let mut ev = vllm_stored(ints(&[1, 2]), Value::Nil, &[1, 2, 3, 4]);
        if let Value::Map(m) = &mut ev {
            m.push((s("extra_keys"), extra));
            m.retain(|(k, _)| k.as_str() != Some("lora_name"));
            m.push((s("lora_name"), lora));
        }
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev])]);
        let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
        let EngineEvent::Stored(st) = b.events[0].clone() else {
            panic!()
        };
        st
    };
    // Only the LoRA name: nothing extra.
    let st = with(
        Value::Array(vec![
            Value::Array(vec![s("lo")]),
            Value::Array(vec![s("lo")]),
        ]),
        s("lo"),
    );
    assert!(st.extra_keys.is_empty());
    // No keys at all.
    let st = with(Value::Array(vec![Value::Nil, Value::Nil]), Value::Nil);
    assert!(st.extra_keys.is_empty());
    // A multimodal pair on the second block.
    let mm = Value::Array(vec![s("img-hash"), Value::from(3)]);
    let st = with(
        Value::Array(vec![Value::Nil, Value::Array(vec![s("lo"), mm.clone()])]),
        s("lo"),
    );
    assert_eq!(st.extra_keys.len(), 2);
    assert!(st.extra_keys[0].is_empty());
    assert!(!st.extra_keys[1].is_empty());
    // The same value encoded with other integer widths canonicalizes alike.
    let mm_wide = Value::Array(vec![s("img-hash"), Value::from(3u64)]);
    let mut a = Vec::new();
    Reader::new(&bytes(&mm)).canon(&mut a, 0).unwrap();
    let mut raw = bytes(&mm_wide);
    // Re-encode 3 as uint64 (0xcf) by hand.
    raw.pop();
    raw.extend_from_slice(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 3]);
    let mut b = Vec::new();
    Reader::new(&raw).canon(&mut b, 0).unwrap();
    assert_eq!(a, b);
    // A length that does not match the blocks is refused (the event is skipped).
    let mut ev = vllm_stored(ints(&[1, 2]), Value::Nil, &[1, 2, 3, 4]);
    if let Value::Map(m) = &mut ev {
        m.push((s("extra_keys"), Value::Array(vec![Value::Nil])));
    }
    let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev])]);
    let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
    assert!(b.events.is_empty());
    assert_eq!(b.skipped, vec!["extra_keys_length"]);
}

#[test]
fn bad_events_are_skipped_with_a_reason_and_the_rest_kept() {
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            map(vec![("type", s("BlockEvicted"))]),
            map(vec![("block_hashes", ints(&[1]))]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", s("not a list")),
            ]),
            map(vec![("type", s("BlockStored")), ("token_ids", ints(&[1]))]),
            Value::from(5),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[1])),
            ]),
        ]),
    ]);
    let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
    assert_eq!(b.events.len(), 1);
    assert_eq!(
        b.skipped,
        vec![
            "unknown_event_type",
            "missing_type_tag",
            "bad_block_hashes",
            "missing_block_hashes",
            "event_not_map_or_array"
        ]
    );
}

#[test]
fn broken_envelopes_are_refused() {
    let ok = bytes(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]));
    assert!(decode_batch(EngineKind::Vllm, &ok).is_ok());
    assert_eq!(
        decode_batch(EngineKind::Vllm, &ok[..ok.len() - 1]),
        Err(WireError::Truncated)
    );
    let mut trailing = ok.clone();
    trailing.push(0);
    assert_eq!(
        decode_batch(EngineKind::Vllm, &trailing),
        Err(WireError::Trailing)
    );
    assert_eq!(
        decode_batch(EngineKind::Vllm, &[]),
        Err(WireError::Truncated)
    );
    assert_eq!(
        decode_batch(EngineKind::Vllm, &[0xc1]),
        Err(WireError::Invalid)
    );
    assert_eq!(
        decode_batch(EngineKind::Vllm, &bytes(&s("hello"))),
        Err(WireError::BadEnvelope)
    );
    assert_eq!(
        decode_batch(
            EngineKind::Vllm,
            &bytes(&Value::Array(vec![Value::F64(0.0)]))
        ),
        Err(WireError::BadEnvelope)
    );
    assert_eq!(
        decode_batch(
            EngineKind::Vllm,
            &bytes(&map(vec![("ts", Value::F64(0.0))]))
        ),
        Err(WireError::BadEnvelope)
    );
    // A huge declared length with no bytes behind it is a truncation, not an allocation.
    assert_eq!(
        decode_batch(
            EngineKind::Vllm,
            &[
                0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff
            ]
        ),
        Err(WireError::Truncated)
    );
    // Deep nesting in an ignored field is bounded.
    let mut deep = Value::Nil;
    for _ in 0..100 {
        deep = Value::Array(vec![deep]);
    }
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![map(vec![
            ("type", s("AllBlocksCleared")),
            ("x", deep),
        ])]),
    ]);
    assert_eq!(
        decode_batch(EngineKind::Vllm, &bytes(&batch)),
        Err(WireError::TooDeep)
    );
}

proptest::proptest! {
    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let _ = decode_batch(EngineKind::Vllm, &data);
        let _ = decode_batch(EngineKind::Sglang, &data);
    }

    #[test]
    fn every_truncation_of_a_valid_batch_is_an_error(cut in 0usize..200) {
        let batch = Value::Array(vec![
            Value::F64(2.0),
            Value::Array(vec![vllm_stored(ints(&[u64::MAX, 3]), Value::from(-2i64), &[1, 2, 3, 4])]),
            Value::from(0),
        ]);
        let full = bytes(&batch);
        let cut = cut % full.len();
        proptest::prop_assert!(decode_batch(EngineKind::Vllm, &full[..cut]).is_err());
    }
}

/// vLLM 0.34's `lookahead_token_ids`, by name and in its positional slot (after `session_id`);
/// a list that does not match the blocks skips the event.
#[test]
fn vllm_0_34_lookahead_token_ids() {
    let mut named = vllm_stored(ints(&[1, 2]), Value::Nil, &[1, 2, 3, 4]);
    if let Value::Map(m) = &mut named {
        m.push((
            s("lookahead_token_ids"),
            Value::Array(vec![ints(&[3, 4]), ints(&[5, 6])]),
        ));
    }
    let mut positional = vec![
        s("BlockStored"),
        ints(&[1, 2]),
        Value::Nil,
        ints(&[1, 2, 3, 4]),
        Value::from(2),
    ];
    // lora_id .. session_id (slots 4 to 13), then lookahead_token_ids in slot 14.
    positional.extend(std::iter::repeat_n(Value::Nil, 10));
    positional.push(Value::Array(vec![ints(&[3, 4]), ints(&[5, 6])]));
    let mut short = named.clone();
    if let Value::Map(m) = &mut short {
        m.last_mut().unwrap().1 = Value::Array(vec![ints(&[3, 4])]);
    }
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![named, Value::Array(positional), short]),
        Value::from(0),
    ]);
    let b = decode_batch(EngineKind::Vllm, &bytes(&batch)).unwrap();
    assert_eq!(b.events.len(), 2);
    for e in &b.events {
        let EngineEvent::Stored(st) = e else { panic!() };
        assert_eq!(st.lookahead_token_ids, vec![vec![3, 4], vec![5, 6]]);
    }
    assert_eq!(b.skipped, vec!["lookahead_length"]);
}
