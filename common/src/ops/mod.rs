//! Operations endpoints shared by every process: a small Prometheus registry and the HTTP
//! server for `/metrics`, `/healthz`, `/readyz` (and process-specific JSON pages).

mod http;
mod metrics;

pub use http::{HttpHandler, HttpResponse, serve_http};
pub use metrics::{Counter, CounterVec, Gauge, Histogram, Registry};
