//! kvroute's router core: the decision core ([`decide`]: one request from signals to a charged
//! decision, over the load view and the registered candidates), router eligibility, the
//! worker-selection policy pipeline, request classifiers ([`classify`]: admission before
//! selection), the plugin registry and the session table. Everything but
//! [`service`] is sans-I/O: time, randomness and signals come in as arguments. [`service`] is
//! the NATS process that wraps it (`kvroute-router`).

pub mod classify;
pub mod decide;
pub mod drive;
pub mod eligibility;
pub mod pipeline;
pub mod policies;
pub mod queue;
pub mod registry;
pub mod request;
pub mod select;
pub mod service;
pub mod session;
pub mod signals;
pub mod worker;

#[cfg(test)]
mod testing;
