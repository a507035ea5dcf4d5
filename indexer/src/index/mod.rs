//! The radix index: an exact prefix index of which (worker, dp rank) holds which chain of KV
//! blocks, and the thread-safe handle around it.
//!
//! - [`RadixIndex`] (`radix.rs`): the single-writer core; `apply` / `find_matches`;
//! - `tree.rs`: the shared prefix tree keyed by `tokens_hash`, with each node's owners;
//! - `workers.rs`: per (worker, dp rank), the engine's block hash → node;
//! - `matches.rs`: overlap queries and [`OverlapScores`];
//! - `eviction.rs`: the eviction order behind [`IndexConfig::max_entries`];
//! - `digest.rs`, `snapshot.rs`: state digest, and snapshot / restore;
//! - [`SharedIndex`] (`shared.rs`): one writer, many concurrent readers that never wait for
//!   it (two copies), and pinned copies for long reads.
//!
//! *Invariant:* no I/O, no clock, no global state, no `unsafe`.

mod config;
mod digest;
mod eviction;
mod matches;
mod outcome;
mod radix;
mod shared;
mod snapshot;
mod stats;
mod tree;
mod workers;

pub use config::{ConfigError, IndexConfig, MAX_ENTRIES_LIMIT};
pub use matches::OverlapScores;
pub use outcome::{ApplyError, ApplyOk, BatchOutcome};
pub use radix::RadixIndex;
pub use shared::{PinnedIndex, SharedIndex};
pub use snapshot::{SNAPSHOT_VERSION, SnapshotError};
pub use stats::{Anomalies, IndexStats, WorkerBlocks};
