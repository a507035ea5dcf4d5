//! The `kvroute-mocker` process: its flags, and `run` from connection to clean shutdown.

use std::future::Future;

use anyhow::Context as _;
use kvroute_common::Names;
use kvroute_common::config::{ConfigError, EtcdArgs, NamespaceArgs, NatsArgs};
use kvroute_common::telemetry::TelemetryArgs;

use super::{Fleet, FleetConfig};
use crate::engine_face::EngineFleet;

/// Runs N simulated inference workers in one process: each registers in etcd under its own
/// lease, serves GenerateRequests on NATS, and publishes KV events, lifecycle events and load.
/// With --engine-api vllm|sglang each looks like that engine instead (ZMQ KV events and an
/// HTTP API; no NATS, no etcd), for kvroute-bridge to serve.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvroute-mocker", version)]
pub struct MockerArgs {
    #[command(flatten)]
    pub fleet: FleetConfig,
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

impl MockerArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.fleet.validate()?;
        self.nats.validate()?;
        self.etcd.validate()
    }
}

/// Connects, starts the fleet, and runs until `shutdown` resolves; then deregisters every
/// worker before returning.
pub async fn run(args: MockerArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    args.validate()?;
    if args.fleet.face.engine_api.face().is_some() {
        return run_engines(&args.fleet, shutdown).await;
    }
    let names = Names::new(&args.namespace.namespace);
    let mut config = args.fleet.clone();
    if config.random_worker_ids {
        config.worker_id_start = FleetConfig::random_worker_id_start(rand::random());
    }
    let nats = args.nats.connect("kvroute-mocker").await?;
    kvroute_common::jetstream::require_jetstream(&nats, &args.nats.urls.join(",")).await?;
    let etcd = args.etcd.connect().await?;
    tokio::pin!(shutdown);
    let fleet = tokio::select! {
        fleet = Fleet::start(&config, nats.clone(), etcd, &names) => {
            fleet.context("starting the fleet")?
        }
        _ = &mut shutdown => {
            tracing::info!("shutdown requested before the fleet registered");
            return Ok(());
        }
    };
    shutdown.await;
    tracing::info!("shutting down");
    fleet.shutdown().await;
    nats.flush().await.context("flushing NATS")?;
    Ok(())
}

/// `--engine-api vllm|sglang`: the impersonated engines, one stdout line per worker with the
/// kvroute-bridge flags that serve it.
async fn run_engines(
    config: &FleetConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let fleet = EngineFleet::start(config)
        .await
        .context("starting the engine fleet")?;
    for endpoints in fleet.endpoints() {
        println!("kvroute-mocker: {endpoints}");
    }
    shutdown.await;
    tracing::info!("shutting down");
    fleet.shutdown().await;
    Ok(())
}
