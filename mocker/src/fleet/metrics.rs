//! The mocker process's metrics (Prometheus text on `/metrics`) and its health endpoints.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::BoxFuture;
use kvroute_common::ops::{Counter, CounterVec, Histogram, HttpHandler, HttpResponse, Registry};

/// Counters shared by every worker of the fleet.
#[derive(Debug)]
pub struct FleetMetrics {
    pub registry: Registry,
    pub requests_received: Arc<Counter>,
    /// By outcome: `ok`, or the error code of the reply; engine faces: `ok`, `cancelled`
    /// (shutdown) or `aborted` (the client left).
    pub requests_finished: Arc<CounterVec>,
    /// Simulated time to first token.
    pub ttft: Arc<Histogram>,
    pub kv_events: Arc<Counter>,
    pub load_reports: Arc<Counter>,
    pub resets: Arc<Counter>,
}

impl Default for FleetMetrics {
    fn default() -> Self {
        let registry = Registry::default();
        Self {
            requests_received: registry.counter(
                "kvroute_mocker_requests_received_total",
                "GenerateRequests received by the fleet's workers.",
            ),
            requests_finished: registry.counter_vec(
                "kvroute_mocker_requests_finished_total",
                "Requests ended, by outcome (ok, the error code, cancelled or aborted).",
                "outcome",
            ),
            ttft: registry.histogram(
                "kvroute_mocker_ttft_seconds",
                "Simulated time to first token.",
            ),
            kv_events: registry.counter(
                "kvroute_mocker_kv_events_total",
                "KV events queued for publishing (Stored, Removed, Cleared).",
            ),
            load_reports: registry.counter(
                "kvroute_mocker_load_reports_total",
                "WorkerLoad reports published.",
            ),
            resets: registry.counter(
                "kvroute_mocker_resets_total",
                "Cache resets requested on the workers' reset subjects.",
            ),
            registry,
        }
    }
}

/// `/metrics`, `/healthz` (the process is up) and `/readyz` (every worker is registered).
#[derive(Debug)]
pub(crate) struct FleetHttp {
    pub metrics: Arc<FleetMetrics>,
    pub registered: Vec<Arc<AtomicBool>>,
}

impl HttpHandler for FleetHttp {
    fn get(&self, path: &str) -> BoxFuture<'static, HttpResponse> {
        let response = match path.split('?').next().unwrap_or(path) {
            "/metrics" => HttpResponse::prometheus(self.metrics.registry.render()),
            "/healthz" => HttpResponse::text(200, "ok\n"),
            "/readyz" => {
                let down = self
                    .registered
                    .iter()
                    .filter(|r| !r.load(Ordering::Relaxed))
                    .count();
                if down == 0 {
                    HttpResponse::text(200, "ready\n")
                } else {
                    HttpResponse::text(503, format!("{down} workers not registered\n"))
                }
            }
            _ => HttpResponse::text(404, "not found\n"),
        };
        Box::pin(std::future::ready(response))
    }
}
