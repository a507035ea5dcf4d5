//! [`IndexFollower`]: a follower of the event log for processes that embed the index (the
//! router's `local` overlap mode). It bootstraps like an indexer replica — the newest usable
//! snapshot, then an ordered consumer from the next sequence — but has no leader duties: it
//! never writes snapshots, appends removals or asks workers to resync. Without a snapshot that
//! the log reaches back to (and a log not starting at 1), it stays not ready and retries until
//! the indexer leader has written one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream;
use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::names::Names;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::bootstrap::newest_usable_snapshot;
use super::ingest::{LogMessage, poll_stream_end, spawn_consumer};
use super::snapshots::SnapshotStore;
use crate::index::{IndexConfig, OverlapScores, SharedIndex};
use crate::replica::{Continuity, ReplicaState, continuity};

const TICK: Duration = Duration::from_millis(250);
const RETRY: Duration = Duration::from_millis(500);

/// Settings of a [`IndexFollower`].
#[derive(Debug, Clone, Copy, Default)]
pub struct IndexFollowerConfig {
    pub index: IndexConfig,
    /// Ready only when at most this many log messages are not yet applied.
    pub ready_max_lag: u64,
}

/// A handle to a following replica; clones share it. Reads never wait for the log.
#[derive(Debug, Clone)]
pub struct IndexFollower {
    shared: Arc<FollowerShared>,
}

#[derive(Debug)]
struct FollowerShared {
    /// Replaced on (re)bootstrap; applied to in place otherwise.
    index: RwLock<SharedIndex>,
    applied_seq: AtomicU64,
    ready: AtomicBool,
    bootstraps: AtomicU64,
}

impl IndexFollower {
    /// Starts following the events stream of `names`; the task runs until aborted.
    pub fn start(
        nats: async_nats::Client,
        names: &Names,
        config: IndexFollowerConfig,
    ) -> (Self, JoinHandle<()>) {
        let replica = Self {
            shared: Arc::new(FollowerShared {
                index: RwLock::new(SharedIndex::new(config.index)),
                applied_seq: AtomicU64::new(0),
                ready: AtomicBool::new(false),
                bootstraps: AtomicU64::new(0),
            }),
        };
        let task = tokio::spawn(follow(
            nats.clone(),
            jetstream::new(nats),
            names.clone(),
            config,
            replica.shared.clone(),
        ));
        (replica, task)
    }

    /// Caught up with the log (within `ready_max_lag`).
    pub fn is_ready(&self) -> bool {
        self.shared.ready.load(Ordering::Acquire)
    }

    /// The last stream sequence applied.
    pub fn applied_seq(&self) -> u64 {
        self.shared.applied_seq.load(Ordering::Acquire)
    }

    /// How many times the replica (re)bootstrapped.
    pub fn bootstraps(&self) -> u64 {
        self.shared.bootstraps.load(Ordering::Relaxed)
    }

    /// The current index.
    pub fn index(&self) -> SharedIndex {
        self.shared
            .index
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Overlap of a prompt (local block hashes) with every (worker, rank).
    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> OverlapScores {
        self.index().find_matches(hashes)
    }
}

async fn follow(
    nats: async_nats::Client,
    js: jetstream::Context,
    names: Names,
    config: IndexFollowerConfig,
    shared: Arc<FollowerShared>,
) {
    loop {
        shared.ready.store(false, Ordering::Release);
        let Some((stream, state, start)) = bootstrap(&js, &names, &config).await else {
            tokio::time::sleep(RETRY).await;
            continue;
        };
        shared.bootstraps.fetch_add(1, Ordering::Relaxed);
        // The router reads this replica whether or not it is caught up.
        state.index().attach_second_copy();
        *shared.index.write().unwrap_or_else(|p| p.into_inner()) = state.index().clone();
        shared
            .applied_seq
            .store(state.applied_seq(), Ordering::Release);
        let (tx, mut log) = mpsc::channel::<LogMessage>(8192);
        let consumer = spawn_consumer(names.clone(), nats.clone(), stream.clone(), start, tx);
        let mut state = state;
        let (stream_end, poll) = poll_stream_end(stream.clone(), TICK);
        let mut tick = tokio::time::interval(TICK);
        // Runs until the log skips messages this replica had not applied.
        loop {
            tokio::select! {
                msg = log.recv() => {
                    let Some(msg) = msg else { break };
                    if let Continuity::Missing { expected } = continuity(state.applied_seq(), start, msg.seq) {
                        tracing::warn!(applied = state.applied_seq(), expected, next = msg.seq,
                            "the log skipped messages; bootstrapping the local replica again");
                        break;
                    }
                    state.apply_entry(msg.seq, msg.entry);
                    shared.applied_seq.store(state.applied_seq(), Ordering::Release);
                }
                _ = tick.tick() => {
                    // 0: the stream has not answered since this bootstrap; readiness stays.
                    let end = *stream_end.borrow();
                    if end > 0 {
                        let lag = end.saturating_sub(state.applied_seq());
                        shared.ready.store(lag <= config.ready_max_lag, Ordering::Release);
                    }
                }
            }
        }
        consumer.abort();
        poll.abort();
    }
}

/// The state to start from and the sequence to consume from, or `None` to retry later
/// (no stream yet, or a purged log without a snapshot that reaches it).
async fn bootstrap(
    js: &jetstream::Context,
    names: &Names,
    config: &IndexFollowerConfig,
) -> Option<(jetstream::stream::Stream, ReplicaState, u64)> {
    let mut stream = js.get_stream(names.events_stream()).await.ok()?;
    let info = stream.info().await.ok()?;
    let first = info.state.first_sequence;
    let restored = match SnapshotStore::existing(js, names).await {
        Some(store) => newest_usable_snapshot(&store, names, first).await,
        None => None,
    };
    match restored {
        Some((seq, state)) => {
            tracing::info!(seq, "local replica loaded a snapshot");
            Some((stream, state, seq + 1))
        }
        None if first > 1 => {
            tracing::warn!(
                first,
                "no snapshot reaches the start of the log yet; the local replica waits for one"
            );
            None
        }
        None => Some((stream, ReplicaState::new(names, config.index), 1)),
    }
}
