//! The fuzz targets' checks, one function per target (`fuzz_targets/<name>.rs` calls
//! `<name>`), and what they share: the wire codec's round trip and the engine batches' check.
//! [`TARGETS`] lists them by name: the main workspace's `tests/tests/fuzz_corpus.rs` includes this
//! file and replays every committed input of `corpus/<name>/` through them on every test run.

use std::fmt::Debug;

use axum::http::{HeaderMap, HeaderValue};
use kvroute_bridge::EngineKind;
use kvroute_common::codec::{EncodeError, WireMessage, decode, encode};
use kvroute_common::discovery::{WorkerEvent, decode_card};
use kvroute_common::messages::{
    ControlRecord, Decision, GenerateRequest, GenerateResponse, IndexQuery, IndexQueryResponse,
    KvEventBatch, ReplicaStatus, RequestLifecycle, SchemaVersion, SelectRequest, SelectResponse,
    SessionBindingRecord, WorkerCard, WorkerLoad,
};
use kvroute_common::{Names, Namespace};
use kvroute_gateway::openai::{Api, POLICY, Parsed, SESSION_FINAL, SESSION_ID, forwarded_body};
use kvroute_gateway::select_api::parse_body;
use kvroute_indexer::replica::{LogEntry, ReplicaState, decode_entry};
use kvroute_indexer::{IndexConfig, SharedIndex};
use kvroute_router::service::intake::{MAX_SESSION_ID_BYTES, parse};
use xxhash_rust::xxh3::xxh3_64;

/// A target's check of one input: returns on any input it accepts or rejects as promised, panics
/// on a broken promise.
pub type Check = fn(&[u8]);

/// Every target, by its name (its `fuzz_targets/` file and its `corpus/` folder).
pub const TARGETS: [(&str, Check); 18] = [
    ("engine_metrics", engine_metrics),
    ("engine_sglang", engine_sglang),
    ("engine_vllm", engine_vllm),
    ("gateway_openai", gateway_openai),
    ("gateway_select", gateway_select),
    ("index_snapshot", index_snapshot),
    ("log_entry", log_entry),
    ("replica_state", replica_state),
    ("select_request", select_request),
    ("wire_control_record", wire_control_record),
    ("wire_decision", wire_decision),
    ("wire_generate_request", wire_generate_request),
    ("wire_index_query", wire_index_query),
    ("wire_kv_event_batch", wire_kv_event_batch),
    ("wire_replies", wire_replies),
    ("wire_request_lifecycle", wire_request_lifecycle),
    ("wire_worker_load", wire_worker_load),
    ("worker_card", worker_card),
];

/// Decodes `data` as a `T`; when that succeeds, checks the codec's promise that the value
/// encodes and decodes back to itself: the second decoding succeeds, is equal (compared by
/// `Debug`, which also compares NaN costs), and encodes to the same bytes. A failure is a typed
/// [`kvroute_common::DecodeError`], which the caller may inspect.
pub fn round_trip<T: WireMessage + Debug>(data: &[u8]) -> Option<T> {
    let msg = decode::<T>(data).ok()?;
    let bytes = match encode(&msg) {
        Ok(bytes) => bytes,
        // A compact input (e.g. tokens as a bin, ids in few bytes) may re-encode larger than
        // the limit: the limit is the reader's, not a promise of the value.
        Err(EncodeError::TooLarge { .. }) => return Some(msg),
        Err(e) => panic!("{} decoded but does not encode: {e}\n{msg:?}", T::NAME),
    };
    let again: T = decode(&bytes)
        .unwrap_or_else(|e| panic!("{} re-encoded does not decode: {e}\n{msg:?}", T::NAME));
    assert_eq!(
        format!("{msg:?}"),
        format!("{again:?}"),
        "{} changed through encode and decode",
        T::NAME
    );
    let bytes_again = encode(&again).expect("encoded once");
    assert_eq!(
        bytes,
        bytes_again,
        "{} encodes differently the second time",
        T::NAME
    );
    Some(msg)
}

/// The engine targets' check of one input, for either engine's decoder: a typed `WireError`,
/// or a batch whose every event is well-formed (extra keys empty or one per block); the
/// bridge's frame checks never panic.
pub fn check_engine_batch(kind: EngineKind, data: &[u8]) {
    use kvroute_bridge::wire::{EngineEvent, decode_batch};
    use kvroute_bridge::zmq_io::{frames_error, seq_of};
    match decode_batch(kind, data) {
        Ok(batch) => {
            for event in &batch.events {
                if let EngineEvent::Stored(s) = event {
                    assert!(s.extra_keys.is_empty() || s.extra_keys.len() == s.block_hashes.len());
                }
            }
            assert!(batch.skipped.iter().all(|r| !r.is_empty()));
        }
        Err(e) => assert!(!e.reason().is_empty()),
    }
    // A live message: [topic, seq, payload], split from the input at its first two bytes.
    if let [a, b, rest @ ..] = data {
        let (a, b) = (usize::from(*a).min(rest.len()), usize::from(*b));
        let (topic, rest) = rest.split_at(a);
        let (seq, payload) = rest.split_at(b.min(rest.len()));
        let frames = vec![topic.to_vec(), seq.to_vec(), payload.to_vec()];
        if frames_error(&frames).is_none() {
            let _ = seq_of(&frames[1]);
        }
    }
}

/// The bridge's decoder of SGLang's ZeroMQ KV-event payloads (MessagePack batches): see
/// [`check_engine_batch`].
pub fn engine_sglang(data: &[u8]) {
    check_engine_batch(EngineKind::Sglang, data);
}

/// The bridge's decoder of vLLM's ZeroMQ KV-event payloads (MessagePack batches): see
/// [`check_engine_batch`].
pub fn engine_vllm(data: &[u8]) {
    check_engine_batch(EngineKind::Vllm, data);
}

/// The bridge's reading of a vLLM `/metrics` page (any text: an engine's page holds hundreds of
/// series the bridge skips): loads per rank, cache facts and the LoRA adapter slots of the
/// newest `vllm:lora_requests_info` series, never a panic; usage within 0..=1; adapter lists
/// of at most `AdapterSlots::MAX_NAMES` distinct non-empty names, waiting ones not loaded; the
/// slots only for an engine of one rank.
pub fn engine_metrics(data: &[u8]) {
    use kvroute_bridge::engine_http::vllm;
    use kvroute_common::messages::AdapterSlots;
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let page = vllm::parse_page(text);
    let _ = vllm::info(&page);
    let adapters = vllm::adapters(&page);
    if let Some(slots) = &adapters {
        for list in [&slots.loaded, &slots.waiting] {
            assert!(list.len() <= AdapterSlots::MAX_NAMES, "{slots:?}");
            assert!(
                list.iter().all(|n| !n.is_empty() && n.trim() == n),
                "{slots:?}"
            );
            let distinct: std::collections::BTreeSet<&String> = list.iter().collect();
            assert_eq!(distinct.len(), list.len(), "{slots:?}");
        }
        assert!(
            slots.waiting.iter().all(|n| !slots.loaded.contains(n)),
            "{slots:?}"
        );
    }
    let one = vllm::load(&page, &[0]);
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].1.adapters, adapters);
    for (_, load) in vllm::load(&page, &[0, 1, 7]) {
        assert!(
            load.adapters.is_none(),
            "a data-parallel engine's slots are mixed"
        );
        assert!(
            load.kv_usage.is_none_or(|u| (0.0..=1.0).contains(&u)),
            "{load:?}"
        );
    }
}

/// The gateway's reading of OpenAI /v1/completions and /v1/chat/completions bodies (the first
/// byte picks the API and whether kvroute's session headers are set from the input): a 400
/// ApiError or a parsed request true to the body.
pub fn gateway_openai(data: &[u8]) {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let api = if mode & 1 == 0 {
        Api::Completions
    } else {
        Api::Chat
    };
    let mut headers = HeaderMap::new();
    if mode & 2 != 0 {
        let take = body.len().min(usize::from(mode >> 3));
        if let Ok(v) = HeaderValue::from_bytes(&body[..take]) {
            headers.insert(SESSION_ID, v.clone());
            headers.insert(POLICY, v);
        }
        if mode & 4 != 0 {
            headers.insert(SESSION_FINAL, HeaderValue::from_static("true"));
        }
    }
    match Parsed::from_body(api, body, &headers) {
        Ok(parsed) => {
            assert!(!parsed.model.is_empty());
            assert_eq!(parsed.api, api);
            // What the gateway forwards when it rewrites the body is itself a request it reads
            // the same way (or, for a number beyond f64 in a field it skips, a 400).
            let body = match forwarded_body(body) {
                Ok(body) => body,
                Err(e) => {
                    assert!(e.status.is_client_error(), "{e:?}");
                    return;
                }
            };
            assert!(!body.contains_key("kvroute"));
            let forwarded = serde_json::to_vec(&body).expect("a JSON map serializes");
            let again = Parsed::from_body(api, &forwarded, &HeaderMap::new())
                .unwrap_or_else(|e| panic!("the forwarded body is refused: {e:?}"));
            assert!(!again.edited);
            assert_eq!(again.model, parsed.model);
            assert_eq!(again.prompts, parsed.prompts);
            assert_eq!(again.messages, parsed.messages);
            assert_eq!(again.stream, parsed.stream);
            assert_eq!(again.include_usage, parsed.include_usage);
            assert_eq!(again.max_tokens, parsed.max_tokens);
            assert_eq!(again.chat_options, parsed.chat_options);
        }
        Err(e) => assert!(e.status.is_client_error(), "{e:?}"),
    }
}

/// The gateway's reading of a /v1/select body (parse_body: JSON, the known fields and their
/// types, exactly one prompt field): a 400 ApiError or a body the rest of the handler takes.
pub fn gateway_select(data: &[u8]) {
    if let Err(e) = parse_body(data) {
        assert!(e.status.is_client_error(), "{e:?}");
    }
}

/// The radix index's snapshot restore. The input is tried as it is and with its XXH3-64
/// appended (the format's checksum), so mutations reach the body: a typed SnapshotError or an
/// index that answers queries, survives removing its workers, and whose own snapshot restores
/// to the same digest and bytes.
pub fn index_snapshot(data: &[u8]) {
    check_index_snapshot(data);
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&xxh3_64(data).to_le_bytes());
    check_index_snapshot(&sealed);
}

fn check_index_snapshot(bytes: &[u8]) {
    let Ok(index) = SharedIndex::restore(bytes) else {
        return;
    };
    let snapshot = index.snapshot();
    let again = SharedIndex::restore(&snapshot).expect("own snapshot restores");
    assert_eq!(again.digest(), index.digest());
    assert_eq!(again.snapshot(), snapshot);
    // The restored index is usable: a query over hashes found in the input, then every worker
    // leaves and the index is empty.
    let hashes: Vec<u64> = bytes
        .chunks_exact(8)
        .take(64)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let _ = index.find_matches(&hashes);
    for (worker, _) in index.workers() {
        index.remove_worker(worker);
    }
    assert!(index.is_empty(), "no worker left, yet entries remain");
}

fn fuzz_names() -> Names {
    Names::new(&Namespace::new("fuzz").expect("valid namespace"))
}

/// One message of the events stream as an indexer replica reads it: the first byte picks the
/// subject (the control subject, worker 7's events subject, or the input up to a newline);
/// decode_entry gives a typed BadEntry or an entry true to its subject; applying it to a
/// replica state never panics, and the state's snapshot restores to the same digest and bytes.
pub fn log_entry(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let names = fuzz_names();
    let (subject, payload) = match mode % 3 {
        0 => (names.kv_control(), rest),
        1 => (names.kv_events(7), rest),
        _ => {
            let cut = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            let payload = rest.get(cut + 1..).unwrap_or_default();
            (String::from_utf8_lossy(&rest[..cut]).into_owned(), payload)
        }
    };
    match decode_entry(&names, &subject, payload) {
        Ok(LogEntry::Events(batch)) => assert_eq!(subject, names.kv_events(batch.worker_id)),
        Ok(LogEntry::Control(_)) => assert_eq!(subject, names.kv_control()),
        Err(bad) => assert!(!bad.reason().is_empty()),
    }
    let mut state = ReplicaState::new(&names, IndexConfig::default());
    let report = state.apply(1, &subject, payload);
    assert_eq!(state.applied_seq(), 1);
    if report.bad.is_some() {
        assert_eq!(report.events_applied, 0);
    }
    let snapshot = state.snapshot();
    let restored = ReplicaState::restore(&names, &snapshot).expect("own snapshot restores");
    assert_eq!(restored.digest(), state.digest());
    assert_eq!(restored.snapshot(), snapshot);
}

/// ReplicaState::restore (an indexer replica's snapshot file, from the snapshot store): a typed
/// RestoreError or a state whose own snapshot restores to the same digest and bytes.
pub fn replica_state(data: &[u8]) {
    let names = fuzz_names();
    let Ok(state) = ReplicaState::restore(&names, data) else {
        return;
    };
    let snapshot = state.snapshot();
    let again = ReplicaState::restore(&names, &snapshot).expect("own snapshot restores");
    assert_eq!(again.digest(), state.digest());
    assert_eq!(again.applied_seq(), state.applied_seq());
    assert_eq!(again.snapshot(), snapshot);
}

/// SelectRequest as the router's intake reads it (decode, then the checks that need no worker
/// state): a typed rejection or a request that passes the checks and round-trips.
pub fn select_request(data: &[u8]) {
    let decoded = round_trip::<SelectRequest>(data);
    match parse(data) {
        Ok(request) => {
            assert_eq!(
                format!("{request:?}"),
                format!("{:?}", decoded.expect("parsed, so decoded"))
            );
            assert!(!request.model.is_empty());
            assert!(request.token_ids.is_some() != request.block_hashes.is_some());
            assert!(request.token_ids.as_ref().is_none_or(|t| !t.is_empty()));
            assert!(request.block_hashes.as_ref().is_none_or(|h| !h.is_empty()));
            if let Some(s) = &request.session {
                assert!(!s.id.is_empty() && s.id.len() <= MAX_SESSION_ID_BYTES);
            }
        }
        Err(rejected) => assert!(!rejected.message.is_empty()),
    }
}

/// ControlRecord (the events stream's control subject): typed error or round trip.
pub fn wire_control_record(data: &[u8]) {
    round_trip::<ControlRecord>(data);
}

/// Decision (kvroute.<ns>.decisions): typed error or round trip.
pub fn wire_decision(data: &[u8]) {
    round_trip::<Decision>(data);
}

/// GenerateRequest (a worker's request subject): typed error or round trip.
pub fn wire_generate_request(data: &[u8]) {
    round_trip::<GenerateRequest>(data);
}

/// IndexQuery (kvroute.<ns>.index.query): typed error or round trip.
pub fn wire_index_query(data: &[u8]) {
    round_trip::<IndexQuery>(data);
}

/// KvEventBatch (kvroute.<ns>.kv.events.<worker>): typed error or round trip; what the writer
/// stamps is readable by this build.
pub fn wire_kv_event_batch(data: &[u8]) {
    if let Some(batch) = round_trip::<KvEventBatch>(data) {
        assert!(KvEventBatch::required_version(&batch.events) <= SchemaVersion(2));
    }
}

/// The answers and records clients and routers decode (IndexQueryResponse, SelectResponse,
/// GenerateResponse, SessionBindingRecord, ReplicaStatus), chosen by the first byte: typed
/// error or round trip.
pub fn wire_replies(data: &[u8]) {
    let Some((&which, data)) = data.split_first() else {
        return;
    };
    match which % 5 {
        0 => drop(round_trip::<IndexQueryResponse>(data)),
        1 => drop(round_trip::<SelectResponse>(data)),
        2 => drop(round_trip::<GenerateResponse>(data)),
        3 => drop(round_trip::<SessionBindingRecord>(data)),
        _ => drop(round_trip::<ReplicaStatus>(data)),
    }
}

/// RequestLifecycle (kvroute.<ns>.lifecycle.<worker>): typed error or round trip.
pub fn wire_request_lifecycle(data: &[u8]) {
    round_trip::<RequestLifecycle>(data);
}

/// WorkerLoad (kvroute.<ns>.load.<worker>): typed error or round trip.
pub fn wire_worker_load(data: &[u8]) {
    round_trip::<WorkerLoad>(data);
}

/// A worker card as discovery reads it from etcd (key and value; the first input byte picks a
/// well-formed key for worker 7 or the input up to a newline as the key): decode_card gives a
/// typed Invalid event or a card whose id matches its key and that round-trips.
pub fn worker_card(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let names = fuzz_names();
    let (key, value) = if mode % 2 == 0 {
        (names.worker_key(7).into_bytes(), rest)
    } else {
        let cut = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        (
            rest[..cut].to_vec(),
            rest.get(cut + 1..).unwrap_or_default(),
        )
    };
    match decode_card(&names, &key, value) {
        Ok(card) => {
            // The key is exactly the card's key: one worker, one key.
            assert_eq!(key, names.worker_key(card.worker_id).into_bytes());
            round_trip::<WorkerCard>(value).expect("decoded once");
        }
        Err(event) => assert!(matches!(*event, WorkerEvent::Invalid { .. })),
    }
}
