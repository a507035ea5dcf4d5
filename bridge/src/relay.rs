//! One engine's event path: per rank a thread ([`rank`]) that receives the engine's ZMQ
//! batches, judges their `seq` (replaying a gap from the engine's replay socket, or clearing the
//! rank when the gap cannot be replayed), decodes them, translates them through the rank's
//! mirror and hands kvroute's events to the worker's `EventPublisher` (event ids, JetStream acks
//! and retries are the publisher's). Also the engine's resync source: `Cleared` and the
//! mirror's chains.
//!
//! Invariants: the mirror equals what the engine announced (within the bound); a gap never passes
//! silently — it is replayed, or the rank is cleared and counted; a rank's mirror is changed and
//! published under one lock, so a resync publishes exactly the state at its point of the log.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvroute_common::DpRank;
use kvroute_common::messages::KvEventData;
use kvroute_common::worker::{EventPublisher, ResyncSource};

use crate::config::EngineSpec;
use crate::metrics::{BridgeMetrics, names};
use crate::mirror::RankMirror;
use crate::sequence::SeqTracker;
use crate::zmq_io::Subscriber;
use rank::RankWorker;

/// Settings of a [`Relay`].
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Most blocks one rank's mirror holds.
    pub mirror_max_blocks: usize,
    /// Whether external and remote media become the shared tier (else they are ignored).
    pub shared_tier: bool,
}

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
    /// Per rank (same order), batches received from the engine.
    received: Vec<Arc<AtomicU64>>,
    /// Per rank (same order): check, at the rank thread's next turn, that the engine is still
    /// the incarnation whose batches were applied ([`Relay::check_incarnation`]).
    checks: Vec<Arc<AtomicBool>>,
    running: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    metrics: Arc<BridgeMetrics>,
}

#[derive(Debug)]
struct RankState {
    mirror: RankMirror,
    tracker: SeqTracker,
    publisher: Option<EventPublisher>,
    /// `AllBlocksCleared` events the engine sent.
    engine_clears: u64,
}

/// Each rank's count of the engine's `AllBlocksCleared` before a reset was asked.
#[derive(Debug, Clone)]
pub struct ResetMark(Vec<u64>);

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
        let mut received = Vec::new();
        let mut checks = Vec::new();
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
                engine_clears: 0,
            }));
            states.push((rank, state.clone()));
            let count = Arc::new(AtomicU64::new(0));
            received.push(count.clone());
            let check = Arc::new(AtomicBool::new(false));
            checks.push(check.clone());
            let worker = RankWorker {
                label: label.clone(),
                kind: spec.engine,
                rank,
                ctx: ctx.clone(),
                replay,
                state,
                metrics: metrics.clone(),
                received: count,
                check,
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
                received,
                checks,
                running,
                threads: Mutex::new(threads),
                metrics,
            }),
        })
    }

    /// The relay of an engine without KV events (`--no-kv-events`): no rank, no subscription,
    /// nothing to publish.
    pub fn without_events(spec: &EngineSpec, metrics: Arc<BridgeMetrics>) -> Self {
        Self {
            inner: Arc::new(Inner {
                label: spec.label(),
                ranks: Vec::new(),
                received: Vec::new(),
                checks: Vec::new(),
                running: Arc::new(AtomicBool::new(false)),
                threads: Mutex::new(Vec::new()),
                metrics,
            }),
        }
    }

    /// Whether the relay subscribes to the engine's events (not for an engine without them).
    pub fn subscribed(&self) -> bool {
        !self.inner.ranks.is_empty()
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

    /// The engine was deemed down (its `/health` failed `--health-failures` times in a row) and
    /// answers again: it may have restarted with an empty cache, or only been too busy to answer
    /// its probes with its cache intact. Each rank thread, at its next turn, asks the engine's
    /// replay socket for the last batch it applied: the same bytes prove the same incarnation
    /// (the mirror is kept, and what the engine sent since is applied); other bytes, or a buffer
    /// that no longer holds it, clear the rank (a new incarnation, counted). Without a replay
    /// socket nothing can prove it, and the rank is cleared. Until the check ends (a replay round
    /// trip), kvroute keeps the mirror's blocks.
    pub fn check_incarnation(&self) {
        for check in &self.inner.checks {
            check.store(true, Ordering::Relaxed);
        }
    }

    /// Where each rank stands before a cache reset is asked of the engine (see [`Relay::withdraw`]).
    pub fn reset_mark(&self) -> ResetMark {
        ResetMark(
            self.inner
                .ranks
                .iter()
                .map(|(_, s)| s.lock().expect("rank lock").engine_clears)
                .collect(),
        )
    }

    /// The engine dropped its whole cache (a reset the bridge forwarded, asked after `mark`):
    /// every rank is cleared and `Cleared` published at once. The engine announces it too, but
    /// only with its next step; until then kvroute would route to blocks the engine no longer
    /// has. A rank whose `AllBlocksCleared` already came (since `mark`) is left as it is: what
    /// followed it is the engine's cache after the reset.
    pub fn withdraw(&self, mark: &ResetMark) {
        for ((rank, state), before) in self.inner.ranks.iter().zip(&mark.0) {
            let mut s = state.lock().expect("rank lock");
            if s.engine_clears != *before {
                continue;
            }
            s.mirror.clear();
            s.publish(*rank, vec![KvEventData::Cleared]);
            self.inner
                .metrics
                .set(names::MIRROR_BLOCKS, &self.inner.label, Some(*rank), 0.0);
        }
    }

    /// Batches received from the engine on each rank so far (live and replayed).
    pub fn batches_received(&self) -> Vec<(DpRank, u64)> {
        self.inner
            .ranks
            .iter()
            .zip(&self.inner.received)
            .map(|((rank, _), n)| (*rank, n.load(Ordering::Relaxed)))
            .collect()
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

mod rank;
