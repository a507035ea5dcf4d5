//! [`SharedIndex`]: one writer applying events while many readers match, across threads.
//!
//! Design (measured alternatives in ARCHITECTURE.md, "Indexer"): the single-writer
//! [`RadixIndex`] behind a reader-writer lock. Readers share the lock; the writer takes it
//! for at most `IndexConfig::write_chunk_events` events at a time, so a reader waits behind
//! at most one chunk, never behind a whole burst. Snapshots and digests run under a read
//! lock and so never block readers.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{KvEventBatch, KvEventData};

use super::config::IndexConfig;
use super::matches::OverlapScores;
use super::outcome::{ApplyError, ApplyOk, BatchOutcome};
use super::radix::RadixIndex;
use super::snapshot::SnapshotError;
use super::stats::IndexStats;

/// A cloneable, thread-safe handle to one [`RadixIndex`]. Any clone may write, but the design
/// assumes one writer thread (writes are serialized by the lock either way).
#[derive(Debug, Clone)]
pub struct SharedIndex {
    inner: Arc<RwLock<RadixIndex>>,
    chunk: usize,
}

impl SharedIndex {
    /// A shared empty index. Panics like [`RadixIndex::new`] on an invalid config.
    pub fn new(config: IndexConfig) -> Self {
        Self::from_index(RadixIndex::new(config))
    }

    /// Shares an existing index (for example one just restored).
    pub fn from_index(index: RadixIndex) -> Self {
        let chunk = index.config().write_chunk_events;
        Self {
            inner: Arc::new(RwLock::new(index)),
            chunk,
        }
    }

    /// Restores a snapshot into a shared index.
    pub fn restore(bytes: &[u8]) -> Result<Self, SnapshotError> {
        RadixIndex::restore(bytes).map(Self::from_index)
    }

    fn read(&self) -> RwLockReadGuard<'_, RadixIndex> {
        // A panic inside the index would be a bug; its state stays consistent per event, so
        // keep serving rather than poisoning every reader.
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, RadixIndex> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn apply(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        event: &KvEventData,
    ) -> Result<ApplyOk, ApplyError> {
        self.write().apply(worker_id, dp_rank, event)
    }

    /// Applies a batch, releasing the lock every `write_chunk_events` events.
    pub fn apply_batch(&self, batch: &KvEventBatch) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        for chunk in batch.events.chunks(self.chunk) {
            let mut index = self.write();
            for event in chunk {
                outcome.record(index.apply(batch.worker_id, batch.dp_rank, &event.data));
            }
        }
        outcome
    }

    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.write().remove_worker(worker_id);
    }

    pub fn remove_worker_dp_rank(&self, worker_id: WorkerId, dp_rank: DpRank) {
        self.write().remove_worker_dp_rank(worker_id, dp_rank);
    }

    pub fn find_matches(&self, local_hashes: &[LocalBlockHash]) -> OverlapScores {
        self.read().find_matches(local_hashes)
    }

    pub fn find_matches_for_tokens(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora_name: Option<&str>,
    ) -> OverlapScores {
        // Hash outside the lock.
        let hashes = kvroute_common::hashing::local_block_hashes(
            tokens,
            block_size,
            kvroute_common::hashing::seed_for_lora(lora_name),
        );
        self.find_matches(&hashes)
    }

    pub fn digest(&self) -> u64 {
        self.read().digest()
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.read().snapshot()
    }

    pub fn stats(&self) -> IndexStats {
        self.read().stats()
    }

    pub fn workers(&self) -> Vec<(WorkerId, DpRank)> {
        self.read().workers()
    }

    /// Runs `f` with read access to the whole index (several queries under one lock hold).
    pub fn with_read<R>(&self, f: impl FnOnce(&RadixIndex) -> R) -> R {
        f(&self.read())
    }

    /// Runs `f` with write access (for callers that batch their own way).
    pub fn with_write<R>(&self, f: impl FnOnce(&mut RadixIndex) -> R) -> R {
        f(&mut self.write())
    }
}
