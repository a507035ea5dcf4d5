//! kvroute's indexer: the radix index of which worker holds which prefix.
//!
//! [`index`] is the pure core (no I/O); [`replica`] is the replicated state built from the event
//! log (pure); [`service`] is the process around it (NATS, etcd, HTTP); [`config`] its flags.
//! `workload` (feature `workload`) replays Mooncake traces into KV events for the benches.

pub mod config;
pub mod index;
pub mod replica;
pub mod service;
#[cfg(feature = "workload")]
pub mod workload;

pub use index::{
    Anomalies, ApplyError, ApplyOk, BatchOutcome, ConfigError, IndexConfig, IndexStats,
    OverlapScores, PinnedIndex, RadixIndex, SharedIndex, SnapshotError, WorkerBlocks,
};
