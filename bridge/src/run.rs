//! The process: connect to NATS and etcd, create the events stream if missing, start every
//! engine (its ranks, its relay, its supervisor), serve `/metrics` `/healthz` `/readyz`, and on
//! the shutdown signal deregister every engine and stop the relays.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use futures::future::BoxFuture;
use kvroute_common::ops::{Gauge, HttpHandler, HttpResponse, Registry, serve_http};
use kvroute_common::{DpRank, Names};
use tokio::task::JoinSet;

use crate::config::{BridgeArgs, EngineKind, EngineSpec};
use crate::engine::{Connections, EngineSupervisor, SupervisorSettings};
use crate::engine_http::EngineClient;
use crate::metrics::BridgeMetrics;
use crate::relay::{Relay, RelaySettings};

/// Runs the bridge until `shutdown` resolves, then deregisters every engine.
pub async fn run(
    args: BridgeArgs,
    engines: Vec<EngineSpec>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let names = Names::new(&args.namespace.namespace);
    let nats = args.nats.connect("kvroute-bridge").await?;
    kvroute_common::jetstream::require_jetstream(&nats, &args.nats.urls.join(",")).await?;
    let etcd = args.etcd.connect().await?;
    if !args.no_create_stream {
        ensure_events_stream(&jetstream::new(nats.clone()), &names, &args.stream).await?;
    }
    let metrics = Arc::new(BridgeMetrics::default());
    let slots: Vec<Slot> = engines
        .iter()
        .map(|spec| Slot {
            label: spec.label(),
            registered: Arc::new(AtomicBool::new(false)),
        })
        .collect();
    let http = match args.http_addr {
        Some(addr) => {
            let handler = BridgeHttp::new(metrics.clone(), slots.clone());
            let (bound, task) = serve_http("http-addr", addr, Arc::new(handler)).await?;
            tracing::info!(%bound, "serving /metrics /healthz /readyz");
            Some(task)
        }
        None => None,
    };
    let conn = Connections {
        nats: nats.clone(),
        etcd,
        names,
        metrics: metrics.clone(),
    };
    let mut starting = JoinSet::new();
    for (spec, slot) in engines.into_iter().zip(&slots) {
        starting.spawn(start_engine(
            spec,
            EngineStart {
                conn: conn.clone(),
                settings: SupervisorSettings::from_args(&args),
                engine_timeout: args.engine_timeout(),
                mirror_max_blocks: args.mirror_max_blocks,
                shared_tier: !args.no_shared_tier,
                registered: slot.registered.clone(),
            },
        ));
    }
    tokio::pin!(shutdown);
    let mut running = Vec::new();
    let result = loop {
        tokio::select! {
            _ = &mut shutdown => break Ok(()),
            Some(started) = starting.join_next(), if !starting.is_empty() => match started {
                Ok(Ok(engine)) => running.push(engine),
                Ok(Err(e)) => break Err(e),
                Err(e) => break Err(anyhow::anyhow!("starting an engine: {e}")),
            },
        }
    };
    tracing::info!("shutting down");
    // Engines still waiting to learn their ranks have nothing to undo.
    starting.abort_all();
    let stops = running.into_iter().map(|e: RunningEngine| async move {
        e.supervisor.shutdown().await;
        e.relay.shutdown();
    });
    futures::future::join_all(stops).await;
    if let Some(task) = http {
        task.abort();
    }
    nats.flush().await.context("flushing NATS")?;
    result
}

/// What one engine's start needs besides its spec.
struct EngineStart {
    conn: Connections,
    settings: SupervisorSettings,
    engine_timeout: Duration,
    mirror_max_blocks: usize,
    shared_tier: bool,
    registered: Arc<AtomicBool>,
}

struct RunningEngine {
    relay: Relay,
    supervisor: EngineSupervisor,
}

/// Learns the engine's ranks, starts its relay and its supervisor.
async fn start_engine(spec: EngineSpec, start: EngineStart) -> anyhow::Result<RunningEngine> {
    let label = spec.label();
    let client = EngineClient::new(spec.engine, &spec.engine_url, start.engine_timeout)
        .with_context(|| format!("engine {label}: building its HTTP client"))?;
    let dp_size = match spec.dp_size {
        Some(n) => n,
        None => discover_dp_size(&client, &label, start.settings.health_interval).await,
    };
    let ranks: Vec<DpRank> =
        (spec.dp_start_rank..spec.dp_start_rank.saturating_add(dp_size)).collect();
    let relay = if spec.kv_events {
        let relay = Relay::start(
            &spec,
            ranks.clone(),
            RelaySettings {
                mirror_max_blocks: start.mirror_max_blocks,
                shared_tier: start.shared_tier,
            },
            start.conn.metrics.clone(),
        )
        .with_context(|| format!("engine {label}: starting its event relay"))?;
        tracing::info!(
            engine = label,
            ?ranks,
            url = spec.engine_url,
            "engine relay started"
        );
        relay
    } else {
        tracing::info!(
            engine = label,
            ?ranks,
            url = spec.engine_url,
            "engine without KV events: no relay; routers predict its cache (approximate mode)"
        );
        Relay::without_events(&spec, start.conn.metrics.clone())
    };
    let supervisor = EngineSupervisor::start(
        spec,
        ranks,
        client,
        relay.clone(),
        start.conn,
        start.settings,
        start.registered,
    );
    Ok(RunningEngine { relay, supervisor })
}

/// The engine's data-parallel size, when `--dp-size` is not given: SGLang reports it (asked
/// until it answers); vLLM's API does not, so it is 1.
async fn discover_dp_size(client: &EngineClient, label: &str, retry: Duration) -> u32 {
    if client.kind() == EngineKind::Vllm {
        tracing::info!(
            engine = label,
            "vLLM does not report its data-parallel size: serving one rank (set --dp-size for more)"
        );
        return 1;
    }
    let mut logged = false;
    loop {
        match client.info().await {
            Ok(info) if info.dp_size.is_some() || info.problems.is_empty() => {
                return info.dp_size.unwrap_or(1);
            }
            Ok(info) => {
                if !logged {
                    tracing::info!(engine = label, problems = ?info.problems, "waiting for the engine to report its data-parallel size (or set --dp-size)");
                    logged = true;
                }
            }
            Err(e) => {
                if !logged {
                    tracing::info!(engine = label, error = %e, "waiting for the engine to answer, to learn its data-parallel size (or set --dp-size)");
                    logged = true;
                }
            }
        }
        tokio::time::sleep(retry).await;
    }
}

/// Creates the events stream with the bridge's `--stream-*` settings if nobody has yet.
async fn ensure_events_stream(
    js: &jetstream::Context,
    names: &Names,
    stream: &kvroute_common::events_stream::StreamArgs,
) -> anyhow::Result<()> {
    kvroute_common::events_stream::ensure_worker_events_stream(js, names, stream, "kvroute-bridge")
        .await?;
    Ok(())
}

/// An engine as `/readyz` sees it.
#[derive(Debug, Clone)]
struct Slot {
    label: String,
    registered: Arc<AtomicBool>,
}

/// `/metrics` (process gauges, then every engine's series), `/healthz` (the process runs),
/// `/readyz` (every engine registered; else 503 naming the others).
#[derive(Debug)]
struct BridgeHttp {
    registry: Registry,
    engines_registered: Arc<Gauge>,
    metrics: Arc<BridgeMetrics>,
    slots: Vec<Slot>,
}

impl BridgeHttp {
    fn new(metrics: Arc<BridgeMetrics>, slots: Vec<Slot>) -> Self {
        let registry = Registry::default();
        registry
            .gauge(
                "kvroute_bridge_engines",
                "Engines the bridge serves (configured).",
            )
            .set(slots.len() as i64);
        let engines_registered = registry.gauge(
            "kvroute_bridge_engines_registered",
            "Engines whose card is registered in etcd.",
        );
        Self {
            registry,
            engines_registered,
            metrics,
            slots,
        }
    }

    fn not_registered(&self) -> Vec<&str> {
        self.slots
            .iter()
            .filter(|s| !s.registered.load(Ordering::Relaxed))
            .map(|s| s.label.as_str())
            .collect()
    }
}

impl HttpHandler for BridgeHttp {
    fn get(&self, path: &str) -> BoxFuture<'static, HttpResponse> {
        let response = match path.split('?').next().unwrap_or(path) {
            "/metrics" => {
                let down = self.not_registered().len();
                self.engines_registered
                    .set((self.slots.len() - down) as i64);
                // The engines' series go before the registry's closing `# EOF` line.
                let mut text = self.registry.render();
                let end = text.strip_suffix("# EOF\n").map_or(text.len(), str::len);
                text.insert_str(end, &self.metrics.render());
                HttpResponse::prometheus(text)
            }
            "/healthz" => HttpResponse::text(200, "ok\n"),
            "/readyz" => {
                let down = self.not_registered();
                if down.is_empty() {
                    HttpResponse::text(200, "ready\n")
                } else {
                    HttpResponse::text(503, format!("not registered: {}\n", down.join(", ")))
                }
            }
            _ => HttpResponse::text(404, "not found\n"),
        };
        Box::pin(std::future::ready(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn readyz_names_the_engines_not_registered() {
        let slots = vec![
            Slot {
                label: "vllm-a".into(),
                registered: Arc::new(AtomicBool::new(true)),
            },
            Slot {
                label: "sglang-b".into(),
                registered: Arc::new(AtomicBool::new(false)),
            },
        ];
        let metrics = Arc::new(BridgeMetrics::default());
        metrics.set(crate::metrics::names::REGISTERED, "vllm-a", None, 1.0);
        let http = BridgeHttp::new(metrics, slots.clone());
        let ready = http.get("/readyz").await;
        assert_eq!(
            (ready.status, ready.body.as_str()),
            (503, "not registered: sglang-b\n")
        );
        let m = http.get("/metrics").await.body;
        assert!(m.contains("kvroute_bridge_engines 2\n"), "{m}");
        assert!(m.contains("kvroute_bridge_engines_registered 1\n"), "{m}");
        assert!(
            m.contains("kvroute_bridge_registered{engine=\"vllm-a\"} 1"),
            "{m}"
        );
        slots[1].registered.store(true, Ordering::Relaxed);
        assert_eq!(http.get("/readyz").await.status, 200);
        assert_eq!(http.get("/healthz?x=1").await.status, 200);
        assert_eq!(http.get("/nope").await.status, 404);
    }
}
