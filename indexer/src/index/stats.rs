//! What the index holds and what odd input it has seen: for metrics and memory checks.

use kvroute_common::ids::{DpRank, WorkerId};

/// Counts of odd input, since the index was created (kept across snapshot and restore).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Anomalies {
    /// `Stored` events refused because the parent block was unknown.
    pub parent_unknown_events: u64,
    /// Blocks in those refused events.
    pub parent_unknown_blocks: u64,
    /// `Removed` block hashes (or tiers) the (worker, rank) did not hold: no-ops.
    pub removed_unknown_blocks: u64,
    /// Stored blocks already held in that tier: no-ops.
    pub duplicate_stored_blocks: u64,
    /// Stored block hashes that already named a *different* block of that (worker, rank):
    /// the old block is dropped and the hash now names the new one.
    pub rebound_blocks: u64,
    /// Stored blocks the (worker, rank) already held under another block hash: the first
    /// hash keeps naming it, the new hash is not recorded (only the tier is added).
    pub aliased_blocks: u64,
    /// Entries evicted to respect `IndexConfig::max_entries`.
    pub evicted_entries: u64,
}

/// How many blocks one (worker, dp rank) holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerBlocks {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub blocks: u64,
}

/// A point-in-time view of the index's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct prefixes (blocks in the tree), not counting the root.
    pub nodes: usize,
    /// Runs of blocks the tree keeps them in (its nodes).
    pub runs: usize,
    /// (block, worker, dp rank) entries.
    pub entries: usize,
    /// Blocks held per (worker, dp rank), sorted by worker then rank; pairs holding nothing
    /// are absent.
    pub blocks_per_worker: Vec<WorkerBlocks>,
    /// Bytes allocated by the index's own tables (capacity, not just length).
    pub bytes_in_use: usize,
    pub anomalies: Anomalies,
}
