//! kvroute's indexer: the radix index of which worker holds which prefix.
//!
//! [`index`] is the pure core (no I/O); `workload` (feature `workload`) replays Mooncake
//! traces into KV events for the benches.

pub mod index;
#[cfg(feature = "workload")]
pub mod workload;

pub use index::{
    Anomalies, ApplyError, ApplyOk, BatchOutcome, ConfigError, IndexConfig, IndexStats,
    OverlapScores, RadixIndex, SharedIndex, SnapshotError, WorkerBlocks,
};
