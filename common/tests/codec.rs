//! The wire contract: every message round-trips, readers tolerate unknown and missing optional
//! fields, and bad bytes give typed errors (never panics).

use std::collections::BTreeMap;

use kvroute_common::codec::{DecodeError, EncodeError, WireMessage, decode, encode};
use kvroute_common::messages::*;
use rmpv::Value;
use uuid::Uuid;

fn uuid(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

fn batch() -> KvEventBatch {
    KvEventBatch {
        v: SchemaVersion::CURRENT,
        worker_id: 42,
        dp_rank: 1,
        ts: 1_700_000_000_000,
        events: vec![
            KvEvent {
                event_id: 7,
                data: KvEventData::Stored {
                    parent_hash: Some(u64::MAX),
                    blocks: vec![StoredBlock {
                        block_hash: 1,
                        tokens_hash: 2,
                    }],
                    tier: StorageTier::Host,
                },
            },
            KvEvent {
                event_id: 8,
                data: KvEventData::Removed {
                    block_hashes: vec![1, 3],
                    tier: StorageTier::Disk,
                },
            },
            KvEvent {
                event_id: 9,
                data: KvEventData::Cleared,
            },
        ],
    }
}

fn card() -> WorkerCard {
    WorkerCard {
        v: SchemaVersion::CURRENT,
        worker_id: 3,
        model: "llama-3-8b".into(),
        role: WorkerRole::Prefill,
        block_size: 64,
        total_kv_blocks: 16_384,
        max_num_batched_tokens: 8192,
        dp_start_rank: 2,
        dp_size: 2,
        taints: vec!["gpu=h100".into()],
        labels: BTreeMap::from([("zone".into(), "a".into())]),
        request_subject: "kvroute.default.worker.3.generate".into(),
        software_version: "0.1.0".into(),
        http_url: None,
        kv_events: true,
        lora_adapters: None,
    }
}

fn select_request() -> SelectRequest {
    SelectRequest {
        request_id: Some(uuid(1)),
        model: "m".into(),
        role: WorkerRole::Decode,
        token_ids: Some((0..100).collect()),
        block_hashes: None,
        block_size: Some(16),
        lora_name: Some("sql".into()),
        session: Some(SessionContext {
            id: "s1".into(),
            parent_id: Some("s0".into()),
            is_final: true,
            trigger: SessionTrigger::ToolResult,
        }),
        allowed_workers: Some(vec![1, 2]),
        pin: Some(Pin {
            worker_id: 1,
            dp_rank: Some(0),
        }),
        dp_rank_range: Some(DpRankRange { min: 0, max: 3 }),
        tolerated_taints: vec!["spot".into()],
        required_taints: vec!["gpu=h100".into()],
        preferred_taints: vec!["zone=a".into()],
        expected_output_tokens: Some(256),
        priority: Some(-1),
        priority_jump_ms: Some(-20),
        temperature: Some(0.5),
        policy: Some("round-robin".into()),
        deadline_ms: Some(1_700_000_000_250),
        attempt: 2,
        disaggregation: Some(Disaggregation::Conditional),
        decode: Some(HopRules {
            pin: None,
            allowed_workers: Some(vec![7, 8]),
            dp_rank_range: None,
        }),
        ..Default::default()
    }
}

fn select_reply() -> SelectResponse {
    SelectResponse::Ok(SelectReply {
        v: SchemaVersion::CURRENT,
        request_id: uuid(1),
        decision_id: uuid(2),
        worker_id: 3,
        dp_rank: 1,
        request_subject: "x".into(),
        overlap_blocks: BTreeMap::from([(StorageTier::Device, 5), (StorageTier::Host, 2)]),
        request_blocks: 9,
        cost: CostBreakdown {
            total: 1.5,
            terms: BTreeMap::from([("prefill".into(), 1.0), ("decode".into(), 0.5)]),
        },
        policy: "default".into(),
        binding: Some(BindingState::Rebound),
        router_id: "r1".into(),
        role: WorkerRole::Prefill,
        decode: Some(DecodeHop {
            decision_id: uuid(4),
            worker_id: 7,
            dp_rank: 0,
            request_subject: "y".into(),
            cost: CostBreakdown::default(),
            policy: "least-busy".into(),
            bootstrap_room: (1 << 62) + 3,
        }),
    })
}

fn select_error() -> SelectResponse {
    SelectResponse::Error(SelectError {
        v: SchemaVersion::CURRENT,
        request_id: None,
        code: ErrorCode::AllFiltered,
        message: "every worker was filtered".into(),
        reasons: BTreeMap::from([("3".into(), "missing taint gpu=h100".into())]),
    })
}

fn decision() -> Decision {
    Decision {
        v: SchemaVersion::CURRENT,
        decision_id: uuid(2),
        request_id: uuid(1),
        router_id: "r1".into(),
        model: "m".into(),
        role: WorkerRole::Aggregated,
        worker_id: 3,
        dp_rank: 0,
        session_id: Some("s1".into()),
        request_blocks: 10,
        overlap_blocks: 4,
        prefill_tokens: 384,
        expected_output_tokens: Some(100),
        block_size: 64,
        cost: CostBreakdown::default(),
        policy: "default".into(),
        binding: Some(BindingState::New),
        ts: 5,
        attempt: 1,
        prefix_hashes: Vec::new(),
        decode: None,
        lora_name: None,
    }
}

fn lifecycle(kind: LifecycleKind) -> RequestLifecycle {
    RequestLifecycle {
        v: SchemaVersion::CURRENT,
        request_id: uuid(1),
        worker_id: 3,
        dp_rank: 0,
        kind,
        ts: 9,
    }
}

fn load() -> WorkerLoad {
    WorkerLoad {
        v: SchemaVersion::CURRENT,
        worker_id: 3,
        dp_rank: 0,
        seq: 11,
        active_prefill_tokens: 1000,
        active_decode_blocks: 50,
        active_requests: 4,
        waiting_requests: 1,
        kv_used_blocks: 900,
        total_kv_blocks: 1000,
        ts: 1,
        new_requests: Some(vec![uuid::Uuid::from_u128(7)]),
        adapters: Some(kvroute_common::messages::AdapterSlots {
            loaded: vec!["a".into()],
            waiting: vec!["b".into()],
            max_loaded: 4,
        }),
    }
}

fn index_query() -> IndexQuery {
    IndexQuery {
        v: SchemaVersion::CURRENT,
        model: "m".into(),
        token_ids: None,
        block_hashes: Some(vec![1, 2, 3]),
        block_size: Some(64),
        lora_name: None,
        deadline_ms: Some(1_700_000_000_050),
    }
}

fn index_reply() -> IndexQueryResponse {
    IndexQueryResponse::Ok(IndexReply {
        v: SchemaVersion::CURRENT,
        matches: vec![WorkerMatch {
            worker_id: 1,
            dp_rank: 0,
            device: 3,
            host: 1,
            disk: 0,
            shared: 5,
            total_blocks: 99,
        }],
        query_blocks: 3,
        applied_seq: 1234,
        replica_id: "i1".into(),
    })
}

fn index_error() -> IndexQueryResponse {
    IndexQueryResponse::Error(IndexError {
        v: SchemaVersion::CURRENT,
        code: IndexErrorCode::NotReady,
        message: "catching up".into(),
        replica_id: "i2".into(),
    })
}

fn generate_request() -> GenerateRequest {
    GenerateRequest {
        v: SchemaVersion::CURRENT,
        request_id: uuid(1),
        token_ids: Some((0..100).collect()),
        block_hashes: None,
        block_size: None,
        prompt_tokens: None,
        max_tokens: 32,
        lora_name: Some("sql".into()),
        dp_rank: Some(1),
        decision_id: Some(uuid(2)),
    }
}

fn generate_reply() -> GenerateResponse {
    GenerateResponse::Ok(GenerateReply {
        v: SchemaVersion::CURRENT,
        request_id: uuid(1),
        worker_id: 3,
        dp_rank: 1,
        ttft_ms: 12.5,
        latency_ms: 340.25,
        prompt_tokens: 100,
        cached_tokens: 64,
        output_tokens: 32,
    })
}

fn generate_error() -> GenerateResponse {
    GenerateResponse::Error(GenerateError {
        v: SchemaVersion::CURRENT,
        request_id: Some(uuid(1)),
        code: GenerateErrorCode::UnknownDpRank,
        message: "rank 7 is not served here".into(),
    })
}

fn round_trip<T: WireMessage + PartialEq + std::fmt::Debug>(msg: T) {
    let bytes = encode(&msg).expect("encodes");
    let back: T = decode(&bytes).expect("decodes");
    assert_eq!(back, msg);
    // Named fields: the top level is a map, never a positional array.
    let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    assert!(value.is_map(), "{} must encode as a map", T::NAME);
}

#[test]
fn every_message_round_trips() {
    round_trip(batch());
    round_trip(card());
    round_trip(WorkerCard {
        http_url: Some("http://10.0.0.7:8000".into()),
        ..card()
    });
    round_trip(WorkerCard {
        kv_events: false,
        ..card()
    });
    round_trip(load());
    round_trip(select_request());
    round_trip(select_reply());
    round_trip(select_error());
    round_trip(decision());
    round_trip(lifecycle(LifecycleKind::PrefillDone { cached_tokens: 64 }));
    round_trip(lifecycle(LifecycleKind::Progress { output_tokens: 128 }));
    round_trip(lifecycle(LifecycleKind::Finished { output_tokens: 12 }));
    round_trip(index_query());
    round_trip(index_reply());
    round_trip(index_error());
    round_trip(generate_request());
    round_trip(GenerateRequest {
        token_ids: None,
        block_hashes: Some(vec![1, 2]),
        block_size: Some(64),
        prompt_tokens: Some(150),
        ..generate_request()
    });
    round_trip(generate_reply());
    round_trip(generate_error());
    round_trip(ControlRecord {
        v: SchemaVersion::CURRENT,
        action: ControlAction::WorkerRemoved { worker_id: 9 },
        replica_id: "i1".into(),
        term: 7,
        at_ms: 1_700_000_000_000,
    });
}

#[test]
fn a_card_without_an_http_url_does_not_carry_the_field() {
    let keys = |card: &WorkerCard| {
        let bytes = encode(card).unwrap();
        let Value::Map(map) = rmpv::decode::read_value(&mut &bytes[..]).unwrap() else {
            panic!("a map");
        };
        map.into_iter()
            .filter_map(|(k, _)| k.as_str().map(str::to_owned))
            .collect::<Vec<_>>()
    };
    assert!(!keys(&card()).iter().any(|k| k == "http_url"));
    let with = WorkerCard {
        http_url: Some("http://e:8000".into()),
        ..card()
    };
    assert!(keys(&with).iter().any(|k| k == "http_url"));
}

/// A worker that publishes KV events (every card before the field existed) writes no
/// `kv_events`, and a card without it reads as publishing them; only `false` is written.
#[test]
fn kv_events_defaults_to_true_and_is_written_only_when_false() {
    let bytes = encode(&card()).unwrap();
    let Value::Map(map) = rmpv::decode::read_value(&mut &bytes[..]).unwrap() else {
        panic!("a map");
    };
    assert!(!map.iter().any(|(k, _)| k.as_str() == Some("kv_events")));
    let old: WorkerCard = decode(&bytes).unwrap();
    assert!(old.kv_events);
    let without = WorkerCard {
        kv_events: false,
        ..card()
    };
    let bytes = encode(&without).unwrap();
    let Value::Map(map) = rmpv::decode::read_value(&mut &bytes[..]).unwrap() else {
        panic!("a map");
    };
    assert!(
        map.iter()
            .any(|(k, v)| k.as_str() == Some("kv_events") && v.as_bool() == Some(false))
    );
    assert!(!decode::<WorkerCard>(&bytes).unwrap().kv_events);
}

/// Re-encodes `msg` as a generic map, lets `edit` change it, and returns the bytes.
fn edited<T: WireMessage>(msg: &T, edit: impl FnOnce(&mut Vec<(Value, Value)>)) -> Vec<u8> {
    let bytes = encode(msg).unwrap();
    let Value::Map(mut map) = rmpv::decode::read_value(&mut &bytes[..]).unwrap() else {
        panic!("not a map")
    };
    edit(&mut map);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Map(map)).unwrap();
    out
}

#[test]
fn unknown_fields_are_ignored() {
    let bytes = edited(&batch(), |m| {
        m.push(("added_in_v1_5".into(), Value::from("whatever")));
        m.push(("nested".into(), Value::Map(vec![("x".into(), 1.into())])));
    });
    assert_eq!(decode::<KvEventBatch>(&bytes).unwrap(), batch());

    let bytes = edited(&select_request(), |m| {
        m.push(("future".into(), Value::from(true)))
    });
    assert_eq!(decode::<SelectRequest>(&bytes).unwrap(), select_request());
}

#[test]
fn missing_optional_fields_take_defaults() {
    let bytes = edited(&card(), |m| {
        m.retain(|(k, _)| {
            !matches!(
                k.as_str(),
                Some("v" | "role" | "dp_size" | "taints" | "labels" | "software_version")
            )
        })
    });
    let c: WorkerCard = decode(&bytes).unwrap();
    assert_eq!(c.v, SchemaVersion(1));
    assert_eq!(c.role, WorkerRole::Aggregated);
    assert_eq!(c.dp_size, 1);
    assert!(c.taints.is_empty() && c.labels.is_empty());

    // A minimal selection request from another language: just the model and tokens.
    let mut raw = Vec::new();
    rmpv::encode::write_value(
        &mut raw,
        &Value::Map(vec![
            ("model".into(), "m".into()),
            ("token_ids".into(), Value::Array(vec![1.into(), 2.into()])),
        ]),
    )
    .unwrap();
    let r: SelectRequest = decode(&raw).unwrap();
    assert_eq!(r.token_ids, Some(vec![1, 2]));
    assert_eq!(r.request_id, None);
    assert_eq!(r.session, None);
    assert_eq!(r.role, WorkerRole::Aggregated);
    assert_eq!(r.policy, None);

    // A minimal generate request: id, tokens and length; its wire shape by name.
    let mut raw = Vec::new();
    rmpv::encode::write_value(
        &mut raw,
        &Value::Map(vec![
            ("request_id".into(), uuid(5).to_string().into()),
            ("token_ids".into(), Value::Array(vec![1.into(), 2.into()])),
            ("max_tokens".into(), 4.into()),
        ]),
    )
    .unwrap();
    let g: GenerateRequest = decode(&raw).unwrap();
    assert_eq!((g.request_id, g.max_tokens), (uuid(5), 4));
    assert_eq!((g.dp_rank, g.block_hashes, g.lora_name), (None, None, None));
    let bytes = encode(&generate_error()).unwrap();
    let json = rmpv_to_json(&rmpv::decode::read_value(&mut &bytes[..]).unwrap());
    assert_eq!(json["status"], "error");
    assert_eq!(json["code"], "unknown_dp_rank");
    let bytes = encode(&generate_reply()).unwrap();
    let json = rmpv_to_json(&rmpv::decode::read_value(&mut &bytes[..]).unwrap());
    assert_eq!(json["status"], "ok");
    assert_eq!(json["cached_tokens"], 64);
}

#[test]
fn missing_required_field_is_malformed() {
    let bytes = edited(&card(), |m| m.retain(|(k, _)| k.as_str() != Some("model")));
    let err = decode::<WorkerCard>(&bytes).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::Malformed {
                message: "WorkerCard",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn truncated_and_garbage_bytes_give_typed_errors() {
    let bytes = encode(&batch()).unwrap();
    for cut in 1..bytes.len() {
        let err = decode::<KvEventBatch>(&bytes[..cut]).unwrap_err();
        assert_eq!(err.reason(), "malformed", "cut at {cut}: {err}");
    }
    assert_eq!(decode::<KvEventBatch>(&[]).unwrap_err().reason(), "empty");
    for garbage in [
        &b"\xc1"[..],
        b"hello world",
        b"\xff\xff\xff\xff",
        b"\x81\xa4type\xa5bogus",
    ] {
        let err = decode::<KvEventBatch>(garbage).unwrap_err();
        assert_eq!(err.reason(), "malformed", "{garbage:?}: {err}");
    }
    // A huge declared length with nothing behind it must not allocate or panic.
    let bomb = [0xdd, 0xff, 0xff, 0xff, 0xff];
    assert!(decode::<KvEventBatch>(&bomb).is_err());
    // An unknown event type is refused by name.
    let bytes = edited(&batch(), |m| {
        for (k, v) in m.iter_mut() {
            if k.as_str() == Some("events") {
                *v = Value::Array(vec![Value::Map(vec![
                    ("event_id".into(), 1.into()),
                    (
                        "data".into(),
                        Value::Map(vec![("type".into(), "teleported".into())]),
                    ),
                ])]);
            }
        }
    });
    let err = decode::<KvEventBatch>(&bytes).unwrap_err();
    assert!(err.to_string().contains("teleported"), "{err}");
}

#[test]
fn a_batch_naming_the_shared_tier_is_version_2_and_others_stay_1() {
    let mut b = batch();
    assert_eq!(KvEventBatch::required_version(&b.events), SchemaVersion(1));
    b.events.push(KvEvent {
        event_id: 9,
        data: KvEventData::Removed {
            block_hashes: vec![7],
            tier: StorageTier::Shared,
        },
    });
    assert_eq!(
        KvEventBatch::required_version(&b.events),
        SHARED_TIER_VERSION
    );
    b.v = SHARED_TIER_VERSION;
    round_trip(b.clone());
    let bytes = encode(&b).unwrap();
    let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let json = serde_json::to_string(&rmpv_to_json(&value)).unwrap();
    assert!(json.contains(r#""tier":"shared""#), "{json}");
    assert!(json.contains(r#""v":2"#), "{json}");
    // A version above the shared tier's is refused, naming what this build reads.
    b.v = SchemaVersion(3);
    assert_eq!(
        decode::<KvEventBatch>(&encode(&b).unwrap()).unwrap_err(),
        DecodeError::UnsupportedVersion {
            message: "KvEventBatch",
            version: 3,
            supported: 2
        }
    );
}

#[test]
fn newer_schema_version_is_refused() {
    let bytes = edited(&load(), |m| {
        for (k, v) in m.iter_mut() {
            if k.as_str() == Some("v") {
                *v = Value::from(2);
            }
        }
    });
    let err = decode::<WorkerLoad>(&bytes).unwrap_err();
    assert_eq!(
        err,
        DecodeError::UnsupportedVersion {
            message: "WorkerLoad",
            version: 2,
            supported: 1
        }
    );
}

#[test]
fn oversize_messages_are_refused() {
    let big = vec![0u8; WorkerLoad::MAX_BYTES + 1];
    let err = decode::<WorkerLoad>(&big).unwrap_err();
    assert_eq!(err.reason(), "too_large");

    let mut huge = batch();
    huge.events = (0..200_000)
        .map(|i| KvEvent {
            event_id: i,
            data: KvEventData::Removed {
                block_hashes: vec![i],
                tier: StorageTier::Device,
            },
        })
        .collect();
    assert!(matches!(
        encode(&huge),
        Err(EncodeError::TooLarge {
            message: "KvEventBatch",
            ..
        })
    ));
}

#[test]
fn event_wire_shape_is_by_name() {
    // What another language sees: {"type": "stored", "parent_hash": ..., "blocks": [...], "tier": "host"}
    let bytes = encode(&batch()).unwrap();
    let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let json = serde_json::to_string(&rmpv_to_json(&value)).unwrap();
    assert!(json.contains(r#""type":"stored""#), "{json}");
    assert!(json.contains(r#""tier":"host""#), "{json}");
    assert!(json.contains(r#""type":"cleared""#), "{json}");
    assert!(json.contains(r#""block_hash":1,"tokens_hash":2"#), "{json}");
}

fn rmpv_to_json(v: &Value) -> serde_json::Value {
    match v {
        Value::Nil => serde_json::Value::Null,
        Value::Boolean(b) => (*b).into(),
        Value::Integer(i) => i
            .as_u64()
            .map(Into::into)
            .unwrap_or_else(|| i.as_i64().unwrap().into()),
        Value::F32(f) => (*f as f64).into(),
        Value::F64(f) => (*f).into(),
        Value::String(s) => s.as_str().unwrap_or_default().into(),
        Value::Array(a) => a.iter().map(rmpv_to_json).collect(),
        Value::Map(m) => m
            .iter()
            .map(|(k, v)| (k.as_str().unwrap_or_default().to_owned(), rmpv_to_json(v)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
        other => serde_json::Value::String(format!("{other:?}")),
    }
}

#[test]
fn event_fields_may_come_in_any_order_and_extra_fields_are_ignored() {
    let event = |fields: Vec<(Value, Value)>| {
        let mut raw = Vec::new();
        rmpv::encode::write_value(
            &mut raw,
            &Value::Map(vec![
                ("worker_id".into(), 1.into()),
                (
                    "events".into(),
                    Value::Array(vec![Value::Map(vec![
                        ("event_id".into(), 0.into()),
                        ("data".into(), Value::Map(fields)),
                    ])]),
                ),
            ]),
        )
        .unwrap();
        decode::<KvEventBatch>(&raw).map(|b| b.events[0].data.clone())
    };
    let block = Value::Map(vec![
        ("block_hash".into(), 5.into()),
        ("tokens_hash".into(), 6.into()),
    ]);
    // The tag last, an explicit nil parent, an unknown field.
    let stored = event(vec![
        ("blocks".into(), Value::Array(vec![block])),
        ("parent_hash".into(), Value::Nil),
        ("shiny_new_field".into(), Value::from("x")),
        ("type".into(), "stored".into()),
    ])
    .unwrap();
    assert_eq!(
        stored,
        KvEventData::Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: 5,
                tokens_hash: 6
            }],
            tier: StorageTier::Device,
        }
    );
    assert!(
        event(vec![("type".into(), "removed".into())]).is_err(),
        "removed needs block_hashes"
    );
    assert!(
        event(vec![("blocks".into(), Value::Array(vec![]))]).is_err(),
        "the tag is required"
    );
    assert_eq!(
        event(vec![("type".into(), "cleared".into())]).unwrap(),
        KvEventData::Cleared
    );
}
