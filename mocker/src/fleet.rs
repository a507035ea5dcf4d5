//! The process shell around the pure engine: a fleet of simulated workers on NATS and etcd.
//!
//! Each worker has its own worker id, lease and [`WorkerCard`], an [`crate::Engine`] and a task
//! that serves `GenerateRequest`s on the card's request subject (see `worker.rs`). The fleet
//! starts them, serves `/metrics` `/healthz` `/readyz`, and stops them (cleanly, or as a crash).

mod config;
mod metrics;
mod request;
mod run;
mod worker;

use std::net::SocketAddr;
use std::sync::Arc;

use async_nats::jetstream;
use kvroute_common::events_stream::StreamArgs;
use kvroute_common::messages::{WorkerCard, WorkerRole};
use kvroute_common::ops::serve_http;
use kvroute_common::worker::{RegistrationConfig, WorkerAgent, WorkerAgentConfig};
use kvroute_common::{Names, WorkerId};
use tokio::task::JoinHandle;

pub use config::{EngineArgs, FleetConfig, MAX_WORKERS};
pub use metrics::FleetMetrics;
pub use request::to_sim_request;
pub use run::{MockerArgs, run};
pub use worker::StopMode;

pub(crate) use metrics::FleetHttp;
use worker::{WorkerHandle, WorkerSettings};

use crate::shared_store::SharedStore;

/// The card label that tells clients (the replay tool) the fleet's time compression.
pub const SPEEDUP_LABEL: &str = "kvroute.mocker/speedup";
/// Card label with the engine model's parameters (JSON), for the replay's TTFT floor.
pub const ENGINE_LABEL: &str = "kvroute.mocker/engine";

/// A running fleet. [`Fleet::shutdown`] deregisters every worker.
#[derive(Debug)]
pub struct Fleet {
    workers: Vec<WorkerHandle>,
    metrics: Arc<FleetMetrics>,
    http: Option<(SocketAddr, JoinHandle<()>)>,
}

impl Fleet {
    /// Starts every worker of `config` (already validated) and waits until all are registered.
    pub async fn start(
        config: &FleetConfig,
        nats: async_nats::Client,
        etcd: etcd_client::Client,
        names: &Names,
    ) -> anyhow::Result<Self> {
        config.validate()?;
        if !config.no_create_stream {
            ensure_events_stream(&jetstream::new(nats.clone()), names, &config.stream).await?;
        }
        let metrics = Arc::new(FleetMetrics::default());
        let settings = WorkerSettings {
            engine: config.engine.engine_config(),
            speedup: config.speedup,
            load_interval: config.load_interval(),
            shared: (config.shared_cache_blocks > 0).then(|| {
                Arc::new(std::sync::Mutex::new(SharedStore::new(
                    config.shared_cache_blocks as usize,
                )))
            }),
            no_load_reports: config.no_load_reports,
            no_kv_events: config.no_kv_events,
        };
        let agent_config = WorkerAgentConfig {
            registration: RegistrationConfig {
                lease_ttl: config.lease_ttl(),
                ..RegistrationConfig::default()
            },
            ..WorkerAgentConfig::default()
        };
        let mut workers = Vec::new();
        for worker_id in config.worker_ids() {
            let core = worker::new_core(&settings);
            let mut agent = WorkerAgent::start(
                nats.clone(),
                etcd.clone(),
                names,
                card(config, worker_id, names),
                agent_config.clone(),
                core.clone(),
            )
            .await?;
            agent.wait_registered().await;
            let handle = worker::spawn(
                agent,
                core,
                nats.clone(),
                names,
                settings.clone(),
                metrics.clone(),
            )
            .await?;
            workers.push(handle);
        }
        tracing::info!(
            workers = config.workers,
            first_worker_id = config.worker_id_start,
            model = config.model,
            speedup = config.speedup,
            "mocker fleet registered"
        );
        let http = match config.http_addr {
            Some(addr) => {
                let handler = FleetHttp {
                    metrics: metrics.clone(),
                    registered: workers.iter().map(|w| w.registered.clone()).collect(),
                };
                let (bound, task) = serve_http("http-addr", addr, Arc::new(handler)).await?;
                tracing::info!(%bound, "serving /metrics /healthz /readyz");
                Some((bound, task))
            }
            None => None,
        };
        Ok(Self {
            workers,
            metrics,
            http,
        })
    }

    pub fn worker_ids(&self) -> Vec<WorkerId> {
        self.workers.iter().map(|w| w.worker_id).collect()
    }

    /// Where the HTTP endpoints listen, if enabled.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|(addr, _)| *addr)
    }

    pub fn metrics(&self) -> &FleetMetrics {
        &self.metrics
    }

    /// Stops one worker as `mode` (e.g. a simulated crash in a fault test). False if unknown.
    pub async fn stop_worker(&mut self, worker_id: WorkerId, mode: StopMode) -> bool {
        match self.workers.iter().position(|w| w.worker_id == worker_id) {
            Some(i) => {
                self.workers.remove(i).stop(mode).await;
                true
            }
            None => false,
        }
    }

    /// Stops every worker cleanly (running requests get `cancelled`, leases are revoked).
    pub async fn shutdown(self) {
        let stops = self.workers.into_iter().map(|w| w.stop(StopMode::Graceful));
        futures::future::join_all(stops).await;
        if let Some((_, task)) = self.http {
            task.abort();
        }
        tracing::info!("mocker fleet stopped");
    }
}

fn card(config: &FleetConfig, worker_id: WorkerId, names: &Names) -> WorkerCard {
    WorkerCard {
        v: Default::default(),
        worker_id,
        model: config.model.clone(),
        role: WorkerRole::Aggregated,
        block_size: config.engine.block_size,
        total_kv_blocks: config.engine.num_blocks,
        max_num_batched_tokens: u64::from(config.engine.max_num_batched_tokens),
        dp_start_rank: 0,
        dp_size: 1,
        taints: Vec::new(),
        labels: config
            .label_pairs()
            .chain([
                (SPEEDUP_LABEL.to_owned(), config.speedup.to_string()),
                (
                    ENGINE_LABEL.to_owned(),
                    serde_json::to_string(&config.engine.engine_config())
                        .expect("an engine config serializes"),
                ),
            ])
            .collect(),
        request_subject: names.worker_requests(worker_id),
        software_version: format!("kvroute-mocker {}", env!("CARGO_PKG_VERSION")),
        http_url: None,
        kv_events: !config.no_kv_events,
        lora_adapters: None,
    }
}

/// Creates the events stream with the fleet's `--stream-*` settings if nobody has yet.
pub async fn ensure_events_stream(
    js: &jetstream::Context,
    names: &Names,
    stream: &StreamArgs,
) -> anyhow::Result<()> {
    kvroute_common::events_stream::ensure_worker_events_stream(js, names, stream, "kvroute-mocker")
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use kvroute_common::Namespace;

    use super::*;

    #[test]
    fn a_worker_without_kv_events_says_so_on_its_card() {
        let names = Names::new(&Namespace::new("t").unwrap());
        let with = card(&FleetConfig::default(), 1, &names);
        assert!(with.kv_events);
        let without = FleetConfig {
            no_kv_events: true,
            ..FleetConfig::default()
        };
        assert!(!card(&without, 1, &names).kv_events);
    }
}
