//! `--engine-api vllm|sglang`: simulated workers that look like real engines instead of kvroute
//! workers, so kvroute-bridge can be run against them. Nothing here touches NATS or etcd.
//!
//! Worker i (ports: base + i × stride) runs one simulated [`crate::Engine`] per data-parallel
//! rank, each with the engine's ZMQ KV-event publisher (`zmq.rs`: PUB on the zmq port + rank,
//! replay ROUTER on the replay port + rank; `wire.rs`: the payloads), and one HTTP server for
//! all its ranks (`http.rs`; `completions.rs` and `stream.rs`: the OpenAI API; `metrics.rs`:
//! `/metrics`; `info.rs`: `/get_server_info`, `/v1/loads`). `rank.rs` drives each engine in
//! real time like the kvroute-faced worker does and reports each request's progress
//! (`progress.rs`, which also aborts the requests of a client that left), and
//! `block_tokens.rs` keeps the tokens every `BlockStored` carries. With
//! `--disaggregation-role`, `disagg.rs` reads the engines' hand-off fields and `transfer.rs`
//! moves a prompt's KV from a prefill worker (its outbox and side channel) to a decode worker.
//!
//! Deliberately absent: real tokenization (unless `--engine-tokenizer`), sampling and stop
//! strings, LoRA, offload tiers (the cache has a device tier only), n > 1, logprobs, vLLM's
//! histograms, most of SGLang's server arguments and metrics, and SGLang's polling for a plain
//! request's disconnect (it checks every 4 s while the request waits; this aborts at once).

mod abort;
mod block_tokens;
mod completions;
mod config;
mod disagg;
mod face;
mod http;
mod info;
mod job;
mod metrics;
mod openai;
mod progress;
mod rank;
mod shapes;
mod stream;
mod transfer;
mod wire;
mod zmq;

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context as _;
use kvroute_common::ops::{ListenError, serve_http};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use block_tokens::BlockTokens;
pub use config::{
    DisaggregationRole, EngineApi, EngineFaceArgs, EngineKind, EventFormat, MAX_DP_SIZE,
    WorkerPorts,
};
pub use openai::{DEFAULT_MAX_TOKENS, tokenize};
pub use wire::{EventWriter, MissingTokens};

use crate::engine::EngineConfig;
use crate::fleet::{FleetConfig, FleetMetrics};
use face::WorkerFace;
use rank::{Rank, RankConfig};
use zmq::{Publisher, PublisherConfig};

/// The vLLM release whose wire format and API are impersonated (`/version`).
pub const VLLM_VERSION: &str = "0.32.0";
/// The SGLang release whose wire format and API are impersonated (`version` fields).
pub const SGLANG_VERSION: &str = "0.5.23";

/// What one worker's handlers know about it.
#[derive(Debug, Clone)]
pub(crate) struct FaceSettings {
    pub engine_api: EngineKind,
    pub index: u32,
    pub model: String,
    pub engine: EngineConfig,
    pub dp_size: u32,
    pub host: IpAddr,
    /// Bound ports (rank 0's for ZMQ).
    pub http_port: u16,
    pub zmq_port: u16,
    pub replay_port: u16,
    pub topic: String,
    pub replay_buffer: usize,
    /// When the worker started, since the Unix epoch.
    pub started: Duration,
    /// `--engine-tokenizer`: the model's tokenizer and chat template (else bytes).
    pub text: Option<Arc<kvroute_text::ModelText>>,
    /// `--engine-lora-modules`: the adapters served beside the base model.
    pub lora_modules: Vec<String>,
}

/// Where one impersonated worker listens. Displays as the kvroute-bridge flags that serve it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEndpoints {
    /// 0-based position in the fleet.
    pub index: u32,
    pub engine: EngineKind,
    pub http: SocketAddr,
    /// Per rank.
    pub zmq: Vec<String>,
    /// Per rank.
    pub replay: Vec<String>,
    pub topic: String,
    pub role: DisaggregationRole,
    /// A prefill worker's side channel (vLLM's NIXL side channel, SGLang's bootstrap port).
    pub side_channel: Option<SocketAddr>,
}

impl WorkerEndpoints {
    /// `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }
}

impl fmt::Display for WorkerEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "worker {} ({}, dp size {}): --engine {} --engine-url {} --zmq-endpoint {} --zmq-replay-endpoint {} --dp-size {}",
            self.index,
            self.engine.as_str(),
            self.zmq.len(),
            self.engine.as_str(),
            self.url(),
            self.zmq[0],
            self.replay[0],
            self.zmq.len(),
        )?;
        if !self.topic.is_empty() {
            write!(f, " --zmq-topic {}", self.topic)?;
        }
        match self.role {
            DisaggregationRole::None => {}
            DisaggregationRole::Prefill => write!(f, " --role prefill")?,
            DisaggregationRole::Decode => write!(f, " --role decode")?,
        }
        Ok(())
    }
}

#[derive(Debug)]
struct FaceWorker {
    endpoints: WorkerEndpoints,
    ranks: Vec<Arc<Rank>>,
    drivers: Vec<JoinHandle<()>>,
    http: JoinHandle<()>,
    side_channel: Option<JoinHandle<()>>,
}

/// A running fleet of impersonated engines. [`EngineFleet::shutdown`] stops it.
#[derive(Debug)]
pub struct EngineFleet {
    workers: Vec<FaceWorker>,
    metrics: Arc<FleetMetrics>,
    stop: watch::Sender<bool>,
    ops_http: Option<(SocketAddr, JoinHandle<()>)>,
}

impl EngineFleet {
    /// Binds every worker's sockets and starts its ranks. `config.face.engine_api` must name
    /// an engine.
    pub async fn start(config: &FleetConfig) -> anyhow::Result<Self> {
        config.validate()?;
        let face = &config.face;
        let engine_api = face
            .engine_api
            .face()
            .context("--engine-api kvroute has no engine face")?;
        let engine = config.engine.engine_config();
        let metrics = Arc::new(FleetMetrics::default());
        let (stop, stop_rx) = watch::channel(false);
        let ctx = ::zmq::Context::new();
        let writer = EventWriter {
            engine: engine_api,
            format: face.engine_event_format,
            block_size: engine.block_size,
        };
        // One tokenizer for the fleet: every worker serves the same model.
        let text = match &face.engine_tokenizer {
            Some(dir) => Some(Arc::new(
                kvroute_text::ModelText::load(&config.model, dir).map_err(|e| {
                    kvroute_common::config::ConfigError::new("engine-tokenizer", e.to_string())
                })?,
            )),
            None => None,
        };
        let mut workers = Vec::new();
        for index in 0..config.workers {
            let ports = face.worker_ports(index);
            let mut ranks = Vec::new();
            let mut drivers = Vec::new();
            for r in 0..face.engine_dp_size {
                let publisher = Publisher::start(
                    &ctx,
                    PublisherConfig {
                        host: face.engine_bind_host,
                        pub_port: ports.zmq[r as usize],
                        replay_port: ports.replay[r as usize],
                        topic: face.engine_topic.clone().into_bytes(),
                        buffer: face.engine_replay_buffer,
                        name: format!("{index}-{r}"),
                    },
                )?;
                let rank_config = RankConfig {
                    rank: r,
                    engine: engine.clone(),
                    speedup: config.speedup,
                    writer,
                };
                let rank = Arc::new(Rank::new(rank_config, publisher, metrics.clone()));
                drivers.push(tokio::spawn(rank.clone().drive(stop_rx.clone())));
                ranks.push(rank);
            }
            let addr = SocketAddr::new(face.engine_bind_host, ports.http);
            let listener =
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|error| ListenError {
                        flag: "engine-http-port",
                        addr,
                        error,
                    })?;
            let http_addr = listener.local_addr()?;
            let outbox = Arc::new(transfer::Outbox::new(
                uuid::Uuid::new_v4().to_string(),
                Duration::from_secs_f64(face.disaggregation_timeout_secs),
            ));
            let (side_addr, side_channel) = match ports.side_channel {
                Some(port) => {
                    let addr = SocketAddr::new(face.engine_bind_host, port);
                    let listener =
                        tokio::net::TcpListener::bind(addr)
                            .await
                            .map_err(|error| ListenError {
                                flag: "engine-side-channel-port",
                                addr,
                                error,
                            })?;
                    let bound = listener.local_addr()?;
                    let app = transfer::side_channel(outbox.clone());
                    let task = tokio::spawn(async move {
                        if let Err(e) = axum::serve(listener, app).await {
                            tracing::error!(error = %e, "side channel stopped");
                        }
                    });
                    (Some(bound), Some(task))
                }
                None => (None, None),
            };
            let endpoints = WorkerEndpoints {
                index,
                engine: engine_api,
                http: http_addr,
                zmq: ranks
                    .iter()
                    .map(|r| r.publisher().endpoint.clone())
                    .collect(),
                replay: ranks
                    .iter()
                    .map(|r| r.publisher().replay_endpoint.clone())
                    .collect(),
                topic: face.engine_topic.clone(),
                role: face.disaggregation_role,
                side_channel: side_addr,
            };
            let transfers = transfer::Transfers {
                role: face.disaggregation_role,
                outbox,
                // vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST default is `localhost`.
                side_channel: side_addr.map(|a| {
                    let host = if a.ip().is_unspecified() {
                        "localhost".to_owned()
                    } else {
                        a.ip().to_string()
                    };
                    (host, a.port())
                }),
                ms_per_block: face.kv_transfer_ms_per_block,
                failure_rate: face.kv_transfer_failure_rate,
                room_wait: Duration::from_secs_f64(face.disaggregation_timeout_secs),
                speedup: config.speedup,
                counters: Default::default(),
                client: reqwest::Client::new(),
            };
            let settings = FaceSettings {
                engine_api,
                index,
                model: config.model.clone(),
                engine: engine.clone(),
                dp_size: face.engine_dp_size,
                host: face.engine_bind_host,
                http_port: http_addr.port(),
                zmq_port: endpoint_port(&endpoints.zmq[0]),
                replay_port: endpoint_port(&endpoints.replay[0]),
                topic: face.engine_topic.clone(),
                replay_buffer: face.engine_replay_buffer,
                started: rank::unix_now(),
                text: text.clone(),
                lora_modules: face.engine_lora_modules.clone(),
            };
            let state = Arc::new(WorkerFace {
                settings,
                ranks: ranks.clone(),
                healthy: AtomicBool::new(true),
                transfers,
                metrics: metrics.clone(),
            });
            let app = http::router(state);
            // Streamed chunks go out at once, as from the engines' own servers (uvicorn sets
            // TCP_NODELAY): with Nagle's algorithm a first chunk waits for the previous write's
            // delayed ACK, adding ~40 ms to every time to first token.
            let listener =
                axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
                    let _ = tcp.set_nodelay(true);
                });
            let http = tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(error = %e, "engine HTTP server stopped");
                }
            });
            tracing::info!(
                worker = index,
                engine = engine_api.as_str(),
                url = endpoints.url(),
                zmq = endpoints.zmq[0],
                replay = endpoints.replay[0],
                role = ?endpoints.role,
                side_channel = ?endpoints.side_channel,
                "engine face up"
            );
            workers.push(FaceWorker {
                endpoints,
                ranks,
                drivers,
                http,
                side_channel,
            });
        }
        let ops_http = match config.http_addr {
            Some(addr) => {
                let handler = crate::fleet::FleetHttp {
                    metrics: metrics.clone(),
                    registered: vec![Arc::new(AtomicBool::new(true))],
                };
                Some(serve_http("http-addr", addr, Arc::new(handler)).await?)
            }
            None => None,
        };
        Ok(Self {
            workers,
            metrics,
            stop,
            ops_http,
        })
    }

    /// Every worker's endpoints, in order.
    pub fn endpoints(&self) -> Vec<WorkerEndpoints> {
        self.workers.iter().map(|w| w.endpoints.clone()).collect()
    }

    pub fn metrics(&self) -> &FleetMetrics {
        &self.metrics
    }

    /// Where `--http-addr`'s `/metrics` listens, if enabled.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.ops_http.as_ref().map(|(addr, _)| *addr)
    }

    /// Cancels requests in flight (streams end without `[DONE]`), closes every socket.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for w in self.workers {
            for d in w.drivers {
                let _ = d.await;
            }
            w.http.abort();
            let _ = w.http.await;
            if let Some(side) = w.side_channel {
                side.abort();
                let _ = side.await;
            }
            for rank in &w.ranks {
                rank.publisher().stop().await;
            }
        }
        if let Some((_, task)) = self.ops_http {
            task.abort();
        }
        tracing::info!("engine fleet stopped");
    }
}

/// The port of a bound `tcp://host:port` endpoint.
fn endpoint_port(endpoint: &str) -> u16 {
    endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}
