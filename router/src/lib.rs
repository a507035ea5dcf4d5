//! kvroute's router core: host eligibility, the worker-selection policy pipeline, the policy
//! registry and the session table. Everything here is sans-I/O: time, randomness and signals
//! come in as arguments. [`service`] is the NATS process that wraps it (`kvroute-router`).

pub mod eligibility;
pub mod pipeline;
pub mod policies;
pub mod registry;
pub mod request;
pub mod select;
pub mod service;
pub mod session;
pub mod signals;
pub mod worker;

#[cfg(test)]
mod testing;
