//! One routing mode of an offline simulation: a discrete-event loop over simulated time in
//! which the real components meet without NATS or etcd.
//!
//! - each worker is an [`Engine`] (the mocker's cache and batching model), of role aggregated,
//!   prefill or decode; a request is decided in the partition the router decides it in, and a
//!   paired one runs on two engines with a modelled KV transfer between them (`hops.rs`);
//! - its KV events reach one shared [`RadixIndex`] (the indexer's) after `event_delay`, unless
//!   it publishes none (`kv-approx`, `--no-kv-events-workers`: the routers' approximate caches
//!   then predict it);
//! - each router replica has its own [`LoadView`] (the router service's) and its own policy
//!   instance per partition (role), and decides through the router's selection machine (`kvroute_router::decide::selection`: the
//!   service's own code) with the index's overlap; arrivals go to the replicas in turn;
//! - a replica applies its own decision at once and the others' after `signal_delay`;
//!   lifecycle events (`progress` ones only when the routers track output blocks) and load
//!   reports (every `load_interval`, unless off) reach every replica after `signal_delay`;
//! - the replicas share one session table (the router's, over its in-memory store), as they
//!   share the sessions bucket, so a session's bindings follow the router's own rules (hard
//!   or soft affinity, the idle TTL on simulated time).
//!
//! Events at the same time run in the order they were scheduled, so a run is a pure function
//! of its inputs (the seed included); only the reported selection latency is wall time.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_common::hashing::BlockHashes;
use kvroute_common::messages::{
    AdapterSlots, Decision, KvEventData, LifecycleKind, RequestLifecycle, SchemaVersion,
    SelectRequest, WorkerCard, WorkerLoad, WorkerRole,
};
use kvroute_common::{Names, Namespace, RequestId};
use kvroute_indexer::index::{IndexConfig, RadixIndex};
use kvroute_mocker::engine::{Engine, EngineOutput, SimRequest};
use kvroute_mocker::shared_store::SharedStore;
use kvroute_router::decide::candidates::Partition;
use kvroute_router::decide::load_view::{LoadView, LoadViewConfig};
use kvroute_router::decide::prompt::{Prepared, Prompt};
use kvroute_router::decide::selection::{Context, Selection, Start};
use kvroute_router::decide::{Decided, NewDecision, Owned, PartitionPolicy, wire};
use kvroute_router::drive::{self, Ended};
use kvroute_router::pipeline::WorkerInputs;
use kvroute_router::registry::ResolvedPolicies;
use kvroute_router::select::{SelectFailure, SelectionSettings};
use kvroute_router::session::{MemSessionStore, SessionTable};
use kvroute_router::signals::SignalSnapshot;
use rand::SeedableRng;
use rand::rngs::StdRng;
use uuid::Uuid;

use crate::replay::{
    ModeRecorder, ModeReport, Plan, RequestSample, Summary, Tally, session_context,
};
use kvroute_router::policies::device_aware::DEVICE_LABEL;

mod hops;
mod outputs;
mod settings;

pub use settings::{SimSettings, sim_cards, slowed};

/// The model every simulated worker serves.
pub const SIM_MODEL: &str = "mock-model";

enum Event {
    Arrival(usize),
    /// An engine's step may end or start (stale when the engine rescheduled since).
    Wake(usize),
    LoadTick(usize),
    KvEvents(usize, Vec<KvEventData>),
    /// A decision reaching one replica.
    Decision(usize, Box<Decision>),
    Lifecycle(RequestLifecycle),
    Report(WorkerLoad),
    /// A paired request's KV reached its decode worker.
    Transferred(RequestId),
}

struct Scheduled {
    at: Duration,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed: the heap pops the earliest (then the first scheduled).
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// One router replica of the simulation: per partition (a role with workers), its policy and
/// its own load view.
struct SimRouter {
    partitions: BTreeMap<WorkerRole, SimPartition>,
}

struct SimPartition {
    policy: PartitionPolicy,
    view: LoadView,
}

struct SimWorker {
    card: WorkerCard,
    engine: Engine,
    /// The wake-up currently scheduled (others in the queue are stale).
    wake: Option<Duration>,
    report_seq: u64,
    /// Requests submitted since the last report, which the next one names.
    new_requests: Vec<Uuid>,
}

struct InFlight {
    /// The request's index in the plan.
    request: usize,
    /// The worker that computes the prompt (aggregated or prefill).
    worker: usize,
    /// A paired request's decode hop.
    decode: Option<Paired>,
    prompt_tokens: u64,
    /// Prompt tokens the prompt's worker found cached (known at its prefill done).
    cached_tokens: u64,
    selection: Duration,
    arrived: Duration,
    /// The client's first token (the streaming worker's prefill done).
    first_token: Option<Duration>,
    /// The stream's latest token, for the inter-token gaps.
    last_token: Option<Duration>,
}

/// A paired request's second hop.
struct Paired {
    /// The decode worker.
    worker: usize,
    /// The prompt's blocks, for the decode worker's submission.
    hashes: BlockHashes,
    /// When the prefill worker produced its one token.
    prefilled: Option<Duration>,
    transfer: Duration,
}

impl InFlight {
    /// The worker whose tokens the client receives.
    fn streams_from(&self) -> usize {
        self.decode.as_ref().map_or(self.worker, |d| d.worker)
    }
}

/// The world of one mode's run.
struct World<'a> {
    settings: &'a SimSettings,
    plan: &'a Plan,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    workers: Vec<SimWorker>,
    index: RadixIndex,
    /// The fleet's shared tier, if it has one.
    shared: Option<SharedStore>,
    replicas: Vec<SimRouter>,
    /// The fleet's partitions, one per role with workers.
    partitions: BTreeMap<WorkerRole, Arc<Partition>>,
    selection_settings: SelectionSettings,
    names: Names,
    /// The replicas' shared session bindings.
    sessions: SessionTable<MemSessionStore>,
    in_flight: HashMap<RequestId, InFlight>,
    recorder: ModeRecorder,
    tally: Tally,
    finished_at: Duration,
    /// Every inter-token gap of the completed requests, ms.
    itl_ms: Vec<f64>,
    /// The paired requests' figures.
    pairs: hops::PairTally,
}

/// Runs `plan` through a simulated fleet and router replicas under `settings.mode`;
/// `progress` sees the totals after every finished request.
pub fn simulate(
    plan: &Plan,
    settings: &SimSettings,
    policies: &ResolvedPolicies,
    mut progress: impl FnMut(&Tally),
) -> anyhow::Result<ModeReport> {
    let cards = sim_cards(&settings.engine, settings.fleet());
    let shared = settings.shared_cache_blocks > 0;
    let workers = cards
        .into_iter()
        .zip(0..)
        .map(|(mut card, i)| {
            let (engine, cpu) = settings.engine_of(i);
            if cpu {
                card.labels
                    .insert(DEVICE_LABEL.to_owned(), "cpu".to_owned());
            }
            card.role = settings.role_of(i);
            card.kv_events = settings.mode.kv_events() && i >= settings.no_kv_events_workers;
            SimWorker {
                card,
                engine: Engine::new(engine)
                    .expect("validated by the caller")
                    .with_shared_writes(shared),
                wake: None,
                report_seq: 0,
                new_requests: Vec::new(),
            }
        })
        .collect::<Vec<_>>();
    let mut partitions = BTreeMap::new();
    for w in &workers {
        partitions
            .entry(w.card.role)
            .or_insert_with(|| Partition {
                cards: Vec::new(),
                block_size: settings.engine.block_size,
            })
            .cards
            .push(w.card.clone());
    }
    let partitions: BTreeMap<WorkerRole, Arc<Partition>> = partitions
        .into_iter()
        .map(|(role, p)| (role, Arc::new(p)))
        .collect();
    let view_config = LoadViewConfig {
        report_interval_ms: millis(settings.report_covers),
        confirm_window_ms: millis(settings.prediction_confirm),
        prediction_max_age_ms: millis(settings.prediction_max_age),
        predicted_overlap_ttl_ms: millis(settings.predicted_overlap_ttl),
        approx_cache_ttl_ms: millis(settings.approx_cache_ttl),
        models: settings.load_models,
    };
    let replicas = (0..settings.routers.max(1))
        .map(|r| {
            let partitions = partitions
                .iter()
                .map(|(&role, partition)| {
                    // The decode hop runs the decode role's configured policy whatever the
                    // mode (as the service: a request's `policy` names its first hop's).
                    let policy = match role {
                        WorkerRole::Decode => policies.build(role, SIM_MODEL)?,
                        _ => settings.mode.build_policy_for(policies, role, SIM_MODEL)?,
                    };
                    // The aggregated partition keeps the stream it always had.
                    let stream = match role {
                        WorkerRole::Aggregated => 0,
                        WorkerRole::Prefill => 1,
                        _ => 2,
                    };
                    let seed = settings.seed ^ (u64::from(r) << 32) ^ (stream << 48);
                    let mut view = LoadView::new(view_config);
                    view.set_workers(partition.cards.iter());
                    let policy = PartitionPolicy::new(
                        policy,
                        StdRng::seed_from_u64(seed),
                        &selection_settings(settings),
                    );
                    Ok((role, SimPartition { policy, view }))
                })
                .collect::<anyhow::Result<_>>()?;
            Ok(SimRouter { partitions })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut world = World {
        settings,
        plan,
        queue: BinaryHeap::new(),
        seq: 0,
        // A request counts on the worker that computes its prompt (a decode worker does not).
        recorder: ModeRecorder::new(
            settings.mode.as_str(),
            workers
                .iter()
                .filter(|w| w.card.role != WorkerRole::Decode)
                .map(|w| w.card.worker_id),
        )
        .with_sessions(plan.sessions.clone(), settings.send_sessions),
        partitions,
        selection_settings: selection_settings(settings),
        names: Names::new(&Namespace::new("sim").expect("a valid namespace")),
        workers,
        index: RadixIndex::new(IndexConfig::default()),
        shared: shared.then(|| SharedStore::new(settings.shared_cache_blocks as usize)),
        replicas,
        sessions: SessionTable::new(MemSessionStore::new(), settings.sessions),
        in_flight: HashMap::new(),
        tally: Tally {
            total: plan.len() as u64,
            ..Tally::default()
        },
        finished_at: Duration::ZERO,
        itl_ms: Vec::new(),
        pairs: hops::PairTally::default(),
    };
    for (i, &at) in plan.arrivals.iter().enumerate() {
        world.schedule(at, Event::Arrival(i));
    }
    for w in (0..world.workers.len()).filter(|_| settings.load_reports) {
        // Staggered like real workers' timers.
        let offset = settings
            .load_interval
            .mul_f64(w as f64 / world.workers.len() as f64);
        world.schedule(offset, Event::LoadTick(w));
    }
    while let Some(Scheduled { at, event, .. }) = world.queue.pop() {
        if world.handle(at, event) {
            progress(&world.tally);
        }
        if world.tally.done + world.tally.errors == world.tally.total {
            break;
        }
    }
    let mut report = world.recorder.finish(world.finished_at);
    report.itl_ms = Some(Summary::of(&world.itl_ms));
    report.disaggregation = world.pairs.report(settings);
    if settings.engine.max_loras > 0 {
        report.adapter_loads = Some(world.workers.iter().map(|w| w.engine.adapter_loads()).sum());
    }
    Ok(report)
}

fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl World<'_> {
    fn schedule(&mut self, at: Duration, event: Event) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            event,
        });
    }

    /// Handles one event; true when a request finished or failed.
    fn handle(&mut self, now: Duration, event: Event) -> bool {
        match event {
            Event::Arrival(i) => return self.arrive(now, i),
            Event::Wake(w) => {
                if self.workers[w].wake == Some(now) {
                    self.workers[w].wake = None;
                    return self.advance(w, now);
                }
            }
            Event::LoadTick(w) => {
                let done = self.advance(w, now);
                let worker = &mut self.workers[w];
                worker.report_seq += 1;
                let mut report = worker.engine.load().to_worker_load(
                    worker.card.worker_id,
                    0,
                    worker.report_seq,
                    millis(now),
                    std::mem::take(&mut worker.new_requests),
                );
                report.adapters = worker.engine.adapter_slots();
                if self.settings.running_adapters_only
                    && let Some(slots) = report.adapters.as_mut()
                {
                    // vLLM's gauge: running requests' adapters only.
                    slots.loaded = worker.engine.running_adapters();
                    slots.loaded.truncate(AdapterSlots::MAX_NAMES);
                    slots.waiting.retain(|a| !slots.loaded.contains(a));
                }
                self.schedule(now + self.settings.signal_delay, Event::Report(report));
                self.schedule(now + self.settings.load_interval, Event::LoadTick(w));
                return done;
            }
            // A worker without KV events publishes none: the index never learns its cache.
            Event::KvEvents(w, _) if !self.workers[w].card.kv_events => {}
            Event::KvEvents(w, events) => {
                let worker_id = self.workers[w].card.worker_id;
                for event in &events {
                    // The engine's events are well formed; a refusal would be a bug there,
                    // and the index stays consistent either way.
                    let _ = self.index.apply(worker_id, 0, event);
                }
            }
            Event::Decision(r, decision) => {
                // As the service: a paired decision charges the decode worker too.
                let partitions = &mut self.replicas[r].partitions;
                if let Some(decode) = wire::decode_half(&decision)
                    && let Some(p) = partitions.get_mut(&decode.role)
                {
                    p.view.apply_decision(&decode, millis(now));
                }
                if let Some(p) = partitions.get_mut(&decision.role) {
                    p.view.apply_decision(&decision, millis(now));
                }
            }
            Event::Lifecycle(event) => {
                let role = self.role_of_worker(event.worker_id);
                for replica in &mut self.replicas {
                    if let Some(p) = replica.partitions.get_mut(&role) {
                        p.view.apply_lifecycle(&event, millis(now));
                    }
                }
            }
            Event::Report(report) => {
                let role = self.role_of_worker(report.worker_id);
                for replica in &mut self.replicas {
                    if let Some(p) = replica.partitions.get_mut(&role) {
                        p.view.apply_report(&report, millis(now));
                    }
                }
            }
            Event::Transferred(request_id) => return self.start_decode(now, request_id),
        }
        false
    }

    /// The role of the worker with id `worker_id` (ids are 1-based positions).
    fn role_of_worker(&self, worker_id: u64) -> WorkerRole {
        self.workers[(worker_id - 1) as usize].card.role
    }

    /// Runs the router's selection machine over `prepared`'s partition in replica `r`, as the
    /// service does (overlap from the index, the session table), charging its view.
    fn select(
        &mut self,
        r: usize,
        prepared: &Prepared,
        decision_id: Uuid,
        now: Duration,
    ) -> Result<Box<NewDecision>, SelectFailure> {
        let router_id = format!("sim-router-{r}");
        let context = Context {
            settings: &self.selection_settings,
            names: &self.names,
            router_id: &router_id,
            sessions: *self.sessions.config(),
        };
        let part = self.replicas[r]
            .partitions
            .get_mut(&prepared.request.role)
            .expect("a request is decided in a partition the fleet has");
        let start = Start {
            decision_id,
            reads_cache: part.policy.inputs.contains(WorkerInputs::CACHE),
            overlap: None,
            target: None,
            queues: false,
        };
        let mut state = Owned {
            policy: &mut part.policy,
            view: &mut part.view,
            now_ms: millis(now),
        };
        let (selection, need) = Selection::start(prepared, context, start, &mut state);
        let index = &self.index;
        let overlap =
            || SignalSnapshot::from_matches(&index.find_matches(&prepared.prompt.hashes).matches);
        match drive::now(selection, need, &mut state, self.sessions.store(), overlap) {
            Ended::Reply(Ok(Decided::New(new))) => Ok(new),
            Ended::Reply(Ok(other)) => {
                unreachable!("a fresh request id with no deadline: {other:?}")
            }
            Ended::Reply(Err(e)) => Err(e),
            Ended::Join(_) => unreachable!("the simulator queues nothing"),
        }
    }

    /// A request arrives at a router replica, is placed (and paired) and submitted to the
    /// worker that computes its prompt.
    fn arrive(&mut self, now: Duration, i: usize) -> bool {
        let trace = &self.plan.requests[i];
        let tokens = trace.tokens();
        let block_size = self.settings.engine.block_size;
        let hashes =
            BlockHashes::of_tokens(&tokens, block_size as usize, trace.lora_name.as_deref());
        let request_id = Uuid::from_u128(i as u128 + 1);
        let (role, pair) = self.plan_hops();
        let request = SelectRequest {
            request_id: Some(request_id),
            model: SIM_MODEL.to_owned(),
            role,
            lora_name: trace.lora_name.clone(),
            expected_output_tokens: Some(trace.output_length),
            session: if self.settings.send_sessions {
                // Every mode has its own session table: no scope needed.
                session_context(trace, "")
            } else {
                None
            },
            ..SelectRequest::default()
        };
        let output_tokens = trace.output_length;
        let r = i % self.replicas.len();
        let started = Instant::now();
        // The simulator's prompt counts the blocks of all its tokens (not the service's N − 1).
        let prompt = Prompt {
            hashes: hashes.local.clone(),
            tokens: tokens.len() as u64,
        };
        let partition = self.partitions[&role].clone();
        let mut prepared = Prepared::with_prompt(request, request_id, partition, prompt);
        prepared.pair = pair;
        let decision_id = Uuid::from_u128((i as u128 + 1) << 64);
        let mut new = match self.select(r, &prepared, decision_id, now) {
            Ok(new) => new,
            Err(e) => {
                self.tally.errors += 1;
                self.recorder.record_error(&format!("select_{e}"));
                return true;
            }
        };
        let decode = match pair {
            Some(mode) => self.pair(r, mode, &prepared, &mut new, now),
            None => None,
        };
        let selection_latency = started.elapsed();
        let w = self.worker_index(new.selection.worker.worker_id);
        let decision = new.decision;
        // The deciding replica charged it; the others see it after the signal delay.
        for other in (0..self.replicas.len()).filter(|&o| o != r) {
            let at = now + self.settings.signal_delay;
            self.schedule(at, Event::Decision(other, Box::new(decision.clone())));
        }
        let paired = decode.map(|worker| Paired {
            worker,
            hashes: hashes.clone(),
            prefilled: None,
            transfer: Duration::ZERO,
        });
        let sim = SimRequest {
            request_id,
            prompt_tokens: tokens.len() as u32,
            // A prefill worker's request of a pair yields one token, which the client never sees
            // (vLLM's `max_tokens: 1` prefill).
            output_tokens: if paired.is_some() { 1 } else { output_tokens },
            shared_blocks: self.shared.as_ref().map_or(0, |s| s.prefix(&hashes)),
            hashes,
            report_tokens: paired.is_none(),
            transferred_tokens: 0,
            lora_name: trace.lora_name.clone(),
        };
        if let Err(e) = self.workers[w].engine.submit(sim, now) {
            tracing::debug!(error = %e, "the simulated worker refused a request");
            self.tally.errors += 1;
            self.recorder.record_error("worker_refused");
            return true;
        }
        self.workers[w].new_requests.push(request_id);
        self.in_flight.insert(
            request_id,
            InFlight {
                request: i,
                worker: w,
                decode: paired,
                prompt_tokens: tokens.len() as u64,
                cached_tokens: 0,
                selection: selection_latency,
                arrived: now,
                first_token: None,
                last_token: None,
            },
        );
        self.advance(w, now)
    }

    /// The position of the worker with id `worker_id` (a worker the core picked).
    fn worker_index(&self, worker_id: u64) -> usize {
        self.workers
            .iter()
            .position(|w| w.card.worker_id == worker_id)
            .expect("the core picks a registered worker")
    }
}

/// The routers' selection settings: the defaults, with the run's adapter placement.
fn selection_settings(settings: &SimSettings) -> SelectionSettings {
    SelectionSettings {
        adapter_placement: settings.adapter_placement,
        ..SelectionSettings::default()
    }
}
