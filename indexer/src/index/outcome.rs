//! What applying an event did: the success summary, the typed refusal, and batch totals.

use kvroute_common::hashing::SequenceHash;
use kvroute_common::ids::{DpRank, WorkerId};

/// What one accepted event changed. Every block named by the event lands in exactly one of
/// `stored`, `removed` or `unchanged`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOk {
    /// Blocks newly held by the worker, or newly held in the event's tier.
    pub stored: u32,
    /// Blocks (or one tier of a block) the worker no longer holds; for `Cleared`, every entry.
    pub removed: u32,
    /// Blocks that changed nothing: already held in that tier, or removal of a block (or
    /// tier) the worker does not hold.
    pub unchanged: u32,
    /// Entries of any worker evicted to stay within `IndexConfig::max_entries`.
    pub evicted: u32,
}

/// An event the index refused. The index is unchanged by a refused event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// A `Stored` names a parent block this (worker, dp rank) does not hold. Usually a lost or
    /// reordered event; the service should resync the worker.
    #[error(
        "worker {worker_id} rank {dp_rank}: stored blocks under unknown parent {parent_hash:#018x}"
    )]
    ParentUnknown {
        worker_id: WorkerId,
        dp_rank: DpRank,
        parent_hash: SequenceHash,
    },
    /// More distinct (worker, dp rank) pairs hold blocks than the index can number.
    #[error("worker {worker_id} rank {dp_rank}: more than {limit} (worker, rank) pairs")]
    TooManyWorkers {
        worker_id: WorkerId,
        dp_rank: DpRank,
        limit: usize,
    },
}

/// Totals of [`crate::RadixIndex::apply_batch`]: every event is applied or refused on its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Events accepted.
    pub applied: u32,
    /// Events refused (see [`ApplyError`]); `first_error` is the first of them.
    pub refused: u32,
    /// Sum of the accepted events' [`ApplyOk`].
    pub totals: ApplyOk,
    pub first_error: Option<ApplyError>,
}

impl ApplyOk {
    pub(crate) fn add(&mut self, other: ApplyOk) {
        self.stored += other.stored;
        self.removed += other.removed;
        self.unchanged += other.unchanged;
        self.evicted += other.evicted;
    }
}

impl BatchOutcome {
    /// Folds one event's result into the totals.
    pub fn record(&mut self, result: Result<ApplyOk, ApplyError>) {
        match result {
            Ok(ok) => {
                self.applied += 1;
                self.totals.add(ok);
            }
            Err(e) => {
                self.refused += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    /// Folds another batch's totals into these.
    pub fn merge(&mut self, other: BatchOutcome) {
        self.applied += other.applied;
        self.refused += other.refused;
        self.totals.add(other.totals);
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}
