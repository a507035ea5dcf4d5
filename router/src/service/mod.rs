//! The router process around the decision core ([`crate::decide`]). Modules follow a
//! request: [`intake`] (queue group, decoding) → the core's candidates (etcd workers by model
//! and role, kept current by [`feeds`]) → [`overlap`] (indexer query or local replica) → the
//! core's selection machine (run by `crate::drive`) over the load view (reports +
//! predictions, fed by [`feeds`]) with [`sessions_kv`] → [`reply`] (the published decision,
//! then the answer). This module holds only
//! I/O: intake, reply, overlap, sessions_kv and feeds touch the network.

mod admission;
mod classifying;
pub mod config;
mod feeds;
mod http;
pub mod intake;
pub mod load_models;
mod load_views;
pub mod metrics;
pub mod overlap;
mod pairing;
mod peers;
mod policies;
pub mod reply;
mod selection;
pub mod sessions_kv;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvroute_common::discovery::watch_workers;
use kvroute_common::jetstream::require_jetstream;
use kvroute_common::names::Names;
use kvroute_common::ops::{InFlight, spawn_watchdog, watchdog_observer};
use kvroute_indexer::service::{IndexFollower, IndexFollowerConfig};

pub use self::config::{OverlapMode, RouterConfig};
use self::load_views::LoadViews;
use self::metrics::RouterMetrics;
use self::overlap::OverlapSource;
use self::policies::{Policies, PolicySlot};
use self::sessions_kv::{BucketConfig, KvSessionStore};
use crate::decide::candidates::Candidates;
use crate::decide::load_view::LoadViewConfig;
use crate::registry::{
    ConfigError as PolicyConfigError, DisaggregationConfig, PolicyFileError, RouterPluginRegistry,
    RouterPlugins, RouterPluginsConfig,
};
use crate::select::SelectionSettings;
use crate::session::SessionTable;

/// Why the router could not start; each names what is wrong and where it came from.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Config(#[from] kvroute_common::config::ConfigError),
    /// The policy file cannot be used; `flag` is `--policy-config` or its variable.
    #[error("{flag} {path}: {source}")]
    PolicyFile {
        flag: String,
        path: String,
        source: Box<PolicyFileError>,
    },
    /// A selection given by a flag or variable (the message names which).
    #[error("{0}")]
    Policy(Box<PolicyConfigError>),
}

/// The checked configuration with the plugins resolved: everything that can fail before
/// connecting to anything.
#[derive(Debug)]
pub struct Prepared {
    config: RouterConfig,
    plugins: RouterPlugins,
}

impl Prepared {
    /// Validates `config` and resolves every role's policy and the request classifier against
    /// `registry` (unknown types, duplicate instances and bad parameters stop here).
    pub fn new(
        config: RouterConfig,
        registry: &RouterPluginRegistry,
    ) -> Result<Self, StartupError> {
        config.validate().map_err(|e| config.origins.attribute(e))?;
        let file_error = |source: PolicyFileError| StartupError::PolicyFile {
            flag: config.origins.label("policy-config"),
            path: config
                .policy_config
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            source: Box::new(source),
        };
        let yaml = match &config.policy_config {
            Some(path) => RouterPluginsConfig::from_file(path).map_err(file_error)?,
            None => RouterPluginsConfig::default(),
        };
        let plugins = registry
            .resolve_plugins(&yaml, &config.policy_overrides())
            .map_err(|e| {
                if e.in_file() && config.policy_config.is_some() {
                    file_error(PolicyFileError::Content(e))
                } else {
                    StartupError::Policy(Box::new(e))
                }
            })?;
        Ok(Self { config, plugins })
    }

    /// The resolved worker-selection policies and request classifier.
    pub fn plugins(&self) -> &RouterPlugins {
        &self.plugins
    }
}

/// One router replica's state, shared by the request tasks, the feeds and the HTTP handler.
pub struct Router {
    router_id: String,
    names: Names,
    nats: async_nats::Client,
    decisions_subject: String,
    candidates: RwLock<Candidates>,
    /// The worker watch delivered its first snapshot.
    loaded: AtomicBool,
    /// In the select queue group (subscribed, and the server has the subscription).
    serving: AtomicBool,
    /// One load view per partition.
    load: LoadViews,
    overlap: OverlapSource,
    sessions: SessionTable<KvSessionStore>,
    policies: Policies,
    settings: SelectionSettings,
    metrics: RouterMetrics,
    max_in_flight: usize,
    /// The serving replicas registered in etcd; `None` when this replica decides everything
    /// itself (`--no-partition-owner`).
    peers: Option<tokio::sync::watch::Receiver<peers::PeerSet>>,
    forward_timeout: Duration,
    admission: admission::Admission,
    prediction_max_age_ms: u64,
    disaggregation: DisaggregationConfig,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("router_id", &self.router_id)
            .finish_non_exhaustive()
    }
}

impl Router {
    /// Ready to answer: workers loaded and, in local mode, the replica caught up.
    pub fn is_ready(&self) -> bool {
        self.loaded.load(Ordering::Acquire) && self.overlap.is_ready()
    }

    /// In the select queue group: ready and keeping up (what `/readyz` reports).
    pub fn is_serving(&self) -> bool {
        self.is_ready() && self.serving.load(Ordering::Acquire)
    }
}

/// Runs a router replica until `shutdown` resolves. The binary passes the registry (built-ins
/// plus whatever catalogs it links).
pub async fn run(
    prepared: Prepared,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let Prepared { config, plugins } = prepared;
    let policies = plugins.policies.clone();
    let router_id = config.router_id();
    let names = Names::new(&config.namespace.namespace);
    let (nats, connection_events) = config.nats.connect_observed(&router_id).await?;
    let js = require_jetstream(&nats, &config.nats.urls.join(",")).await?;
    let etcd = config.etcd.connect().await?;
    let sessions_config = config.sessions();
    let store = KvSessionStore::open(
        &js,
        &names,
        BucketConfig {
            idle_ttl: Duration::from_millis(sessions_config.idle_ttl_ms),
            replicas: config.session_bucket_replicas,
        },
    )
    .await?;
    let (overlap, replica_task) = match config.overlap_mode {
        OverlapMode::Remote => (
            OverlapSource::remote(nats.clone(), &names, config.index_query_policy()),
            None,
        ),
        OverlapMode::Local => {
            let (replica, task) = IndexFollower::start(
                nats.clone(),
                &names,
                IndexFollowerConfig {
                    index: Default::default(),
                    ready_max_lag: config.ready_max_lag,
                },
            );
            (OverlapSource::Local(replica), Some(task))
        }
    };
    for role in kvroute_common::messages::WorkerRole::ALL {
        let s = policies.selection(role);
        tracing::info!(%role, policy = s.instance, source = %s.origin, "worker-selection policy");
    }
    let seed = config.seed.unwrap_or_else(rand::random);
    let (peers_tx, peers_rx) = tokio::sync::watch::channel(peers::PeerSet::default());
    let (admission, admission_actor) = admission::Admission::new(
        config.queue(),
        classifying::Classifiers::new(plugins.classifier.clone()),
    );
    let router = Arc::new(Router {
        router_id: router_id.clone(),
        decisions_subject: names.decisions(),
        names: names.clone(),
        nats: nats.clone(),
        candidates: RwLock::new(Candidates::new()),
        loaded: AtomicBool::new(false),
        serving: AtomicBool::new(false),
        load: LoadViews::new(LoadViewConfig {
            report_interval_ms: config.load_report_interval_ms,
            confirm_window_ms: config.prediction_confirm_ms,
            prediction_max_age_ms: config.prediction_max_age_secs.saturating_mul(1000),
            predicted_overlap_ttl_ms: config.predicted_overlap_ttl_ms,
            approx_cache_ttl_ms: config.approx_cache_ttl_ms,
            models: config.load_models.models()?,
        }),
        overlap,
        sessions: SessionTable::new(store, sessions_config),
        policies: Policies::new(policies, seed),
        settings: config.selection_settings(),
        metrics: RouterMetrics::new(),
        max_in_flight: config.max_in_flight,
        peers: (!config.no_partition_owner).then_some(peers_rx),
        forward_timeout: Duration::from_millis(config.forward_timeout_ms),
        admission,
        prediction_max_age_ms: config.prediction_max_age_secs.saturating_mul(1000),
        disaggregation: plugins.disaggregation,
    });
    let registration = Arc::new(peers::Registration::default());
    let peer_tasks = if config.no_partition_owner {
        Vec::new()
    } else {
        vec![
            tokio::spawn(peers::register(
                router.clone(),
                etcd.clone(),
                Duration::from_secs(config.router_lease_ttl_secs),
                registration.clone(),
            )),
            tokio::spawn(peers::watch(etcd.clone(), names.clone(), peers_tx)),
        ]
    };

    let (addr, http_task) = kvroute_common::ops::serve_http(
        "http-addr",
        config.http_addr,
        Arc::new(http::Http(router.clone())),
    )
    .await?;
    tracing::info!(router_id, %addr, "router http listening");
    let watch_task = tokio::spawn(feeds::watch_workers(
        router.clone(),
        watch_workers(etcd, &names),
    ));
    let feed_task = feeds::run_load_feed(router.clone(), nats.clone(), connection_events).await?;
    // In the select queue group only while ready and keeping up.
    let in_flight = InFlight::new();
    let (serve, watchdog_task) = spawn_watchdog(
        config.watchdog(),
        in_flight.clone(),
        {
            let router = router.clone();
            move || router.is_ready()
        },
        watchdog_observer("select", router.metrics.watchdog()),
    );
    let intake_task = tokio::spawn(intake::serve(router.clone(), serve, in_flight));
    let admission_task = tokio::spawn(admission_actor.run(router.clone()));
    tracing::info!(router_id, subject = names.select(), overlap = ?config.overlap_mode, "router started; serving once ready");

    shutdown.await;
    tracing::info!(router_id, "shutting down");
    // Out of the owners first, so the other replicas stop forwarding here.
    for task in peer_tasks {
        task.abort();
    }
    registration.revoke().await;
    intake_task.abort();
    // Queued requests get an answer they can retry elsewhere, not silence.
    router.admission.shutdown().await;
    admission_task.abort();
    watchdog_task.abort();
    watch_task.abort();
    feed_task.abort();
    http_task.abort();
    if let Some(task) = replica_task {
        task.abort();
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
    Ok(())
}

/// The whole `main` of a router binary linking `registry`'s policy types: parse flags (with
/// `KVROUTE_*` env fallbacks), set up logging, prepare (a bad configuration exits with
/// status 2 and one line naming it), run until SIGTERM or Ctrl-C; errors end it with one
/// line and a status of kvroute's exit table (`kvroute_common::ops::exit`).
pub fn main_with(registry: RouterPluginRegistry, name: &'static str) -> std::process::ExitCode {
    use clap::CommandFactory as _;
    use kvroute_common::ops::exit;
    let types = registry.types().collect::<Vec<_>>().join(", ");
    let classifiers = registry
        .request_classifier_types()
        .collect::<Vec<_>>()
        .join(", ");
    let command = RouterConfig::command()
        .name(name)
        .bin_name(name)
        .after_help(format!(
            "Policy types (for --policy-config, the selection flags and a request's `policy`): {types}\n\
             Request classifier types (for request_classifier.type in --policy-config): {classifiers}"
        ));
    exit::run_command(name, command, |mut config: RouterConfig, origins| {
        config.origins = origins;
        kvroute_common::telemetry::init(&config.telemetry);
        let prepared = Prepared::new(config, &registry)
            .map_err(|e| exit::with_status(exit::Status::BadConfig, e))?;
        exit::block_on(run(prepared, kvroute_common::ops::shutdown_signal()))
    })
}
