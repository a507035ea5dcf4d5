//! One engine's event path: per rank a thread that receives the engine's ZMQ batches, judges
//! their `seq` (replaying a gap from the engine's replay socket, or clearing the rank when the
//! gap cannot be replayed), decodes them, translates them through the rank's mirror and hands
//! kvroute's events to the worker's `EventPublisher` (event ids, JetStream acks and retries are
//! the publisher's). Also the engine's resync source: `Cleared` and the mirror's chains.
//!
//! Invariants: the mirror equals what the engine announced (within the bound); a gap never passes
//! silently — it is replayed, or the rank is cleared and counted; a rank's mirror is changed and
//! published under one lock, so a resync publishes exactly the state at its point of the log.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute_common::DpRank;
use kvroute_common::messages::KvEventData;
use kvroute_common::worker::{EventPublisher, ResyncSource};

use crate::config::{EngineKind, EngineSpec};
use crate::metrics::{BridgeMetrics, names};
use crate::mirror::{RankMirror, Translation};
use crate::sequence::{SeqTracker, Verdict};
use crate::wire::{EngineEvent, decode_batch};
use crate::zmq_io::{self, Subscriber};

/// Settings of a [`Relay`].
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Most blocks one rank's mirror holds.
    pub mirror_max_blocks: usize,
    /// Whether external and remote media become the shared tier (else they are ignored).
    pub shared_tier: bool,
}

/// How long a replay may take before the gap is treated as not replayable.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// A running relay for one engine. Events are received and mirrored from [`Relay::start`] on;
/// they reach kvroute only while a publisher is attached.
#[derive(Debug, Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    label: String,
    ranks: Vec<(DpRank, Arc<Mutex<RankState>>)>,
    running: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    metrics: Arc<BridgeMetrics>,
}

#[derive(Debug)]
struct RankState {
    mirror: RankMirror,
    tracker: SeqTracker,
    publisher: Option<EventPublisher>,
}

impl RankState {
    fn publish(&self, rank: DpRank, events: Vec<KvEventData>) {
        if let Some(p) = &self.publisher
            && !events.is_empty()
        {
            p.publish(rank, events);
        }
    }
}

impl Relay {
    /// Starts the subscriber threads of `ranks`.
    pub fn start(
        spec: &EngineSpec,
        ranks: Vec<DpRank>,
        settings: RelaySettings,
        metrics: Arc<BridgeMetrics>,
    ) -> anyhow::Result<Self> {
        let ctx = zmq::Context::new();
        let running = Arc::new(AtomicBool::new(true));
        let label = spec.label();
        let mut states = Vec::new();
        let mut threads = Vec::new();
        for rank in ranks {
            let endpoint = spec
                .zmq_endpoint_for(rank)
                .map_err(|e| anyhow::anyhow!("--zmq-endpoint: {e}"))?;
            let replay = spec
                .zmq_replay_endpoint_for(rank)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--zmq-replay-endpoint: {e}"))?;
            let subscriber = Subscriber::connect(&ctx, &endpoint, &spec.zmq_topic)
                .map_err(|e| anyhow::anyhow!("--zmq-endpoint {endpoint}: {e}"))?;
            tracing::info!(engine = %label, rank, %endpoint, replay = ?replay, "subscribed to the engine's KV events");
            let state = Arc::new(Mutex::new(RankState {
                mirror: RankMirror::new(settings.mirror_max_blocks)
                    .with_shared_tier(settings.shared_tier),
                tracker: SeqTracker::default(),
                publisher: None,
            }));
            states.push((rank, state.clone()));
            let worker = RankWorker {
                label: label.clone(),
                kind: spec.engine,
                rank,
                ctx: ctx.clone(),
                replay,
                state,
                metrics: metrics.clone(),
            };
            let running = running.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("zmq-{label}-{rank}"))
                    .spawn(move || worker.run(subscriber, &running))?,
            );
        }
        Ok(Self {
            inner: Arc::new(Inner {
                label,
                ranks: states,
                running,
                threads: Mutex::new(threads),
                metrics,
            }),
        })
    }

    /// What answers kvroute's resync requests for this engine (hand it to `WorkerAgent::start`).
    pub fn resync_source(&self) -> Arc<dyn ResyncSource> {
        Arc::new(self.clone())
    }

    /// Publishes through `publisher` from now on. Call right after `WorkerAgent::start` (which
    /// published `Cleared` for every rank): the relay first publishes the mirror's chains, so
    /// what the engine stored before registration is not lost.
    pub fn attach(&self, publisher: EventPublisher) {
        for (rank, state) in &self.inner.ranks {
            let mut s = state.lock().expect("rank lock");
            s.publisher = Some(publisher.clone());
            s.publish(*rank, s.mirror.chains());
        }
    }

    /// Stops publishing (the engine is being deregistered); events are still mirrored.
    pub fn detach(&self) {
        for (_, state) in &self.inner.ranks {
            state.lock().expect("rank lock").publisher = None;
        }
    }

    /// The engine restarted (its `/health` failed and recovered): its cache is empty, so the
    /// mirror is cleared and the next `seq` may start anywhere.
    pub fn new_incarnation(&self) {
        for (rank, state) in &self.inner.ranks {
            let mut s = state.lock().expect("rank lock");
            s.mirror.clear();
            s.tracker.reset();
            self.inner
                .metrics
                .inc(names::INCARNATIONS, &self.inner.label, Some(*rank), "");
            self.inner
                .metrics
                .set(names::MIRROR_BLOCKS, &self.inner.label, Some(*rank), 0.0);
        }
    }

    /// Blocks mirrored over every rank.
    pub fn mirror_blocks(&self) -> usize {
        self.inner
            .ranks
            .iter()
            .map(|(_, s)| s.lock().expect("rank lock").mirror.len())
            .sum()
    }

    /// Stops the subscriber threads (within their 100 ms receive timeout).
    pub fn shutdown(&self) {
        self.inner.running.store(false, Ordering::Relaxed);
        let threads = std::mem::take(&mut *self.inner.threads.lock().expect("threads lock"));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl ResyncSource for Relay {
    fn resync(&self, publisher: &EventPublisher) {
        for (rank, state) in &self.inner.ranks {
            let s = state.lock().expect("rank lock");
            let mut events = vec![KvEventData::Cleared];
            events.extend(s.mirror.chains());
            publisher.publish(*rank, events);
        }
    }
}

/// One rank's receive loop.
struct RankWorker {
    label: String,
    kind: EngineKind,
    rank: DpRank,
    ctx: zmq::Context,
    replay: Option<String>,
    state: Arc<Mutex<RankState>>,
    metrics: Arc<BridgeMetrics>,
}

impl RankWorker {
    fn run(self, subscriber: Subscriber, running: &AtomicBool) {
        // Subscribed first, so live batches queue while the history is fetched.
        let mut replayed = self.catch_up();
        while running.load(Ordering::Relaxed) {
            let frames = match subscriber.recv() {
                Ok(Some(f)) => f,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(engine = %self.label, rank = self.rank, error = %e, "ZMQ receive failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let received = Instant::now();
            if let Some(reason) = zmq_io::frames_error(&frames) {
                self.count_error(reason);
                continue;
            }
            let seq = zmq_io::seq_of(&frames[1]);
            // Live batches queued during the start-up catch-up that it already applied: the same
            // seq with the same bytes (a restarted engine's batch differs, by its timestamp at
            // least).
            if !replayed.is_empty() {
                if replayed.get(&seq) == Some(&xxhash_rust::xxh3::xxh3_64(&frames[2])) {
                    self.metrics.inc(
                        names::IGNORED,
                        &self.label,
                        Some(self.rank),
                        "already_replayed",
                    );
                    continue;
                }
                replayed.clear();
            }
            let verdict = self.state.lock().expect("rank lock").tracker.observe(seq);
            match verdict {
                Verdict::Apply => {}
                Verdict::Gap { from, to } => {
                    // A late join of a fresh engine starts at 0: nothing is missing then.
                    self.metrics
                        .inc(names::GAPS, &self.label, Some(self.rank), "");
                    self.fill(from, to);
                }
                Verdict::Restarted { seq } => {
                    self.metrics
                        .inc(names::INCARNATIONS, &self.label, Some(self.rank), "");
                    tracing::info!(engine = %self.label, rank = self.rank, seq, "engine restarted (seq went back): clearing the rank");
                    self.clear_rank();
                    if seq > 0 {
                        self.metrics
                            .inc(names::GAPS, &self.label, Some(self.rank), "");
                        self.fill(0, seq);
                    }
                }
            }
            self.apply(&frames[2], received);
        }
    }

    /// At start, fetches the engine's whole replay buffer, so the engine's cache is known
    /// without waiting for its next batch (an engine at rest may send none for a long time).
    /// Returns the seqs applied with a hash of their bytes. An engine that is not up yet, or
    /// has no replay socket, leaves this to the first live batch.
    fn catch_up(&self) -> hashbrown::HashMap<u64, u64> {
        let mut applied = hashbrown::HashMap::new();
        let Some(endpoint) = &self.replay else {
            return applied;
        };
        let batches = match zmq_io::replay(&self.ctx, endpoint, 0, REPLAY_TIMEOUT) {
            Ok(b) => b,
            Err(e) => {
                tracing::info!(engine = %self.label, rank = self.rank, error = %e, "no history from the engine at start; the first batch decides");
                return applied;
            }
        };
        let Some(&(first, _)) = batches.first() else {
            return applied;
        };
        let last = batches.last().map_or(first, |(s, _)| *s);
        if first > 0 {
            // The buffer no longer starts at the engine's first batch: what came before is
            // unknown to routing until the engine stores it again.
            self.metrics
                .inc(names::REPLAYS, &self.label, Some(self.rank), "not_covered");
            tracing::warn!(engine = %self.label, rank = self.rank, first, "the engine's history is only partly buffered");
        } else {
            self.metrics
                .inc(names::REPLAYS, &self.label, Some(self.rank), "ok");
        }
        let now = Instant::now();
        for (seq, payload) in &batches {
            self.apply(payload, now);
            applied.insert(*seq, xxhash_rust::xxh3::xxh3_64(payload));
        }
        self.state
            .lock()
            .expect("rank lock")
            .tracker
            .resume(last.saturating_add(1));
        tracing::info!(engine = %self.label, rank = self.rank, batches = batches.len(), next = last + 1, "caught up with the engine's buffered history");
        applied
    }

    fn count_error(&self, reason: &str) {
        self.metrics
            .inc(names::DECODE_ERRORS, &self.label, Some(self.rank), reason);
    }

    /// Fetches batches `from .. to` from the engine's replay socket and applies them; when that
    /// is not possible, clears the rank (its earlier blocks are lost to routing until the engine
    /// stores them again).
    fn fill(&self, from: u64, to: u64) {
        let Some(endpoint) = &self.replay else {
            self.metrics.inc(
                names::REPLAYS,
                &self.label,
                Some(self.rank),
                "not_configured",
            );
            return self.give_up(from, to, "no replay endpoint");
        };
        match zmq_io::replay(&self.ctx, endpoint, from, REPLAY_TIMEOUT) {
            Ok(batches) => {
                let covered = batches.first().is_some_and(|(s, _)| *s == from);
                if !covered {
                    self.metrics
                        .inc(names::REPLAYS, &self.label, Some(self.rank), "not_covered");
                    return self.give_up(from, to, "the engine's replay buffer no longer has it");
                }
                self.metrics
                    .inc(names::REPLAYS, &self.label, Some(self.rank), "ok");
                let now = Instant::now();
                for (seq, payload) in batches.iter().filter(|(s, _)| *s < to) {
                    let _ = seq;
                    self.apply(payload, now);
                }
            }
            Err(e) => {
                self.metrics
                    .inc(names::REPLAYS, &self.label, Some(self.rank), "failed");
                self.give_up(from, to, &e.to_string());
            }
        }
    }

    fn give_up(&self, from: u64, to: u64, why: &str) {
        tracing::warn!(engine = %self.label, rank = self.rank, from, to, why, "cannot replay the gap: clearing the rank");
        self.metrics
            .inc(names::CLEARED, &self.label, Some(self.rank), "");
        self.clear_rank();
    }

    fn clear_rank(&self) {
        let mut s = self.state.lock().expect("rank lock");
        s.mirror.clear();
        s.publish(self.rank, vec![KvEventData::Cleared]);
        self.metrics
            .set(names::MIRROR_BLOCKS, &self.label, Some(self.rank), 0.0);
    }

    /// Decodes and applies one batch. A batch that cannot be decoded (or is over
    /// [`zmq_io::MAX_BATCH_BYTES`]) is counted and skipped — and since what it said is lost,
    /// the rank is cleared, as for a gap that cannot be replayed: kvroute must not keep blocks
    /// whose removal may have been in it.
    fn apply(&self, payload: &[u8], received: Instant) {
        self.metrics
            .inc(names::BATCHES, &self.label, Some(self.rank), "");
        let decoded = if payload.len() > zmq_io::MAX_BATCH_BYTES {
            Err("oversize")
        } else {
            decode_batch(self.kind, payload).map_err(|e| e.reason())
        };
        let batch = match decoded {
            Ok(b) => b,
            Err(reason) => {
                self.count_error(reason);
                tracing::warn!(engine = %self.label, rank = self.rank, reason, "undecodable batch: clearing the rank");
                self.metrics
                    .inc(names::CLEARED, &self.label, Some(self.rank), "");
                return self.clear_rank();
            }
        };
        for reason in &batch.skipped {
            self.count_error(reason);
        }
        let mut out = Translation::default();
        let mut s = self.state.lock().expect("rank lock");
        for event in &batch.events {
            let kind = match event {
                EngineEvent::Stored(_) => "BlockStored",
                EngineEvent::Removed(_) => "BlockRemoved",
                EngineEvent::AllCleared => "AllBlocksCleared",
            };
            self.metrics
                .inc(names::EVENTS, &self.label, Some(self.rank), kind);
            s.mirror.apply(event, &mut out);
        }
        let published = !out.events.is_empty() && s.publisher.is_some();
        s.publish(self.rank, std::mem::take(&mut out.events));
        let blocks = s.mirror.len();
        drop(s);
        let m = &self.metrics;
        if published {
            m.inc(names::PUBLISHED_BATCHES, &self.label, Some(self.rank), "");
            m.add_f64(
                names::PUBLISH_SECONDS,
                &self.label,
                Some(self.rank),
                received.elapsed().as_secs_f64(),
            );
        }
        if out.duplicate_copies > 0 {
            m.add(
                names::DUPLICATE_COPIES,
                &self.label,
                Some(self.rank),
                "",
                out.duplicate_copies,
            );
        }
        for (reason, n) in out.ignored {
            m.add(names::IGNORED, &self.label, Some(self.rank), reason, n);
        }
        m.set(
            names::MIRROR_BLOCKS,
            &self.label,
            Some(self.rank),
            blocks as f64,
        );
    }
}
