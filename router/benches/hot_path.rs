//! The CPU of one selection without the network: the steps `service::selection` runs for a
//! request, in the same order and through the same functions — decode the `SelectRequest`,
//! look the partition up, hash the prompt, match it against a local index (64 documents of
//! 8,192 tokens, each held by one worker, as in `kvroute-router-bench`), then the decision
//! core's selection machine run to its end (load signals, predicted overlap, default policy, no session, the
//! decision built and charged), encode the reply and the decision, and decode and apply the
//! decision again as the feed does with its own echo. Deterministic, for instruction counts under callgrind:
//!
//! ```text
//! cargo bench -p kvroute-router --bench hot_path --no-run
//! valgrind --tool=callgrind --toggle-collect='hot_path::measured' target/release/deps/hot_path-<hash> --workers 16
//! ```
//!
//! Without valgrind it prints the wall-clock time per selection (noisy on a shared machine).

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a benchmark measures wall time"
)]

use std::hint::black_box;
use std::sync::RwLock;
use std::time::Instant;

use kvroute_common::codec::{decode, encode};
use kvroute_common::discovery::WorkerEvent;
use kvroute_common::hashing::{local_block_hashes, seed_for_lora, sequence_hashes};
use kvroute_common::messages::{
    Decision, KvEvent, KvEventBatch, KvEventData, SchemaVersion, SelectRequest, SelectResponse,
    StorageTier, StoredBlock, WorkerCard, WorkerRole, now_ms,
};
use kvroute_common::{Names, Namespace};
use kvroute_indexer::index::{IndexConfig, SharedIndex};
use kvroute_router::decide::candidates::Candidates;
use kvroute_router::decide::load_view::{LoadView, LoadViewConfig};
use kvroute_router::decide::prompt::Prepared;
use kvroute_router::decide::selection::{Context, Selection, Start};
use kvroute_router::decide::{Decided, Owned, PartitionPolicy};
use kvroute_router::drive::{self, Ended};
use kvroute_router::policies::default::DefaultPolicyParameters;
use kvroute_router::select::SelectionSettings;
use kvroute_router::service::intake;
use kvroute_router::service::metrics::RouterMetrics;
use kvroute_router::session::{MemSessionStore, SessionConfig, SessionTable};
use kvroute_router::signals::SignalSnapshot;
use rand::SeedableRng;
use rand::rngs::StdRng;
use uuid::Uuid;

const DOCUMENTS: u32 = 64;
const BLOCK_SIZE: u32 = 16;
const MODEL: &str = "bench";

struct Args {
    workers: u64,
    selections: usize,
    warmup: usize,
    prompt_tokens: u32,
}

fn args() -> Args {
    let mut args = Args {
        workers: 16,
        selections: 2000,
        warmup: 2000,
        prompt_tokens: 8192,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{flag} needs a number"))
        };
        match flag.as_str() {
            "--workers" => args.workers = value(),
            "--selections" => args.selections = value() as usize,
            "--warmup" => args.warmup = value() as usize,
            "--prompt-tokens" => args.prompt_tokens = value() as u32,
            // `cargo bench` passes `--bench`.
            _ => {}
        }
    }
    args
}

fn document(doc: u32, tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| doc * 1_000_000 + i).collect()
}

fn card(worker_id: u64) -> WorkerCard {
    WorkerCard {
        v: SchemaVersion::CURRENT,
        worker_id,
        model: MODEL.into(),
        role: WorkerRole::Aggregated,
        block_size: BLOCK_SIZE,
        total_kv_blocks: 100_000,
        max_num_batched_tokens: 8192,
        dp_start_rank: 0,
        dp_size: 1,
        taints: vec![],
        labels: Default::default(),
        request_subject: format!("kvroute.bench.worker.{worker_id}.requests"),
        software_version: "sim".into(),
        http_url: None,
        kv_events: true,
        lora_adapters: None,
    }
}

/// The router's state for one fleet.
struct Bench {
    candidates: RwLock<Candidates>,
    index: SharedIndex,
    load: std::sync::Mutex<LoadView>,
    sessions: SessionTable<MemSessionStore>,
    policy: std::sync::Mutex<PartitionPolicy>,
    settings: SelectionSettings,
    names: Names,
    metrics: RouterMetrics,
    payloads: Vec<bytes::Bytes>,
}

impl Bench {
    fn new(args: &Args) -> Self {
        let mut candidates = Candidates::new();
        candidates.apply(WorkerEvent::Snapshot {
            cards: (1..=args.workers).map(card).collect(),
            revision: 1,
        });
        let index = SharedIndex::new(IndexConfig::default());
        let seed = seed_for_lora(None);
        let mut next_event = std::collections::HashMap::new();
        for doc in 0..DOCUMENTS {
            let worker = u64::from(doc) % args.workers + 1;
            let local = local_block_hashes(
                &document(doc, args.prompt_tokens),
                BLOCK_SIZE as usize,
                seed,
            );
            let seq = sequence_hashes(&local, seed);
            let event_id = next_event.entry(worker).or_insert(0u64);
            let blocks = local
                .iter()
                .zip(&seq)
                .map(|(l, s)| StoredBlock {
                    block_hash: *s,
                    tokens_hash: *l,
                })
                .collect();
            let batch = KvEventBatch {
                v: SchemaVersion::CURRENT,
                worker_id: worker,
                dp_rank: 0,
                events: vec![KvEvent {
                    event_id: *event_id,
                    data: KvEventData::Stored {
                        parent_hash: None,
                        blocks,
                        tier: StorageTier::Device,
                    },
                }],
                ts: 0,
            };
            *event_id += 1;
            index.apply_batch(&batch);
        }
        let payloads = (0..DOCUMENTS)
            .map(|doc| {
                encode(&SelectRequest {
                    model: MODEL.into(),
                    token_ids: Some(document(doc, args.prompt_tokens)),
                    ..SelectRequest::default()
                })
                .expect("encode")
            })
            .collect();
        Self {
            candidates: RwLock::new(candidates),
            index,
            load: std::sync::Mutex::new(LoadView::new(LoadViewConfig {
                report_interval_ms: 1000,
                confirm_window_ms: 2000,
                prediction_max_age_ms: 600_000,
                predicted_overlap_ttl_ms: 2_000,
                approx_cache_ttl_ms: 120_000,
                models: Default::default(),
            })),
            sessions: SessionTable::new(MemSessionStore::new(), SessionConfig::default()),
            policy: std::sync::Mutex::new(PartitionPolicy::new(
                DefaultPolicyParameters::default().policy(),
                StdRng::seed_from_u64(1),
                &SelectionSettings::default(),
            )),
            settings: SelectionSettings::default(),
            names: Names::new(&Namespace::new("bench").expect("a namespace")),
            metrics: RouterMetrics::new(),
            payloads,
        }
    }

    /// One request, as `Router::respond` and `Router::choose` run it; returns the reply and
    /// decision bytes.
    fn selection(&mut self, payload: &[u8]) -> (bytes::Bytes, bytes::Bytes) {
        let request = intake::parse(payload).expect("parse");
        let request_id = request.request_id.unwrap_or_else(Uuid::new_v4);
        let partition = self
            .candidates
            .read()
            .unwrap()
            .partition(&request.model, request.role)
            .expect("partition");
        let prepared = Prepared::new(request, request_id, partition).expect("prompt");
        let prompt = &prepared.prompt;
        let index = self.index.clone();
        let context = Context {
            settings: &self.settings,
            names: &self.names,
            router_id: "bench",
            sessions: *self.sessions.config(),
        };
        let start = Start {
            decision_id: Uuid::new_v4(),
            reads_cache: true,
            overlap: None,
            target: None,
            queues: false,
        };
        let decided = {
            let mut policy = self.policy.lock().unwrap();
            let mut view = self.load.lock().unwrap();
            let mut state = Owned {
                policy: &mut policy,
                view: &mut view,
                now_ms: now_ms(),
            };
            let (selection, need) = Selection::start(&prepared, context, start, &mut state);
            let overlap =
                || SignalSnapshot::from_matches(&index.find_matches(&prompt.hashes).matches);
            match drive::now(selection, need, &mut state, self.sessions.store(), overlap) {
                Ended::Reply(decided) => decided.expect("decide"),
                Ended::Join(_) => panic!("nothing queues here"),
            }
        };
        let Decided::New(new) = decided else {
            panic!("a fresh request gets a new decision");
        };
        let m = &self.metrics;
        m.decisions_applied.inc();
        m.decisions.inc(&new.selection.worker.to_string());
        m.request_blocks.add(u64::from(prompt.blocks()));
        m.overlap_blocks.add(u64::from(new.decision.overlap_blocks));
        let reply = new.reply.clone();
        let decision = new.decision;
        let reply_bytes = encode(&SelectResponse::Ok(reply)).expect("encode reply");
        let decision_bytes = encode(&decision).expect("encode decision");
        // The feed: every replica decodes every decision, this one's own echo included.
        let echoed: Decision = decode(&decision_bytes).expect("decode decision");
        self.load.lock().unwrap().apply_decision(&echoed, now_ms());
        (reply_bytes, decision_bytes)
    }
}

#[inline(never)]
fn measured(bench: &mut Bench, selections: usize, offset: usize) {
    for i in 0..selections {
        let payload = bench.payloads[((offset + i) * 7) % bench.payloads.len()].clone();
        black_box(bench.selection(&payload));
    }
}

fn main() {
    let args = args();
    let mut bench = Bench::new(&args);
    // The warm-up runs here, outside the function callgrind collects (a second function
    // with the same body would be merged with `measured` by the compiler).
    for i in 0..args.warmup {
        let payload = bench.payloads[(i * 7) % bench.payloads.len()].clone();
        black_box(bench.selection(&payload));
    }
    let started = Instant::now();
    measured(&mut bench, args.selections, args.warmup);
    let elapsed = started.elapsed();
    println!(
        "{} workers, {} selections after {} warm-up: {:.1} µs per selection",
        args.workers,
        args.selections,
        args.warmup,
        elapsed.as_secs_f64() * 1e6 / args.selections as f64
    );
}
