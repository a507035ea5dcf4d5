//! KV events into the JetStream event log, in order, exactly once.
//!
//! `publish` assigns each event its `event_id` (+1 per dp rank) and queues it, synchronously and
//! under one lock, so the order callers publish in is the order in the log. One background task
//! drains the queue: it coalesces queued events of a rank into a batch, publishes it with a
//! JetStream message id derived from its event ids, and waits for the ack before the next
//! batch. A failed publish is retried with the same bytes and message id until acked, so the
//! stream's duplicate window drops a retry of a batch that did land (no duplicates) and nothing
//! behind it overtakes it (no reordering). Indexers also skip event ids they have applied.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage};
use tokio::sync::{mpsc, oneshot};

use crate::codec::{EncodeError, encode};
use crate::ids::{DpRank, WorkerId};
use crate::messages::{KvEvent, KvEventBatch, KvEventData};
use crate::names::Names;

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Most events in one batch.
    pub max_batch_events: usize,
    /// Events queued (not yet acked) beyond which new events are dropped and counted; the gap
    /// they leave makes the indexer ask for a resync, which restores the state.
    pub max_queued_events: u64,
    /// How long to wait for one JetStream ack before retrying.
    pub ack_timeout: Duration,
    /// Wait between retries.
    pub retry_interval: Duration,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            max_batch_events: 512,
            max_queued_events: 1_000_000,
            ack_timeout: Duration::from_secs(2),
            retry_interval: Duration::from_millis(200),
        }
    }
}

/// Counters, readable at any time.
#[derive(Debug, Default)]
pub struct PublisherStats {
    pub events_published: AtomicU64,
    pub batches_published: AtomicU64,
    pub publish_failures: AtomicU64,
    pub events_dropped: AtomicU64,
    pub events_queued: AtomicU64,
}

enum Command {
    Events {
        dp_rank: DpRank,
        events: Vec<KvEvent>,
    },
    Flush(oneshot::Sender<()>),
}

/// Cheap to clone; every clone feeds the same ordered queue.
#[derive(Clone)]
pub struct EventPublisher {
    inner: Arc<Inner>,
}

struct Inner {
    worker_id: WorkerId,
    next_ids: Mutex<HashMap<DpRank, u64>>,
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<PublisherStats>,
    max_queued: u64,
}

impl std::fmt::Debug for EventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPublisher")
            .field("worker_id", &self.inner.worker_id)
            .finish_non_exhaustive()
    }
}

impl EventPublisher {
    /// Starts the publishing task. Event ids of every rank start at 0.
    pub fn start(
        js: jetstream::Context,
        names: &Names,
        worker_id: WorkerId,
        config: PublisherConfig,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(PublisherStats::default());
        let subject = names.kv_events(worker_id);
        tokio::spawn(run(
            js,
            subject,
            worker_id,
            config.clone(),
            rx,
            stats.clone(),
        ));
        Self {
            inner: Arc::new(Inner {
                worker_id,
                next_ids: Mutex::new(HashMap::new()),
                tx,
                stats,
                max_queued: config.max_queued_events,
            }),
        }
    }

    pub fn worker_id(&self) -> WorkerId {
        self.inner.worker_id
    }

    /// Queues `events` for rank `dp_rank`, assigning consecutive event ids. Never blocks.
    /// Returns the first assigned id.
    pub fn publish(&self, dp_rank: DpRank, events: Vec<KvEventData>) -> u64 {
        let mut ids = self.inner.next_ids.lock().expect("publisher lock");
        let next = ids.entry(dp_rank).or_insert(0);
        let first = *next;
        *next += events.len() as u64;
        let n = events.len() as u64;
        let stats = &self.inner.stats;
        if stats.events_queued.load(Ordering::Relaxed) + n > self.inner.max_queued {
            // Dropped while holding the lock: the ids are consumed, so readers see a gap.
            stats.events_dropped.fetch_add(n, Ordering::Relaxed);
            return first;
        }
        let events = events
            .into_iter()
            .enumerate()
            .map(|(i, data)| KvEvent {
                event_id: first + i as u64,
                data,
            })
            .collect();
        stats.events_queued.fetch_add(n, Ordering::Relaxed);
        if self
            .inner
            .tx
            .send(Command::Events { dp_rank, events })
            .is_err()
        {
            stats.events_dropped.fetch_add(n, Ordering::Relaxed);
        }
        first
    }

    /// Consumes `n` event ids of rank `dp_rank` without publishing anything: exactly what lost
    /// events look like to readers (a gap). For fault drills and tests.
    pub fn skip_event_ids(&self, dp_rank: DpRank, n: u64) {
        let mut ids = self.inner.next_ids.lock().expect("publisher lock");
        *ids.entry(dp_rank).or_insert(0) += n;
        self.inner
            .stats
            .events_dropped
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Waits until everything queued before this call is acknowledged by JetStream.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.tx.send(Command::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    pub fn stats(&self) -> &PublisherStats {
        &self.inner.stats
    }
}

async fn run(
    js: jetstream::Context,
    subject: String,
    worker_id: WorkerId,
    config: PublisherConfig,
    mut rx: mpsc::UnboundedReceiver<Command>,
    stats: Arc<PublisherStats>,
) {
    let mut pending: Option<Command> = None;
    // Event ids restart at 0 with every publisher (a new incarnation of the worker), so the
    // message ids carry this publisher's own random token: JetStream's duplicate window must
    // drop retries of one publisher's batches, never a restarted worker's first batches.
    let incarnation = format!("{worker_id}-{:08x}", uuid::Uuid::new_v4().as_u128() as u32);
    loop {
        let cmd = match pending.take() {
            Some(cmd) => cmd,
            None => match rx.recv().await {
                Some(cmd) => cmd,
                None => return,
            },
        };
        let (dp_rank, mut events) = match cmd {
            Command::Flush(done) => {
                let _ = done.send(());
                continue;
            }
            Command::Events { dp_rank, events } => (dp_rank, events),
        };
        // Coalesce what is already queued for the same rank.
        while events.len() < config.max_batch_events {
            match rx.try_recv() {
                Ok(Command::Events {
                    dp_rank: r,
                    events: more,
                }) if r == dp_rank => events.extend(more),
                Ok(other) => {
                    pending = Some(other);
                    break;
                }
                Err(_) => break,
            }
        }
        let n = events.len() as u64;
        for chunk in split_for_wire(
            worker_id,
            &incarnation,
            dp_rank,
            events,
            config.max_batch_events,
        ) {
            publish_until_acked(&js, &subject, &chunk, &config, &stats).await;
        }
        stats.events_queued.fetch_sub(n, Ordering::Relaxed);
    }
}

fn batch(worker_id: WorkerId, dp_rank: DpRank, events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        v: KvEventBatch::required_version(&events),
        worker_id,
        dp_rank,
        events,
        ts: crate::messages::now_ms(),
    }
}

/// Encoded batches of at most `max_events` events, each under the message size limit.
fn split_for_wire(
    worker_id: WorkerId,
    id_prefix: &str,
    dp_rank: DpRank,
    events: Vec<KvEvent>,
    max_events: usize,
) -> Vec<(String, bytes::Bytes, u64)> {
    let mut out = Vec::new();
    let mut stack: Vec<Vec<KvEvent>> = events
        .chunks(max_events.max(1))
        .rev()
        .map(<[KvEvent]>::to_vec)
        .collect();
    while let Some(events) = stack.pop() {
        let first = events.first().map_or(0, |e| e.event_id);
        let last = events.last().map_or(0, |e| e.event_id);
        let count = events.len() as u64;
        let mut b = batch(worker_id, dp_rank, events);
        match encode(&b) {
            Ok(bytes) => out.push((
                format!("{id_prefix}-{dp_rank}-{first}-{last}"),
                bytes,
                count,
            )),
            Err(EncodeError::TooLarge { .. }) if b.events.len() > 1 => {
                let second = b.events.split_off(b.events.len() / 2);
                stack.push(second);
                stack.push(b.events);
            }
            Err(e) => {
                tracing::error!(worker_id, dp_rank, first, error = %e, "event cannot be encoded; dropped")
            }
        }
    }
    out
}

async fn publish_until_acked(
    js: &jetstream::Context,
    subject: &str,
    (msg_id, bytes, count): &(String, bytes::Bytes, u64),
    config: &PublisherConfig,
    stats: &PublisherStats,
) {
    let mut attempt = 0u64;
    loop {
        let publish = PublishMessage::build()
            .payload(bytes.clone())
            .message_id(msg_id);
        let result = async {
            let ack = js.send_publish(subject.to_owned(), publish).await?;
            tokio::time::timeout(config.ack_timeout, ack)
                .await
                .map_err(|_| anyhow::anyhow!("no ack within {:?}", config.ack_timeout))?
                .map_err(anyhow::Error::from)
        }
        .await;
        match result {
            Ok(_) => {
                stats.events_published.fetch_add(*count, Ordering::Relaxed);
                stats.batches_published.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                stats.publish_failures.fetch_add(1, Ordering::Relaxed);
                // Log the first failure and then every 50th, so an outage does not flood logs.
                if attempt.is_multiple_of(50) {
                    tracing::warn!(subject, msg_id, attempt, error = %e, "publishing KV events failed; retrying");
                }
                attempt += 1;
                tokio::time::sleep(config.retry_interval).await;
            }
        }
    }
}
