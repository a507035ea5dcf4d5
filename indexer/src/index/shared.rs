//! [`SharedIndex`]: one writer applying events while many readers match, across threads, with
//! readers that never wait for the writer and snapshots that never make the writer wait.
//!
//! Design (alternatives measured by `benches/concurrency.rs`; BENCHMARKS.md, "Readers and
//! snapshots under a writer"): the writer's side (the pairs' maps, each block's node, the
//! extents) exists once, behind the writer's mutex; readers
//! use two [`View`]s of the tree, each behind its own reader-writer lock, and an atomic naming
//! the *front* view. The block hashes live in the arena both views share; the views themselves
//! are small (runs, owners, edges). A write runs the core on the back view, recording its
//! [`Op`]s, makes that view the front, then replays the ops on the old front. The writer holds
//! at most one view's lock at a time and never the front's while it is current, so a reader's
//! read lock is free at once; a reader that finds its view taken (just after a flip) reads the
//! other, which is then the front. The writer may wait for readers: its replay onto the old
//! front waits for queries that began before the flip (microseconds, or a time slice when such
//! a reader loses its core).
//!
//! A snapshot [pins](SharedIndex::try_pin) the back view: while pinned the writer applies to the
//! front only and queues the ops for the pinned view, which catches up a bounded amount per
//! write once unpinned. The maps of the pin's moment are copied by the writer before it changes
//! each one and by the snapshot's thread for the rest, a bounded amount at a time (`core/pin.rs`).
//! Freed ranges of the arena are reused only once no view references them.
//!
//! *Invariants:* a view equals the current state minus its queued ops; a pinned view is never
//! written; at most one view is pinned or behind at a time, so every write is applied at once
//! to at least one view, and the front view is always up to date.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{KvEventBatch, KvEventData};

use super::config::IndexConfig;
use super::core::{Core, PinMaps};
use super::digest::digest_of;
use super::matches::OverlapScores;
use super::ops::{Op, Rec};
use super::outcome::{ApplyError, ApplyOk, BatchOutcome};
use super::radix::RadixIndex;
use super::snapshot::{Meta, SnapshotError};
use super::stats::IndexStats;
use super::view::View;

/// A cloneable, thread-safe handle to one index read through two views. Any clone may write;
/// writes are serialized.
#[derive(Debug, Clone)]
pub struct SharedIndex {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    views: [RwLock<View>; 2],
    /// The view readers use: always up to date.
    front: AtomicUsize,
    writer: Mutex<Writer>,
    /// Writers waiting for `writer`, so a snapshot's thread copying maps between writes lets
    /// them in before it takes the lock again.
    waiting: AtomicUsize,
    /// One view only (view 0), for a state nobody reads while it is built: see
    /// [`SharedIndex::solo`].
    solo: AtomicBool,
    /// Ops a lagging view catches up per write, at most (or twice the write's own, if more).
    catch_up_ops: usize,
}

#[derive(Debug)]
struct Writer {
    core: Core,
    /// Ops each view has not had yet, one entry per write, oldest first.
    behind: [VecDeque<Vec<Op>>; 2],
    pins: [usize; 2],
    /// The ops of the write in progress (kept to reuse its allocation).
    log: Vec<Op>,
}

/// The changes of one write, borrowed from the caller.
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
    fn apply(self, core: &mut Core, rec: &mut Rec<'_>) -> BatchOutcome {
        let mut outcome = BatchOutcome::default();
        match self {
            Write::Events {
                worker_id,
                dp_rank,
                events,
            } => {
                for data in events {
                    outcome.record(core.apply(rec, worker_id, dp_rank, data));
                }
            }
            Write::Batch(batch) => {
                for e in &batch.events {
                    outcome.record(core.apply(rec, batch.worker_id, batch.dp_rank, &e.data));
                }
            }
            Write::RemoveWorker(w) => core.remove_worker(rec, w),
            Write::RemoveWorkerDpRank(w, r) => core.remove_worker_dp_rank(rec, w, r),
        }
        outcome
    }
}

/// A view held in one state for a long read (a snapshot or a digest); see
/// [`SharedIndex::try_pin`]. `Send` and `Sync`: take it on the writer's thread, read it on
/// another.
#[derive(Debug)]
pub struct PinnedIndex {
    inner: Arc<Inner>,
    view: usize,
    maps: Arc<PinMaps>,
    meta: Meta,
}

/// Map entries the snapshot's thread copies per hold of the writer's lock (whole maps: a hold
/// copies at least one). Between holds it lets a waiting writer in first (see
/// [`Inner::waiting`]).
const COPY_BUDGET: usize = 1 << 14;

impl PinnedIndex {
    /// Waits until every map of the pin's moment is copied (copying, a bounded amount per hold
    /// of the writer's lock, those the writer has not copied yet), then runs `f` on the state.
    fn with<R>(&self, f: impl FnOnce(&View, &[Option<super::blockmap::BlockMap>]) -> R) -> R {
        while !self.inner.writer().core.copy_pending(COPY_BUDGET) {
            // A mutex is not fair: released and taken again at once, it stays with this thread
            // while the writer it woke is still getting a core (measured: writes held up to
            // 25 ms). So wait until a waiting writer has it.
            while self.inner.waiting.load(Ordering::Acquire) > 0 {
                std::thread::yield_now();
            }
        }
        let view = self.inner.read_view(self.view);
        let maps = self.maps.lock();
        f(&view, &maps)
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.with(|view, maps| super::snapshot::write(view, maps, &self.meta))
    }

    pub fn digest(&self) -> u64 {
        self.with(digest_of)
    }
}

impl Drop for PinnedIndex {
    fn drop(&mut self) {
        let mut w = self.inner.writer();
        w.pins[self.view] -= 1;
        w.core.end_pin(&self.maps);
    }
}

impl Inner {
    fn writer(&self) -> MutexGuard<'_, Writer> {
        // A panic inside the index would be a bug; each view stays consistent per write, so
        // keep serving rather than poisoning every caller.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_view(&self, v: usize) -> RwLockReadGuard<'_, View> {
        self.views[v].read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_view(&self, v: usize) -> RwLockWriteGuard<'_, View> {
        self.views[v].write().unwrap_or_else(|p| p.into_inner())
    }

    /// The newest readable state: the front view, or, in the instants the writer holds it,
    /// the other one.
    fn read(&self) -> RwLockReadGuard<'_, View> {
        if self.solo.load(Ordering::Acquire) {
            return self.read_view(0);
        }
        loop {
            let f = self.front.load(Ordering::Acquire);
            for v in [f, 1 - f] {
                match self.views[v].try_read() {
                    Ok(g) => return g,
                    Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                    Err(TryLockError::WouldBlock) => {}
                }
            }
            // Both taken: the writer moved from one to the other between the two attempts.
            std::hint::spin_loop();
        }
    }

    /// Runs `w` through the core on an up-to-date view and replays its ops on the other (or
    /// queues them). Returns the write's outcome.
    fn write(&self, w: Write<'_>) -> BatchOutcome {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let mut guard = self.writer();
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        let st = &mut *guard;
        if self.solo.load(Ordering::Relaxed) {
            let mut view = self.write_view(0);
            let outcome = w.apply(&mut st.core, &mut Rec::new(&mut view, None));
            st.core.views_caught_up();
            return outcome;
        }
        let front = self.front.load(Ordering::Relaxed);
        let back = 1 - front;
        // The back view first, so readers keep an untouched front meanwhile; the front when
        // the back is pinned or still catching up.
        let first = if st.pins[back] == 0 && st.behind[back].is_empty() {
            back
        } else {
            front
        };
        let mut log = std::mem::take(&mut st.log);
        log.clear();
        let outcome = {
            let mut view = self.write_view(first);
            w.apply(&mut st.core, &mut Rec::new(&mut view, Some(&mut log)))
        };
        if first != front {
            // Up to date: readers move here before the other view is touched.
            self.front.store(first, Ordering::Release);
        }
        let other = 1 - first;
        if st.pins[other] > 0 {
            st.behind[other].push_back(log);
        } else {
            let mut view = self.write_view(other);
            let behind = &mut st.behind[other];
            // Catch up a bounded amount, and always more than this write adds, so the queue
            // drains.
            let budget = self.catch_up_ops.max(2 * log.len());
            let mut spent = 0;
            while spent < budget {
                let Some(ops) = behind.pop_front() else { break };
                spent += ops.len().max(1);
                for op in &ops {
                    view.apply(op);
                }
            }
            if behind.is_empty() {
                for op in &log {
                    view.apply(op);
                }
                st.log = log;
            } else {
                behind.push_back(log);
            }
        }
        if st.pins == [0, 0] && st.behind.iter().all(VecDeque::is_empty) {
            st.core.views_caught_up();
        }
        outcome
    }

    /// Pins the back view in the current state while the front stays up to date for the
    /// writer: `None` while that is impossible (a pin is held, or a view is still catching up
    /// after an earlier one).
    fn try_pin(self: &Arc<Self>) -> Option<PinnedIndex> {
        let mut st = self.writer();
        if self.solo.load(Ordering::Relaxed)
            || st.pins != [0, 0]
            || st.behind.iter().any(|b| !b.is_empty())
        {
            return None;
        }
        let view = 1 - self.front.load(Ordering::Relaxed);
        st.pins[view] += 1;
        let maps = st.core.start_pin();
        Some(PinnedIndex {
            inner: self.clone(),
            view,
            maps,
            meta: Meta::of(&st.core),
        })
    }

    /// Runs `f` on the whole current state with the writer stopped (for long reads when no
    /// view can be pinned).
    fn with_writer_stopped<R>(&self, f: impl FnOnce(&View, &Core) -> R) -> R {
        let st = self.writer();
        let v = if self.solo.load(Ordering::Relaxed) {
            0
        } else {
            self.front.load(Ordering::Relaxed)
        };
        let view = self.read_view(v);
        f(&view, &st.core)
    }
}

impl SharedIndex {
    /// A shared empty index. Panics like [`RadixIndex::new`] on an invalid config.
    pub fn new(config: IndexConfig) -> Self {
        Self::from_index(RadixIndex::new(config))
    }

    /// Shares an existing index (for example one just restored); the second view is a copy of
    /// its view (the arena is shared, not copied).
    pub fn from_index(index: RadixIndex) -> Self {
        let second = index.view.clone();
        Self::from_parts(index, second, false)
    }

    fn from_parts(index: RadixIndex, second: View, solo: bool) -> Self {
        // 512 ops by default: 4,096 made a write after a snapshot wait ~3 ms more for the
        // catch-up (BENCHMARKS.md, "Readers under a writer").
        let catch_up_ops = 8 * index.config().write_chunk_events;
        let RadixIndex { core, view } = index;
        Self {
            inner: Arc::new(Inner {
                views: [RwLock::new(view), RwLock::new(second)],
                front: AtomicUsize::new(0),
                waiting: AtomicUsize::new(0),
                writer: Mutex::new(Writer {
                    core,
                    behind: Default::default(),
                    pins: [0, 0],
                    log: Vec::new(),
                }),
                solo: AtomicBool::new(solo),
                catch_up_ops,
            }),
        }
    }

    /// Restores a snapshot into a shared index.
    pub fn restore(bytes: &[u8]) -> Result<Self, SnapshotError> {
        RadixIndex::restore(bytes).map(Self::from_index)
    }

    /// Shares `index` with one view, for a state that is built before anyone reads it (an
    /// indexer catching up with the log writes one view): readers and the writer exclude each
    /// other, and nothing can be pinned, until [`SharedIndex::attach_second_copy`].
    pub fn solo(index: RadixIndex) -> Self {
        Self::from_parts(index, View::default(), true)
    }

    /// Ends [`SharedIndex::solo`]: the second view becomes a copy of the first (writes wait
    /// for the copy, which leaves the shared arena alone), and from then on readers never
    /// wait. Does nothing on two views.
    pub fn attach_second_copy(&self) {
        let _w = self.inner.writer();
        if self.inner.solo.load(Ordering::Relaxed) {
            let second = self.inner.read_view(0).clone();
            *self.inner.write_view(1) = second;
            self.inner.front.store(0, Ordering::Release);
            self.inner.solo.store(false, Ordering::Release);
        }
    }

    /// Whether the index has one view (see [`SharedIndex::solo`]).
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
        // Hash before taking the view.
        let hashes = kvroute_common::hashing::local_block_hashes(
            tokens,
            block_size,
            kvroute_common::hashing::seed_for_lora(lora_name),
        );
        self.find_matches(&hashes)
    }

    /// Holds the back view in the current state for a long read on any thread, without
    /// stopping the writer (see the module docs). Drop the pin when done: until then the
    /// writer queues every change for that view. `None` while an earlier pin (or its
    /// catch-up) is in the way.
    pub fn try_pin(&self) -> Option<PinnedIndex> {
        self.inner.try_pin()
    }

    /// The digest of the current state: on a pin when one can be had, else with the writer
    /// stopped until it is computed.
    pub fn digest(&self) -> u64 {
        match self.try_pin() {
            Some(p) => p.digest(),
            None => self.inner.with_writer_stopped(digest_of),
        }
    }

    /// A snapshot of the current state, taken like [`SharedIndex::digest`].
    pub fn snapshot(&self) -> Vec<u8> {
        match self.try_pin() {
            Some(p) => p.snapshot(),
            None => self.inner.with_writer_stopped(|view, core| {
                super::snapshot::write(view, core, &Meta::of(core))
            }),
        }
    }

    /// Stats of the current state; `bytes_in_use` counts both views and the arena once.
    pub fn stats(&self) -> IndexStats {
        let st = self.inner.writer();
        let views = if self.is_solo() { 1 } else { 2 };
        let (nodes, runs, view_bytes) = {
            let v = self.inner.read();
            (v.blocks(), v.len(), v.bytes())
        };
        IndexStats {
            nodes,
            runs,
            entries: st.core.entries,
            blocks_per_worker: st.core.blocks_per_worker(),
            bytes_in_use: std::mem::size_of::<Inner>()
                + st.core.bytes()
                + views * view_bytes
                + st.core.arena.bytes(),
            anomalies: st.core.anomalies,
        }
    }

    /// Every (worker, dp rank) holding at least one block, sorted.
    pub fn workers(&self) -> Vec<(WorkerId, DpRank)> {
        self.inner.read().workers()
    }

    /// Total (block, worker, dp rank) entries.
    pub fn len(&self) -> usize {
        self.inner.writer().core.entries
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
