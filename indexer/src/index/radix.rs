//! [`RadixIndex`]: the single-writer index — the writer's side and one view. Applies KV events
//! and answers overlap queries.
//!
//! *Invariant:* the index never performs I/O, reads a clock, or keeps global state; every
//! change comes through [`RadixIndex::apply`] (or the `remove_worker*` calls), and a refused
//! event changes nothing.

use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{KvEventBatch, KvEventData};

use super::config::IndexConfig;
use super::core::Core;
use super::matches::OverlapScores;
use super::ops::Rec;
use super::outcome::{ApplyError, ApplyOk, BatchOutcome};
use super::stats::IndexStats;
use super::view::View;

/// The exact prefix index: which (worker, dp rank) holds which chain of blocks.
///
/// Single writer: mutate through `&mut self`; share between threads with
/// [`crate::SharedIndex`].
#[derive(Debug)]
pub struct RadixIndex {
    pub(crate) core: Core,
    pub(crate) view: View,
}

impl Clone for RadixIndex {
    /// An independent copy (its own arena).
    fn clone(&self) -> Self {
        let arena = self.core.arena.deep_copy();
        let mut core = self.core.clone();
        core.arena = arena.clone();
        let mut view = self.view.clone();
        view.arena = arena;
        Self { core, view }
    }
}

impl RadixIndex {
    /// An empty index.
    ///
    /// # Panics
    /// If `config` fails [`IndexConfig::validate`]; validate it at startup.
    pub fn new(config: IndexConfig) -> Self {
        if let Err(e) = config.validate() {
            panic!("invalid IndexConfig: {e}");
        }
        Self {
            core: Core::new(config),
            view: View::default(),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.core.config
    }

    /// Runs one change through the core on the view, then frees what it dropped (nobody else
    /// reads this view).
    fn write<R>(&mut self, f: impl FnOnce(&mut Core, &mut Rec<'_>) -> R) -> R {
        let mut rec = Rec::new(&mut self.view, None);
        let out = f(&mut self.core, &mut rec);
        self.core.views_caught_up();
        out
    }

    /// Applies one event of `(worker_id, dp_rank)`. See [`ApplyOk`] and [`ApplyError`] for
    /// the outcome of each kind of input; applying the same event twice leaves the same
    /// logical state.
    pub fn apply(
        &mut self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        event: &KvEventData,
    ) -> Result<ApplyOk, ApplyError> {
        self.write(|core, rec| core.apply(rec, worker_id, dp_rank, event))
    }

    /// Applies every event of a batch in order; a refused event does not stop the rest.
    pub fn apply_batch(&mut self, batch: &KvEventBatch) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        for event in &batch.events {
            outcome.record(self.apply(batch.worker_id, batch.dp_rank, &event.data));
        }
        outcome
    }

    /// Drops everything every dp rank of `worker_id` holds.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.write(|core, rec| core.remove_worker(rec, worker_id));
    }

    /// Drops everything `(worker_id, dp_rank)` holds (same as a `Cleared` event).
    pub fn remove_worker_dp_rank(&mut self, worker_id: WorkerId, dp_rank: DpRank) {
        self.write(|core, rec| core.remove_worker_dp_rank(rec, worker_id, dp_rank));
    }

    /// Every (worker, dp rank) holding at least one block, sorted.
    pub fn workers(&self) -> Vec<(WorkerId, DpRank)> {
        self.view.workers()
    }

    /// Total (block, worker, dp rank) entries.
    pub fn len(&self) -> usize {
        self.core.entries
    }

    pub fn is_empty(&self) -> bool {
        self.core.entries == 0
    }

    /// Sizes, memory and anomaly counters. O(nodes + workers).
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            nodes: self.view.blocks(),
            runs: self.view.len(),
            entries: self.core.entries,
            blocks_per_worker: self.core.blocks_per_worker(),
            bytes_in_use: std::mem::size_of::<Self>()
                + self.core.bytes()
                + self.view.bytes()
                + self.core.arena.bytes(),
            anomalies: self.core.anomalies,
        }
    }

    /// Matches a prompt given as local block hashes (`tokens_hash` of each full block).
    pub fn find_matches(&self, local_hashes: &[LocalBlockHash]) -> OverlapScores {
        self.view.find_matches(local_hashes)
    }

    /// Matches a prompt given as token ids (see [`View::find_matches_for_tokens`]).
    pub fn find_matches_for_tokens(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora_name: Option<&str>,
    ) -> OverlapScores {
        self.view
            .find_matches_for_tokens(tokens, block_size, lora_name)
    }

    /// Where the bytes of [`RadixIndex::stats`] go, by part: a diagnostic for the benches.
    pub fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        let core = self.core.memory();
        vec![
            ("block maps", core.maps),
            ("arena (allocated)", self.core.arena.bytes()),
            ("arena (live extents)", core.arena_slots_live * 8),
            ("arena (blocks in runs)", self.view.blocks() * 8),
            ("slot -> node", core.slot_nodes),
            ("view", self.view.bytes()),
            ("writer, other", core.other),
        ]
    }

    /// True if some node holds nothing for anyone (a leak; tests check there is none).
    pub fn has_unused_node(&self) -> bool {
        self.view.has_unused_node()
    }
}

impl View {
    /// Every pair in use, sorted by (worker, rank).
    pub(crate) fn workers(&self) -> Vec<(WorkerId, DpRank)> {
        let mut out: Vec<_> = self
            .pairs()
            .map(|(_, p)| (p.worker_id, p.dp_rank))
            .collect();
        out.sort_unstable();
        out
    }
}
