//! `--engine-api vllm|sglang`: simulated workers that look like real engines instead of kvroute
//! workers, so kvroute-bridge can be run against them. Nothing here touches NATS or etcd.
//!
//! The pure pieces: `config.rs` (the flags and their port layout), `wire.rs` (the engines' KV
//! events), `block_tokens.rs` (the tokens every `BlockStored` carries).

mod block_tokens;
mod config;
mod wire;

pub use block_tokens::BlockTokens;
pub use config::{EngineApi, EngineFaceArgs, EventFormat, FaceEngine, MAX_DP_SIZE, WorkerPorts};
pub use wire::{EventWriter, MissingTokens};
