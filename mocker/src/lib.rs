//! kvroute's mocker: simulated inference workers and trace replay.
//!
//! The core is sans-I/O: [`cache::KvCache`] and [`engine::Engine`] are state machines driven by
//! simulated time passed in as an argument; the process shells map them onto NATS and real time:
//! [`fleet`] (the `kvroute-mocker` process) and [`replay`]'s driver (the `kvroute-replay` tool).
//! [`tracegen`] writes the multi-turn session traces the replay and [`sim`] read.

pub mod cache;
pub mod engine;
pub mod engine_face;
pub mod fleet;
pub mod replay;
pub mod shared_store;
pub mod sim;
pub mod tracegen;

pub use cache::{Admission, CacheConfig, CacheError, KvCache};
pub use engine::{
    Engine, EngineConfig, EngineLoad, EngineOutput, InvalidEngineConfig, Ready, SimRequest,
    SubmitError,
};
