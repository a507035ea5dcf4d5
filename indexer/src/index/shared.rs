//! [`SharedIndex`]: one writer applying events while many readers match, across threads, with
//! readers that never wait for the writer and long reads (snapshots, digests) that never make
//! the writer wait.
//!
//! Design (measured alternatives in ARCHITECTURE.md, "Radix index"): two copies of the
//! single-writer [`RadixIndex`], each behind its own reader-writer lock, and an atomic naming
//! the *front* copy, the one readers use. The writer applies each change to the back copy,
//! makes it the front, then applies the same change to the old front. It holds at most one
//! copy's lock at a time and never the front's, so a reader's read lock is always free at
//! once; a reader that loaded the front just before a flip and finds its copy taken reads the
//! other, which is then the new front.
//!
//! A long read [pins](SharedIndex::try_pin) a copy in its current state. While a copy is pinned
//! the writer applies changes to the other copy only and queues them for the pinned one
//! (cloned); once unpinned, the copy catches up a bounded amount of queued work per write,
//! so neither the pin nor the catch-up stalls the writer. Meanwhile readers use the up-to-date
//! copy, and read the lagging one (a consistent state, older by the queued changes) only in
//! the instants the writer holds the up-to-date copy.
//!
//! Costs: twice the memory of one [`RadixIndex`], and every change is applied twice (the
//! second time to memory the first application did not warm). A state built before anyone
//! reads it — an indexer catching up with the log — can start as [one copy](SharedIndex::solo)
//! and take its second when it starts answering. After every change returns,
//! both copies hold the same state unless one is pinned or catching up.
//!
//! *Invariants:* copy `c` equals the current state minus `behind[c]` applied in order; a pinned
//! copy is never written; at most one copy is pinned or behind at a time, so every write is
//! applied at once to at least one copy, and the front copy is always up to date.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{KvEventBatch, KvEventData};

use super::config::IndexConfig;
use super::matches::OverlapScores;
use super::outcome::{ApplyError, ApplyOk, BatchOutcome};
use super::radix::RadixIndex;
use super::snapshot::SnapshotError;
use super::stats::IndexStats;

/// A cloneable, thread-safe handle to one index held as two copies. Any clone may write;
/// writes are serialized.
#[derive(Debug, Clone)]
pub struct SharedIndex {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    copies: [RwLock<RadixIndex>; 2],
    /// The copy readers use: the one written first, so always at least as new as the other.
    front: AtomicUsize,
    writer: Mutex<WriterState>,
    /// One copy only (copy 0), for a state nobody reads while it is built: see
    /// [`SharedIndex::solo`].
    solo: AtomicBool,
    /// Work (in blocks) of queued changes a copy catches up per write, at most (or twice the
    /// write's own work, if more).
    catch_up_blocks: usize,
}

#[derive(Debug, Default)]
struct WriterState {
    /// Changes each copy has not had yet, oldest first.
    behind: [ChangeQueue; 2],
    /// Pins held on each copy.
    pins: [usize; 2],
}

/// Changes a copy has not had yet, oldest first, in segments of [`SEGMENT`] changes: growing
/// never copies what is queued (a `VecDeque` doubling under a million queued changes copies
/// tens of megabytes while the writer waits).
#[derive(Debug, Default)]
struct ChangeQueue {
    segments: VecDeque<VecDeque<Change>>,
    len: usize,
}

const SEGMENT: usize = 4096;

impl ChangeQueue {
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, change: Change) {
        match self.segments.back_mut() {
            Some(last) if last.len() < SEGMENT => last.push_back(change),
            _ => {
                let mut seg = VecDeque::with_capacity(SEGMENT);
                seg.push_back(change);
                self.segments.push_back(seg);
            }
        }
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Change> {
        let first = self.segments.front_mut()?;
        let change = first.pop_front();
        if first.is_empty() {
            self.segments.pop_front();
        }
        self.len -= usize::from(change.is_some());
        change
    }
}

/// One change, owned, for a copy that applies it later.
#[derive(Debug, Clone)]
enum Change {
    Event {
        worker_id: WorkerId,
        dp_rank: DpRank,
        data: KvEventData,
    },
    RemoveWorker(WorkerId),
    RemoveWorkerDpRank(WorkerId, DpRank),
}

/// Work of one event, in blocks (what applying it costs, roughly).
fn blocks_of(data: &KvEventData) -> usize {
    data.block_count().max(1)
}

impl Change {
    fn cost(&self) -> usize {
        match self {
            Change::Event { data, .. } => blocks_of(data),
            Change::RemoveWorker(_) | Change::RemoveWorkerDpRank(..) => 1,
        }
    }

    fn apply(&self, ix: &mut RadixIndex) {
        match self {
            Change::Event {
                worker_id,
                dp_rank,
                data,
            } => {
                let _ = ix.apply(*worker_id, *dp_rank, data);
            }
            Change::RemoveWorker(w) => ix.remove_worker(*w),
            Change::RemoveWorkerDpRank(w, r) => ix.remove_worker_dp_rank(*w, *r),
        }
    }
}

/// The events of one write, borrowed from the caller.
#[derive(Clone, Copy)]
enum Write<'a> {
    Events {
        worker_id: WorkerId,
        dp_rank: DpRank,
        events: &'a [KvEventData],
    },
    Batch(&'a KvEventBatch),
    RemoveWorker(WorkerId),
    RemoveWorkerDpRank(WorkerId, DpRank),
}

impl Write<'_> {
    fn cost(self) -> usize {
        match self {
            Write::Events { events, .. } => events.iter().map(blocks_of).sum(),
            Write::Batch(b) => b.events.iter().map(|e| blocks_of(&e.data)).sum(),
            Write::RemoveWorker(_) | Write::RemoveWorkerDpRank(..) => 1,
        }
    }

    fn apply(self, ix: &mut RadixIndex) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        match self {
            Write::Events {
                worker_id,
                dp_rank,
                events,
            } => {
                for data in events {
                    outcome.record(ix.apply(worker_id, dp_rank, data));
                }
            }
            Write::Batch(batch) => outcome = ix.apply_batch(batch),
            Write::RemoveWorker(w) => ix.remove_worker(w),
            Write::RemoveWorkerDpRank(w, r) => ix.remove_worker_dp_rank(w, r),
        }
        outcome
    }

    fn queue(self, behind: &mut ChangeQueue) {
        let event = |worker_id, dp_rank, data: &KvEventData| Change::Event {
            worker_id,
            dp_rank,
            data: data.clone(),
        };
        match self {
            Write::Events {
                worker_id,
                dp_rank,
                events,
            } => {
                for d in events {
                    behind.push(event(worker_id, dp_rank, d));
                }
            }
            Write::Batch(b) => {
                for e in &b.events {
                    behind.push(event(b.worker_id, b.dp_rank, &e.data));
                }
            }
            Write::RemoveWorker(w) => behind.push(Change::RemoveWorker(w)),
            Write::RemoveWorkerDpRank(w, r) => behind.push(Change::RemoveWorkerDpRank(w, r)),
        }
    }
}

/// A copy held in one state for a long read; see [`SharedIndex::pin`]. `Send` and `Sync`:
/// take it on the writer's thread, read it on another.
#[derive(Debug)]
pub struct PinnedIndex {
    inner: Arc<Inner>,
    copy: usize,
}

impl PinnedIndex {
    /// Runs `f` on the pinned state (which no write changes while the pin lives).
    pub fn with<R>(&self, f: impl FnOnce(&RadixIndex) -> R) -> R {
        f(&self.inner.read_copy(self.copy))
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.with(RadixIndex::snapshot)
    }

    pub fn digest(&self) -> u64 {
        self.with(RadixIndex::digest)
    }
}

impl Drop for PinnedIndex {
    fn drop(&mut self) {
        self.inner.writer().pins[self.copy] -= 1;
    }
}

impl Inner {
    fn writer(&self) -> MutexGuard<'_, WriterState> {
        // A panic inside the index would be a bug; each copy stays consistent per event, so
        // keep serving rather than poisoning every caller.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_copy(&self, c: usize) -> RwLockReadGuard<'_, RadixIndex> {
        self.copies[c].read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_copy(&self, c: usize) -> RwLockWriteGuard<'_, RadixIndex> {
        self.copies[c].write().unwrap_or_else(|p| p.into_inner())
    }

    /// The newest readable state: the front copy, or, in the instants the writer holds it,
    /// the other one.
    fn read(&self) -> RwLockReadGuard<'_, RadixIndex> {
        if self.solo.load(Ordering::Acquire) {
            return self.read_copy(0);
        }
        loop {
            let f = self.front.load(Ordering::Acquire);
            for c in [f, 1 - f] {
                match self.copies[c].try_read() {
                    Ok(g) => return g,
                    Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                    Err(TryLockError::WouldBlock) => {}
                }
            }
            // Both taken: the writer moved from one to the other between the two attempts.
            std::hint::spin_loop();
        }
    }

    /// Applies `w` to every copy that can take it now and queues it for the others. Returns
    /// the outcome of its first application.
    fn write(&self, w: Write<'_>) -> BatchOutcome {
        let mut state = self.writer();
        if self.solo.load(Ordering::Relaxed) {
            return w.apply(&mut self.write_copy(0));
        }
        let front = self.front.load(Ordering::Relaxed);
        let mut outcome = None;
        // The back copy first, so readers keep an untouched front meanwhile.
        for c in [1 - front, front] {
            if state.pins[c] > 0 {
                w.queue(&mut state.behind[c]);
                continue;
            }
            let mut ix = self.write_copy(c);
            let behind = &mut state.behind[c];
            // Catch up a bounded amount of work, and always more than this write adds, so the
            // queue drains.
            let budget = self.catch_up_blocks.max(2 * w.cost());
            let mut spent = 0;
            while spent < budget {
                let Some(change) = behind.pop() else { break };
                spent += change.cost();
                change.apply(&mut ix);
            }
            if behind.is_empty() {
                let got = w.apply(&mut ix);
                drop(ix);
                if let Some(first) = &outcome {
                    debug_assert_eq!(*first, got, "the copies diverged");
                } else {
                    outcome = Some(got);
                }
                // Up to date: readers move here before the other copy is touched.
                if c != front {
                    self.front.store(c, Ordering::Release);
                }
            } else {
                w.queue(behind);
            }
        }
        // One copy is always up to date (see `pin`), and it took the change.
        outcome.expect("an up-to-date copy applied the change")
    }

    /// Pins a copy that holds the current state, keeping the other one up to date for the
    /// writer: `None` while that is impossible (the other copy is pinned with changes since, or
    /// a copy is still catching up after an earlier pin).
    fn try_pin(self: &Arc<Self>) -> Option<PinnedIndex> {
        let mut state = self.writer();
        if self.solo.load(Ordering::Relaxed) {
            return None;
        }
        let front = self.front.load(Ordering::Relaxed);
        // The back copy first, so readers keep the front to themselves.
        let copy = [1 - front, front].into_iter().find(|&c| {
            let other = 1 - c;
            state.behind[c].is_empty() && state.behind[other].is_empty() && state.pins[other] == 0
        })?;
        state.pins[copy] += 1;
        Some(PinnedIndex {
            inner: self.clone(),
            copy,
        })
    }
}

impl SharedIndex {
    /// A shared empty index. Panics like [`RadixIndex::new`] on an invalid config.
    pub fn new(config: IndexConfig) -> Self {
        Self::from_index(RadixIndex::new(config))
    }

    /// Shares an existing index (for example one just restored); the second copy is a clone.
    pub fn from_index(index: RadixIndex) -> Self {
        let second = index.clone();
        Self::from_parts(index, second)
    }

    fn from_parts(index: RadixIndex, second: RadixIndex) -> Self {
        let catch_up_blocks = 64 * index.config().write_chunk_events;
        Self {
            inner: Arc::new(Inner {
                copies: [RwLock::new(index), RwLock::new(second)],
                front: AtomicUsize::new(0),
                writer: Mutex::new(WriterState::default()),
                solo: AtomicBool::new(false),
                catch_up_blocks,
            }),
        }
    }

    /// Restores a snapshot into a shared index.
    pub fn restore(bytes: &[u8]) -> Result<Self, SnapshotError> {
        RadixIndex::restore(bytes).map(Self::from_index)
    }

    /// Shares `index` as one copy, for a state that is built before anyone reads it (an
    /// indexer catching up with the log applies at the one-copy rate): readers and the writer
    /// exclude each other, and nothing can be pinned, until
    /// [`SharedIndex::attach_second_copy`].
    pub fn solo(index: RadixIndex) -> Self {
        let shared = Self::from_parts(index, RadixIndex::new(IndexConfig::default()));
        shared.inner.solo.store(true, Ordering::Release);
        shared
    }

    /// Ends [`SharedIndex::solo`]: the second copy becomes a clone of the first (writes wait
    /// for the clone), and from then on readers never wait. Does nothing on two copies.
    pub fn attach_second_copy(&self) {
        let _state = self.inner.writer();
        if self.inner.solo.load(Ordering::Relaxed) {
            let second = self.inner.read_copy(0).clone();
            *self.inner.write_copy(1) = second;
            self.inner.front.store(0, Ordering::Release);
            self.inner.solo.store(false, Ordering::Release);
        }
    }

    /// Whether the index is one copy (see [`SharedIndex::solo`]).
    pub fn is_solo(&self) -> bool {
        self.inner.solo.load(Ordering::Acquire)
    }

    pub fn apply(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        event: &KvEventData,
    ) -> Result<ApplyOk, ApplyError> {
        let outcome = self.inner.write(Write::Events {
            worker_id,
            dp_rank,
            events: std::slice::from_ref(event),
        });
        match outcome.first_error {
            Some(e) => Err(e),
            None => Ok(outcome.totals),
        }
    }

    /// Applies the events of one (worker, dp rank) in order, as one write: readers see all of
    /// them or none (a refused event does not stop the rest).
    pub fn apply_events(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        events: &[KvEventData],
    ) -> BatchOutcome {
        self.inner.write(Write::Events {
            worker_id,
            dp_rank,
            events,
        })
    }

    /// Applies a batch as one write.
    pub fn apply_batch(&self, batch: &KvEventBatch) -> BatchOutcome {
        self.inner.write(Write::Batch(batch))
    }

    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.inner.write(Write::RemoveWorker(worker_id));
    }

    pub fn remove_worker_dp_rank(&self, worker_id: WorkerId, dp_rank: DpRank) {
        self.inner
            .write(Write::RemoveWorkerDpRank(worker_id, dp_rank));
    }

    pub fn find_matches(&self, local_hashes: &[LocalBlockHash]) -> OverlapScores {
        self.inner.read().find_matches(local_hashes)
    }

    pub fn find_matches_for_tokens(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora_name: Option<&str>,
    ) -> OverlapScores {
        // Hash before taking the copy.
        let hashes = kvroute_common::hashing::local_block_hashes(
            tokens,
            block_size,
            kvroute_common::hashing::seed_for_lora(lora_name),
        );
        self.find_matches(&hashes)
    }

    /// Holds a copy in the current state for a long read on any thread, without stopping the
    /// writer (see the module docs). Drop the pin when done: until then the writer queues every
    /// change for that copy. `None` while an earlier pin (or its catch-up) is in the way: at
    /// most one copy is held back at a time, so the writer always has an up-to-date copy.
    pub fn try_pin(&self) -> Option<PinnedIndex> {
        self.inner.try_pin()
    }

    /// The digest of the current state: on a pinned copy when one can be had, else on the front
    /// (which makes a writer on another thread wait until it is done).
    pub fn digest(&self) -> u64 {
        match self.try_pin() {
            Some(p) => p.digest(),
            None => self.inner.read().digest(),
        }
    }

    /// A snapshot of the current state, written like [`SharedIndex::digest`] is computed.
    pub fn snapshot(&self) -> Vec<u8> {
        match self.try_pin() {
            Some(p) => p.snapshot(),
            None => self.inner.read().snapshot(),
        }
    }

    /// Stats of the current state; `bytes_in_use` counts both copies.
    pub fn stats(&self) -> IndexStats {
        let mut stats = self.inner.read().stats();
        if !self.is_solo() {
            stats.bytes_in_use = (0..2)
                .map(|c| self.inner.read_copy(c).stats().bytes_in_use)
                .sum();
        }
        stats
    }

    pub fn workers(&self) -> Vec<(WorkerId, DpRank)> {
        self.inner.read().workers()
    }

    /// Runs `f` with read access to the newest readable state (several queries under one
    /// hold). Keep it short: a long read belongs on a [`SharedIndex::pin`].
    pub fn with_read<R>(&self, f: impl FnOnce(&RadixIndex) -> R) -> R {
        f(&self.inner.read())
    }
}

#[cfg(test)]
mod tests;
