//! Operations endpoints shared by every process: a small Prometheus registry and the HTTP
//! server for `/metrics`, `/healthz`, `/readyz` (and process-specific JSON pages).

mod http;
mod metrics;

pub use http::{HttpHandler, HttpResponse, serve_http};
pub use metrics::{Counter, CounterVec, Gauge, Histogram, Registry};

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
