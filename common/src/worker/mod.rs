//! The worker-side library: what every worker (kvroute-mocker, or an engine integration in
//! Rust) uses to take part in kvroute.
//!
//! - [`Registration`]: the worker card in etcd under a lease, kept alive in the background,
//!   re-registered after an etcd outage, revoked on shutdown;
//! - [`EventPublisher`]: KV events to JetStream with acks, `event_id`s assigned in order, retries
//!   that neither duplicate nor reorder;
//! - [`WorkerAgent`]: both, plus the resync responder and load / lifecycle reports.

mod agent;
mod publisher;
mod registration;

pub use agent::{ResyncSource, WorkerAgent, WorkerAgentConfig};
pub use publisher::{EventPublisher, PublisherConfig, PublisherStats};
pub use registration::{Registration, RegistrationConfig};
