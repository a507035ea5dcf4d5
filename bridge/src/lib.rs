//! kvroute-bridge: makes real inference engines (vLLM, SGLang) kvroute workers without changing
//! them. Per engine it relays the engine's ZMQ KV events into kvroute's event log, keeps a mirror
//! of the engine's cache for resyncs, registers the engine's card while it is healthy, publishes
//! its load, and forwards `GenerateRequest`s to its OpenAI-compatible API.
//!
//! The core is pure: [`wire`] decodes the engines' MessagePack, [`mirror`] turns engine events
//! into kvroute events (copies, groups, tiers, extra keys) and remembers the cache, [`sequence`]
//! judges each batch's `seq`. The shells do the I/O: [`zmq_io`] (sockets, one thread per rank),
//! [`relay`] (the event path), [`engine_http`] (the engine's HTTP API), [`engine`] (one engine's
//! supervisor: health, registration, load, requests).

pub mod config;
pub mod engine;
pub mod engine_http;
pub mod metrics;
pub mod mirror;
pub mod relay;
pub mod run;
pub mod sequence;
pub mod wire;
pub mod zmq_io;

pub use config::{BridgeArgs, EngineKind, EngineSpec};
pub use metrics::BridgeMetrics;
