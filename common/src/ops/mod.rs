//! Operations endpoints shared by every process: a small Prometheus registry and the HTTP
//! server for `/metrics`, `/healthz`, `/readyz` (and process-specific JSON pages), and the
//! watchdog that takes a lagging process out of its queue group, and how binaries exit
//! ([`exit`]).

pub mod exit;
mod http;
mod membership;
mod metrics;
pub mod watchdog;

pub use http::{HttpHandler, HttpResponse, ListenError, serve_http};
pub use membership::{Membership, serve_membership};
pub use metrics::{
    Counter, CounterVec, Family, Gauge, Histogram, OPENMETRICS_CONTENT_TYPE, OneOf, Registry,
};
pub use watchdog::{
    InFlight, InFlightGuard, WatchdogConfig, WatchdogMetrics, spawn_watchdog, watchdog_observer,
};

/// Resolves on SIGTERM or Ctrl-C (SIGINT): what every binary's `run` waits on.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
