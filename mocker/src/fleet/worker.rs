//! One simulated worker: an [`Engine`] behind a lock and the task that drives it in real time.
//!
//! The task submits each `GenerateRequest` at its arrival (simulated now), advances the engine
//! whenever a step is due, publishes the KV events of every advance *under the engine's lock*
//! (the same lock the resync snapshot takes, so a resync is a consistent point of the event
//! stream), and replies when a request finishes. Lifecycle events (`prefill_done`, a
//! `progress` per block of output, `finished`) and load reports go out as the engine produces
//! them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::{Message, Subject};
use futures::StreamExt;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    GenerateErrorCode, GenerateReply, GenerateRequest, GenerateResponse, KvEventData,
    LifecycleKind, RequestLifecycle, SchemaVersion, now_ms,
};
use kvroute_common::worker::{EventPublisher, ResyncSource, WorkerAgent};
use kvroute_common::{DpRank, Names, RequestId, WorkerId};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::metrics::FleetMetrics;
use super::request::{self, decode_error, submit_error};
use crate::engine::{Engine, EngineConfig, EngineOutput, TokenOutput};
use crate::realtime::{RealTimeEngine, sleep_until};
use crate::shared_store::SharedStore;

/// The data-parallel rank every simulated worker serves (one rank per worker).
const DP_RANK: DpRank = 0;

/// How a worker stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Cancel running requests (error replies), flush events, revoke the lease.
    Graceful,
    /// Like a crash: stop answering, keep the lease until it expires.
    Crash,
}

/// The engine and what is waiting for it; everything behind one lock.
#[derive(Debug)]
struct Core {
    engine: RealTimeEngine,
    pending: HashMap<RequestId, Pending>,
    /// Whether the worker publishes its KV events (not with `--no-kv-events`).
    kv_events: bool,
}

#[derive(Debug)]
struct Pending {
    reply: Option<Subject>,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// The engine as the resync responder sees it.
#[derive(Debug)]
pub(crate) struct SharedCore(Mutex<Core>);

impl SharedCore {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock would be a bug in the engine; keep serving anyway.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ResyncSource for SharedCore {
    fn resync(&self, publisher: &EventPublisher) {
        let core = self.lock();
        if !core.kv_events {
            return;
        }
        let mut events = vec![KvEventData::Cleared];
        events.extend(core.engine.engine().kv_snapshot());
        publisher.publish(DP_RANK, events);
    }
}

/// Settings every worker of the fleet shares.
#[derive(Debug, Clone)]
pub(crate) struct WorkerSettings {
    pub engine: EngineConfig,
    pub speedup: f64,
    pub load_interval: std::time::Duration,
    /// The process's shared tier, if it has one (locked inside the engine's lock, never the
    /// other way round).
    pub shared: Option<Arc<std::sync::Mutex<SharedStore>>>,
    /// Publish no load reports (`--no-load-reports`).
    pub no_load_reports: bool,
    /// Publish no KV events (`--no-kv-events`).
    pub no_kv_events: bool,
}

impl WorkerSettings {
    fn engine(&self) -> Engine {
        Engine::new(self.engine.clone())
            .expect("the fleet config was validated")
            .with_shared_writes(self.shared.is_some())
    }

    fn store(&self) -> Option<MutexGuard<'_, SharedStore>> {
        self.shared
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A running worker task.
#[derive(Debug)]
pub(crate) struct WorkerHandle {
    pub worker_id: WorkerId,
    pub registered: Arc<AtomicBool>,
    stop: Option<oneshot::Sender<StopMode>>,
    task: JoinHandle<()>,
}

impl WorkerHandle {
    /// Stops the worker and waits until it has (for `Graceful`: deregistered).
    pub async fn stop(mut self, mode: StopMode) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(mode);
        }
        let _ = (&mut self.task).await;
    }
}

pub(crate) fn new_core(settings: &WorkerSettings) -> Arc<SharedCore> {
    Arc::new(SharedCore(Mutex::new(Core {
        engine: RealTimeEngine::start(settings.engine(), settings.speedup),
        pending: HashMap::new(),
        kv_events: !settings.no_kv_events,
    })))
}

/// Subscribes and spawns the task of a worker whose agent is started.
pub(crate) async fn spawn(
    agent: WorkerAgent,
    core: Arc<SharedCore>,
    nats: async_nats::Client,
    names: &Names,
    settings: WorkerSettings,
    metrics: Arc<FleetMetrics>,
) -> anyhow::Result<WorkerHandle> {
    let worker_id = agent.card().worker_id;
    let requests = nats.subscribe(agent.card().request_subject.clone()).await?;
    let resets = nats.subscribe(names.worker_reset(worker_id)).await?;
    let registered = Arc::new(AtomicBool::new(agent.is_registered()));
    let (stop_tx, stop_rx) = oneshot::channel();
    let worker = Worker {
        worker_id,
        publisher: agent.publisher().clone(),
        agent,
        core,
        nats,
        settings,
        metrics,
        registered: registered.clone(),
        load_seq: 0,
        last_counts: None,
        new_requests: Vec::new(),
    };
    let task = tokio::spawn(worker.run(requests, resets, stop_rx));
    Ok(WorkerHandle {
        worker_id,
        registered,
        stop: Some(stop_tx),
        task,
    })
}

struct Worker {
    worker_id: WorkerId,
    agent: WorkerAgent,
    publisher: EventPublisher,
    core: Arc<SharedCore>,
    nats: async_nats::Client,
    settings: WorkerSettings,
    metrics: Arc<FleetMetrics>,
    registered: Arc<AtomicBool>,
    load_seq: u64,
    /// Request counts (running, waiting) of the last load report.
    last_counts: Option<(u64, u64)>,
    /// Requests taken since the last load report, which the next one names.
    new_requests: Vec<RequestId>,
}

/// A message to send once the engine's lock is released.
enum Outgoing {
    Reply(Subject, GenerateResponse),
    Lifecycle(RequestLifecycle),
}

impl Worker {
    async fn run(
        mut self,
        mut requests: async_nats::Subscriber,
        mut resets: async_nats::Subscriber,
        mut stop: oneshot::Receiver<StopMode>,
    ) {
        let mut load_tick = tokio::time::interval(self.settings.load_interval);
        load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // An ended subscription answers `None` at once on every poll: without this guard a
        // closed reset subscription would spin the loop.
        let mut resets_open = true;
        let mode = loop {
            let wake = {
                let core = self.core.lock();
                core.engine.wake_at()
            };
            let mut force_load = false;
            // Unbiased: a flood of requests must not starve timers, resets or the stop.
            tokio::select! {
                mode = &mut stop => break mode.unwrap_or(StopMode::Graceful),
                msg = requests.next() => match msg {
                    Some(msg) => self.on_request(msg).await,
                    None => break StopMode::Graceful,
                },
                msg = resets.next(), if resets_open => match msg {
                    Some(msg) => {
                        self.on_reset(msg).await;
                        force_load = true;
                    }
                    None => {
                        resets_open = false;
                        tracing::warn!(
                            worker_id = self.worker_id,
                            "the cache-reset subscription ended: resets are no longer served"
                        );
                    }
                },
                _ = sleep_until(wake) => {}
                _ = load_tick.tick() => {
                    force_load = true;
                    self.registered.store(self.agent.is_registered(), Ordering::Relaxed);
                }
            }
            self.advance().await;
            self.report_load(force_load).await;
        };
        match mode {
            StopMode::Graceful => {
                self.cancel_all("the worker is shutting down").await;
                self.registered.store(false, Ordering::Relaxed);
                self.agent.shutdown().await;
                tracing::info!(worker_id = self.worker_id, "worker stopped");
            }
            StopMode::Crash => {
                self.registered.store(false, Ordering::Relaxed);
                self.agent.abandon();
                tracing::warn!(worker_id = self.worker_id, "worker crashed (simulated)");
            }
        }
    }

    async fn on_request(&mut self, msg: Message) {
        self.metrics.requests_received.inc();
        let reply = msg.reply.clone();
        let refused = match decode::<GenerateRequest>(&msg.payload) {
            Err(e) => Some(decode_error(&e)),
            Ok(req) => {
                match request::to_sim_request(&req, self.settings.engine.block_size, DP_RANK) {
                    Err(e) => Some(e),
                    Ok(mut sim) => {
                        let mut core = self.core.lock();
                        if let Some(store) = self.settings.store() {
                            sim.shared_blocks = store.prefix(&sim.hashes);
                        }
                        let prompt_tokens = u64::from(sim.prompt_tokens);
                        match core.engine.submit(sim) {
                            Err(e) => Some(submit_error(&e)),
                            Ok(()) => {
                                self.new_requests.push(req.request_id);
                                core.pending.insert(
                                    req.request_id,
                                    Pending {
                                        reply,
                                        prompt_tokens,
                                        cached_tokens: 0,
                                    },
                                );
                                tracing::debug!(worker_id = self.worker_id, request_id = %req.request_id, "request queued");
                                None
                            }
                        }
                    }
                }
            }
        };
        if let Some(err) = refused {
            tracing::debug!(worker_id = self.worker_id, code = err.code.as_str(), error = %err.message, "request refused");
            self.metrics.requests_finished.inc(err.code.as_str());
            if let Some(reply) = msg.reply {
                self.send(Outgoing::Reply(reply, GenerateResponse::Error(err)))
                    .await;
            }
        }
    }

    /// Drops the cache and every running request, publishes `Cleared`, restarts the clock.
    async fn on_reset(&mut self, msg: Message) {
        self.metrics.resets.inc();
        self.cancel_all("the worker's cache was reset").await;
        {
            let mut core = self.core.lock();
            core.engine.restart(self.settings.engine());
            if let Some(mut store) = self.settings.store() {
                store.forget(self.worker_id);
            }
            if core.kv_events {
                self.publisher.publish(DP_RANK, vec![KvEventData::Cleared]);
                self.metrics.kv_events.inc();
            }
        }
        self.publisher.flush().await;
        tracing::info!(worker_id = self.worker_id, "cache reset");
        if let Some(reply) = msg.reply {
            let _ = self.nats.publish(reply, "ok".into()).await;
        }
    }

    /// Runs the engine up to now; publishes its events (under the lock), then its outputs.
    async fn advance(&mut self) {
        let outgoing = {
            let mut core = self.core.lock();
            let ready = core.engine.advance();
            let mut events = ready.kv_events;
            if let Some(mut store) = self.settings.store() {
                // Written through once computed, announced after the device blocks.
                for hashes in &ready.prefilled {
                    events.extend(store.write(self.worker_id, hashes));
                }
            }
            if !events.is_empty() && core.kv_events {
                self.metrics.kv_events.add(events.len() as u64);
                self.publisher.publish(DP_RANK, events);
            }
            let mut out = Vec::new();
            // Each block of output a request crosses, in time order with the other outputs
            // (at most one event per block; a request's progress never follows its finish).
            let mut progress = ready.progress.into_iter().peekable();
            for output in ready.outputs {
                while let Some(p) = progress.next_if(|p| p.at <= output.at()) {
                    out.push(self.progress(p));
                }
                self.on_output(&mut core, output, &mut out);
            }
            out.extend(progress.map(|p| self.progress(p)));
            out
        };
        for o in outgoing {
            self.send(o).await;
        }
    }

    fn progress(&self, token: TokenOutput) -> Outgoing {
        Outgoing::Lifecycle(RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id: token.request_id,
            worker_id: self.worker_id,
            dp_rank: DP_RANK,
            kind: LifecycleKind::Progress {
                output_tokens: token.generated,
            },
            ts: now_ms(),
        })
    }

    fn on_output(&self, core: &mut Core, output: EngineOutput, out: &mut Vec<Outgoing>) {
        let request_id = output.request_id();
        out.push(Outgoing::Lifecycle(RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id,
            worker_id: self.worker_id,
            dp_rank: DP_RANK,
            kind: output.lifecycle_kind(),
            ts: now_ms(),
        }));
        match output {
            EngineOutput::PrefillDone {
                cached_tokens,
                ttft,
                ..
            } => {
                self.metrics.ttft.observe(ttft.as_secs_f64());
                if let Some(p) = core.pending.get_mut(&request_id) {
                    p.cached_tokens = cached_tokens;
                }
            }
            EngineOutput::Finished {
                output_tokens,
                ttft,
                latency,
                ..
            } => {
                self.metrics.requests_finished.inc("ok");
                let Some(p) = core.pending.remove(&request_id) else {
                    return;
                };
                if let Some(reply) = p.reply {
                    let reply_msg = GenerateReply {
                        v: SchemaVersion::CURRENT,
                        request_id,
                        worker_id: self.worker_id,
                        dp_rank: DP_RANK,
                        ttft_ms: ttft.as_secs_f64() * 1e3,
                        latency_ms: latency.as_secs_f64() * 1e3,
                        prompt_tokens: p.prompt_tokens,
                        cached_tokens: p.cached_tokens,
                        output_tokens,
                    };
                    out.push(Outgoing::Reply(reply, GenerateResponse::Ok(reply_msg)));
                }
            }
        }
    }

    /// Answers every waiting request with `cancelled` (their engine is about to go away).
    async fn cancel_all(&mut self, why: &str) {
        let pending: Vec<(RequestId, Pending)> = self.core.lock().pending.drain().collect();
        for (request_id, p) in pending {
            self.metrics.requests_finished.inc("cancelled");
            if let Some(reply) = p.reply {
                let err = request::error(Some(request_id), GenerateErrorCode::Cancelled, why);
                self.send(Outgoing::Reply(reply, GenerateResponse::Error(err)))
                    .await;
            }
        }
    }

    async fn send(&self, o: Outgoing) {
        let result = match o {
            Outgoing::Reply(subject, response) => match encode(&response) {
                Ok(bytes) => self
                    .nats
                    .publish(subject, bytes)
                    .await
                    .map_err(anyhow::Error::from),
                Err(e) => Err(e.into()),
            },
            Outgoing::Lifecycle(event) => self.agent.publish_lifecycle(&event).await,
        };
        if let Err(e) = result {
            tracing::warn!(worker_id = self.worker_id, error = %e, "publishing to NATS failed");
        }
    }

    /// Publishes a load report when forced (periodic) or when the request counts changed.
    async fn report_load(&mut self, force: bool) {
        if self.settings.no_load_reports {
            return;
        }
        let (load, adapters) = {
            let core = self.core.lock();
            let counts = core.engine.engine().request_counts();
            if !force && self.last_counts == Some(counts) {
                return;
            }
            self.last_counts = Some(counts);
            (
                core.engine.engine().load(),
                core.engine.engine().adapter_slots(),
            )
        };
        self.load_seq += 1;
        let mut report = load.to_worker_load(
            self.worker_id,
            DP_RANK,
            self.load_seq,
            now_ms(),
            std::mem::take(&mut self.new_requests),
        );
        report.adapters = adapters;
        self.metrics.load_reports.inc();
        if let Err(e) = self.agent.publish_load(&report).await {
            tracing::warn!(worker_id = self.worker_id, error = %e, "publishing load failed");
        }
    }
}
