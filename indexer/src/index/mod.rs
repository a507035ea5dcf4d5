//! The radix index: an exact prefix index of which (worker, dp rank) holds which chain of KV
//! blocks, and the thread-safe handle around it.
//!
//! - [`RadixIndex`] (`radix.rs`): the single-writer index; `apply` / `find_matches`;
//! - `arena.rs`: every block's `tokens_hash` in one slot of a chunked arena; `extents.rs`: the
//!   ranges of it that runs live in;
//! - `view.rs`: what readers use — runs of blocks (nodes), their owners, the child edges, the
//!   (worker, rank) table — changed only through `ops.rs`;
//! - `core/`: the writer's side — per (worker, rank) the engine hash → slot map
//!   (`blockmap.rs`), each slot's node, and applying events;
//! - `matches.rs`: overlap queries and [`OverlapScores`];
//! - `eviction.rs`: the eviction order behind [`IndexConfig::max_entries`];
//! - `digest.rs`, `snapshot.rs` (`snapshot/v1.rs`): state digest, and snapshot / restore;
//! - [`SharedIndex`] (`shared.rs`): one writer, many concurrent readers that never wait for
//!   it (two views), and pins for snapshots that never stop it.
//!
//! Why runs (BENCHMARKS.md, "Radix index v3"): the v2 layout kept one 32-byte node per block,
//! so a walk read up to thousands of nodes and a store touched a node, an edge and a worker
//! table per block. Runs cut the tree to about one 8-byte hash per block (16 workers, 2.1 M
//! entries: 1.57 M blocks in about 4,000 runs), and a long prompt is a few compare loops.
//! Considered and not built: splitting at every divergence *and* keeping per-block nodes (v2),
//! and one engine hash per block shared by all workers with per-worker exception maps (smaller
//! at high sharing, but it changes what a worker's hash names).
//!
//! *Invariants:* no I/O, no clock, no global state; no `unsafe` (the prefetch hint that
//! `blockmap.rs` calls is the crate `kvroute-prefetch`, `indexer/prefetch`). The tree holds
//! exactly the prefixes of held blocks — every run's blocks are held by someone or lie before
//! a child — so churn leaves nothing behind (`tests/churn.rs`; the differential test compares
//! block counts with a model). A refused event changes nothing; an owner holds a prefix of a
//! run in one set of tiers.

mod arena;
mod blockmap;
mod config;
mod core;
mod digest;
mod eviction;
mod extents;
mod matches;
mod ops;
mod outcome;
mod radix;
mod shared;
mod snapshot;
mod stats;
mod view;

pub use config::{ConfigError, IndexConfig, MAX_ENTRIES_LIMIT};
pub use matches::OverlapScores;
pub use outcome::{ApplyError, ApplyOk, BatchOutcome};
pub use radix::RadixIndex;
pub use shared::{PinnedIndex, SharedIndex};
pub use snapshot::{SNAPSHOT_VERSION, SnapshotError};
pub use stats::{Anomalies, IndexStats, WorkerBlocks};
