//! One engine's supervisor: probes `/health` every `--health-interval-ms` and applies the pure
//! rule of [`health`]; registers the engine (a `WorkerAgent` per registration, the relay
//! attached to its publisher) while it is healthy, and runs its load reports ([`load`]) and
//! request forwarding ([`requests`]) while registered; deregisters it after
//! `--health-failures` failed probes and on shutdown.

pub mod card;
pub mod health;
pub mod load;
pub mod report;
pub mod requests;
pub mod reset;
pub mod silence;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvroute_common::worker::{RegistrationConfig, WorkerAgent, WorkerAgentConfig};
use kvroute_common::{DpRank, Names};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::{BridgeArgs, EngineSpec};
use crate::engine_http::EngineClient;
use crate::metrics::{BridgeMetrics, names};
use crate::relay::Relay;
use health::{Action, HealthState};
use load::{Capacity, LoadSeqs, LoadTask};
use report::Reporter;
use requests::{RequestTask, RequestsHandle, Serving, StopMode};
use reset::ResetTask;

/// A read of the engine's LoRA adapters (`EngineClient::lora_adapters`).
type AdaptersRead = Result<Option<Vec<String>>, crate::engine_http::EngineError>;

/// How long a registration waits for the card to reach etcd before probing goes on.
const REGISTRATION_WAIT: Duration = Duration::from_secs(1);

/// The supervisor's timing (from [`BridgeArgs`]).
#[derive(Debug, Clone)]
pub struct SupervisorSettings {
    pub health_interval: Duration,
    /// How often a registered vLLM engine's adapters are read again.
    pub adapters_interval: Duration,
    pub health_failures: u32,
    pub load_interval: Duration,
    pub lease_ttl: Duration,
}

impl SupervisorSettings {
    pub fn from_args(args: &BridgeArgs) -> Self {
        Self {
            health_interval: args.health_interval(),
            adapters_interval: Duration::from_millis(args.adapters_interval_ms),
            health_failures: args.health_failures,
            load_interval: args.load_interval(),
            lease_ttl: args.lease_ttl(),
        }
    }
}

/// The connections and shared state every supervisor uses.
#[derive(Clone)]
pub struct Connections {
    pub nats: async_nats::Client,
    pub etcd: etcd_client::Client,
    pub names: Names,
    pub metrics: Arc<BridgeMetrics>,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

/// A running supervisor. [`EngineSupervisor::shutdown`] deregisters the engine.
#[derive(Debug)]
pub struct EngineSupervisor {
    label: String,
    registered: Arc<AtomicBool>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl EngineSupervisor {
    /// Starts supervising `spec`'s engine, whose relay serves `ranks`. `registered` follows
    /// whether the card is in etcd (for `/readyz`).
    pub fn start(
        spec: EngineSpec,
        ranks: Vec<DpRank>,
        client: EngineClient,
        relay: Relay,
        conn: Connections,
        settings: SupervisorSettings,
        registered: Arc<AtomicBool>,
    ) -> Self {
        let (stop, stop_rx) = oneshot::channel();
        let label = spec.label();
        let worker_id = spec.worker_id();
        let supervisor = Supervisor {
            label: label.clone(),
            seqs: Arc::new(LoadSeqs::new(&ranks)),
            reporter: Reporter::new(conn.nats.clone(), conn.names.clone(), worker_id),
            spec,
            ranks,
            client,
            relay,
            conn,
            settings,
            registered: registered.clone(),
            live: None,
            refusal: None,
            logged_unhealthy: false,
            warned_no_cache_report: Arc::new(AtomicBool::new(false)),
        };
        let task = tokio::spawn(supervisor.run(stop_rx));
        Self {
            label,
            registered,
            stop: Some(stop),
            task,
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
    }

    /// Stops probing, answers running requests `cancelled`, and deregisters (the card
    /// disappears at once).
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

/// What exists while the engine is registered.
struct Live {
    agent: WorkerAgent,
    load: JoinHandle<()>,
    resets: JoinHandle<()>,
    requests: RequestsHandle,
}

struct Supervisor {
    label: String,
    spec: EngineSpec,
    ranks: Vec<DpRank>,
    client: EngineClient,
    relay: Relay,
    conn: Connections,
    settings: SupervisorSettings,
    registered: Arc<AtomicBool>,
    seqs: Arc<LoadSeqs>,
    reporter: Reporter,
    live: Option<Live>,
    /// Why the last registration was refused (logged when it changes).
    refusal: Option<String>,
    /// A failed probe of the unregistered engine was logged (once until it registers).
    logged_unhealthy: bool,
    warned_no_cache_report: Arc<AtomicBool>,
}

impl Supervisor {
    async fn run(mut self, mut stop: oneshot::Receiver<()>) {
        let mut tick = tokio::time::interval(self.settings.health_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut adapters = tokio::time::interval(self.settings.adapters_interval);
        adapters.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut adapters_read: Option<JoinHandle<AdaptersRead>> = None;
        let mut state = HealthState::default();
        loop {
            let probe = tokio::select! {
                _ = &mut stop => break,
                _ = tick.tick() => tokio::select! {
                    _ = &mut stop => break,
                    probe = self.client.health() => probe,
                },
                // The adapters are read beside the probes (a frozen engine holds a read for
                // the engine timeout, which must not hold up the probes that notice it).
                _ = adapters.tick(), if adapters_read.is_none() => {
                    adapters_read = self.read_adapters();
                    continue;
                }
                read = async { adapters_read.as_mut().expect("a read").await }, if adapters_read.is_some() => {
                    adapters_read = None;
                    match read {
                        Ok(read) => self.apply_adapters(read),
                        Err(e) => tracing::warn!(engine = self.label, error = %e, "reading the engine's adapters panicked"),
                    }
                    continue;
                }
            };
            let outcome = if probe.is_ok() { "ok" } else { "failed" };
            self.conn
                .metrics
                .inc(names::HEALTH, &self.label, None, outcome);
            let (next, action) = health::step(state, probe.is_ok(), self.settings.health_failures);
            state = match action {
                Action::Nothing => next,
                Action::Register { was_down } => {
                    if self.register(was_down).await {
                        next
                    } else {
                        state.registration_failed()
                    }
                }
                Action::Deregister => {
                    let error = probe
                        .as_ref()
                        .err()
                        .map(|e| e.to_string())
                        .unwrap_or_default();
                    tracing::warn!(
                        engine = self.label,
                        failures = next.failures,
                        error,
                        "the engine failed its health probes: deregistering it"
                    );
                    self.deregister(StopMode::Drain).await;
                    next
                }
            };
            if let Err(e) = &probe {
                if state.registered {
                    tracing::debug!(engine = self.label, failures = state.failures, error = %e, "health probe failed");
                } else if !self.logged_unhealthy {
                    self.logged_unhealthy = true;
                    tracing::info!(engine = self.label, error = %e, "the engine is not healthy (yet): registering it when /health answers 200");
                }
            }
            self.update_registered();
        }
        if let Some(read) = adapters_read {
            read.abort();
        }
        self.deregister(StopMode::Cancel).await;
        tracing::info!(engine = self.label, "engine supervisor stopped");
    }

    /// Starts reading a registered vLLM engine's adapters again (`None`: not registered, or
    /// its adapters were not known at registration: SGLang, or an unreadable list).
    fn read_adapters(&self) -> Option<JoinHandle<AdaptersRead>> {
        let live = self.live.as_ref()?;
        live.agent.card().lora_adapters.as_ref()?;
        let client = self.client.clone();
        Some(tokio::spawn(async move { client.lora_adapters().await }))
    }

    /// Updates the card, under the same lease, when the engine's adapters changed (loaded or
    /// unloaded through its runtime API).
    fn apply_adapters(&mut self, read: AdaptersRead) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let read = match read {
            Ok(Some(read)) => card::card_adapters(Some(&read)),
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(engine = self.label, error = %e, "reading the engine's adapters failed");
                return;
            }
        };
        if live.agent.card().lora_adapters.is_none() || read == live.agent.card().lora_adapters {
            return;
        }
        let mut card = live.agent.card().clone();
        tracing::info!(
            engine = self.label,
            before = ?card.lora_adapters,
            now = ?read,
            "the engine's LoRA adapters changed: updating its card"
        );
        card.lora_adapters = read;
        if let Err(e) = live.agent.update_card(card) {
            tracing::warn!(engine = self.label, error = %e, "updating the card failed");
        }
    }

    fn update_registered(&self) {
        let registered = self.live.as_ref().is_some_and(|l| l.agent.is_registered());
        self.registered.store(registered, Ordering::Relaxed);
        self.conn.metrics.set(
            names::REGISTERED,
            &self.label,
            None,
            if registered { 1.0 } else { 0.0 },
        );
    }

    /// Registers the engine; false (logged) if it could not be.
    async fn register(&mut self, was_down: bool) -> bool {
        let info = match self.client.info().await {
            Ok(info) => info,
            Err(e) => {
                self.refused(format!("its facts could not be read: {e}"));
                return false;
            }
        };
        if let Some(dp) = info.dp_size
            && self.spec.dp_size.is_none()
            && dp as usize != self.ranks.len()
        {
            tracing::warn!(
                engine = self.label,
                engine_dp_size = dp,
                ranks = ?self.ranks,
                "the engine reports another data-parallel size than at startup; restart the bridge to follow it"
            );
        }
        let card = match card::build_card(&self.spec, &info, &self.ranks, &self.conn.names) {
            Ok(card) => card,
            Err(missing) => {
                let mut why = missing.to_string();
                if !info.problems.is_empty() {
                    why = format!("{why} (failed: {})", info.problems.join("; "));
                }
                self.refused(why);
                return false;
            }
        };
        let config = WorkerAgentConfig {
            registration: RegistrationConfig {
                lease_ttl: self.settings.lease_ttl,
                ..RegistrationConfig::default()
            },
            ..WorkerAgentConfig::default()
        };
        // Subscribe first: once the card is visible, requests may come.
        let requests = match self.conn.nats.subscribe(card.request_subject.clone()).await {
            Ok(s) => s,
            Err(e) => {
                self.refused(format!("subscribing to {}: {e}", card.request_subject));
                return false;
            }
        };
        let reset_subject = self.conn.names.worker_reset(card.worker_id);
        let resets = match self.conn.nats.subscribe(reset_subject.clone()).await {
            Ok(s) => s,
            Err(e) => {
                self.refused(format!("subscribing to {reset_subject}: {e}"));
                return false;
            }
        };
        let mut agent = match WorkerAgent::start(
            self.conn.nats.clone(),
            self.conn.etcd.clone(),
            &self.conn.names,
            card.clone(),
            config,
            self.relay.resync_source(),
        )
        .await
        {
            Ok(agent) => agent,
            Err(e) => {
                self.refused(format!(
                    "starting its worker agent: {}",
                    kvroute_common::error_chain::message(&e)
                ));
                return false;
            }
        };
        // The engine was deemed down: it may have restarted with an empty cache, or only been
        // too busy to answer its probes. The rank threads ask its replay socket (the mirror is
        // published meanwhile, and cleared if the engine is another incarnation).
        if was_down {
            self.relay.check_incarnation();
        }
        self.relay.attach(agent.publisher().clone());
        // The card is usually in etcd within milliseconds; while etcd is unreachable the agent
        // keeps trying in the background, and probing goes on.
        let _ = tokio::time::timeout(REGISTRATION_WAIT, agent.wait_registered()).await;
        let load = LoadTask {
            label: self.label.clone(),
            client: self.client.clone(),
            ranks: self.ranks.clone(),
            capacity: Capacity {
                block_size: card.block_size,
                total_kv_blocks: card.total_kv_blocks,
            },
            interval: self.settings.load_interval,
            relay: self.relay.clone(),
            events_endpoint: format!(
                "--zmq-endpoint {} (topic {:?})",
                self.spec.zmq_endpoint, self.spec.zmq_topic
            ),
            seqs: self.seqs.clone(),
            reporter: self.reporter.clone(),
            metrics: self.conn.metrics.clone(),
        };
        let requests = RequestTask {
            label: self.label.clone(),
            client: self.client.clone(),
            serving: Serving {
                model: card.model.clone(),
                ranks: self.ranks.clone(),
                block_size: card.block_size,
            },
            reporter: self.reporter.clone(),
            metrics: self.conn.metrics.clone(),
            warned_no_cache_report: self.warned_no_cache_report.clone(),
        }
        .spawn(requests);
        let resets = ResetTask {
            label: self.label.clone(),
            client: self.client.clone(),
            relay: self.relay.clone(),
            nats: self.conn.nats.clone(),
            metrics: self.conn.metrics.clone(),
        }
        .spawn(resets);
        self.live = Some(Live {
            agent,
            load: tokio::spawn(load.run()),
            resets,
            requests,
        });
        self.refusal = None;
        self.logged_unhealthy = false;
        self.conn.metrics.inc(
            names::REGISTRATIONS,
            &self.label,
            None,
            if was_down { "recovered" } else { "registered" },
        );
        tracing::info!(
            engine = self.label,
            worker_id = card.worker_id,
            model = card.model,
            block_size = card.block_size,
            total_kv_blocks = card.total_kv_blocks,
            dp_start_rank = card.dp_start_rank,
            dp_size = card.dp_size,
            software_version = card.software_version,
            was_down,
            "engine registered"
        );
        true
    }

    /// Logs at warn when the reason changes (a missing fact is logged once, not every probe).
    fn refused(&mut self, why: String) {
        self.conn
            .metrics
            .inc(names::REGISTRATIONS, &self.label, None, "refused");
        if self.refusal.as_deref() != Some(why.as_str()) {
            tracing::warn!(engine = self.label, "not registering the engine: {why}");
            self.refusal = Some(why);
        }
    }

    async fn deregister(&mut self, mode: StopMode) {
        let Some(live) = self.live.take() else {
            return;
        };
        self.relay.detach();
        live.load.abort();
        live.resets.abort();
        let requests = live.requests.stop(mode);
        if mode == StopMode::Cancel {
            let _ = requests.await;
        }
        live.agent.shutdown().await;
        self.conn
            .metrics
            .inc(names::REGISTRATIONS, &self.label, None, "deregistered");
        self.update_registered();
        tracing::info!(engine = self.label, "engine deregistered");
    }
}
