//! KV events into the JetStream event log, in order, exactly once.
//!
//! `publish` assigns each event its `event_id` (+1 per dp rank) and queues it, synchronously and
//! under one lock, so the order callers publish in is the order in the log. One background task
//! drains the queue: it coalesces queued events of a rank into a batch and publishes it with a
//! JetStream message id derived from its event ids, keeping up to `max_in_flight` acks
//! outstanding (one connection delivers them to the stream in order). While acks are awaited,
//! a batch goes out only once full, so a busy publisher sends few, full messages and an idle
//! one sends at once. A failed publish stops
//! the pipeline: the acks still outstanding are awaited, then the failed batches are published
//! again in order with the same bytes and message ids, one at a time until acked, so the
//! stream's duplicate window drops a retry of a batch that did land (no duplicates). A later
//! batch can land before an earlier one only if the stream refused the earlier one while taking
//! the later (counted: `publish_reordered`); readers then see a gap, resync the worker and skip
//! the late batch's event ids as already passed. Indexers also skip event ids they have applied.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage};
use futures::StreamExt;
use futures::stream::FuturesOrdered;
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
    /// Most batches published whose acks are awaited at once.
    pub max_in_flight: usize,
    /// Wait between retries.
    pub retry_interval: Duration,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            max_batch_events: 512,
            max_queued_events: 1_000_000,
            ack_timeout: Duration::from_secs(2),
            max_in_flight: 32,
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
    /// Batches that landed after later ones (the stream refused them while taking the later).
    pub publish_reordered: AtomicU64,
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
    // Event ids restart at 0 with every publisher (a new incarnation of the worker), so the
    // message ids carry this publisher's own random token: JetStream's duplicate window must
    // drop retries of one publisher's batches, never a restarted worker's first batches.
    let incarnation = format!("{worker_id}-{:08x}", uuid::Uuid::new_v4().as_u128() as u32);
    let mut p = Pipeline {
        js,
        subject,
        worker_id,
        incarnation,
        config,
        stats,
        ready: VecDeque::new(),
        flight: VecDeque::new(),
        acks: FuturesOrdered::new(),
        made: 0,
        acked: 0,
        flushes: VecDeque::new(),
        pending: None,
        building: None,
    };
    loop {
        if p.flight.is_empty() {
            // Nothing in flight: what is being built goes now.
            p.seal();
        }
        p.send_ready().await;
        if let Some(cmd) = p.pending.take() {
            p.take(cmd, &mut rx);
            continue;
        }
        if p.flight.is_empty() {
            match rx.recv().await {
                Some(cmd) => p.take(cmd, &mut rx),
                None => return,
            }
            continue;
        }
        if !p.ready.is_empty() {
            // The window is full: the oldest ack first.
            let outcome = p.acks.next().await;
            p.acked_or_retried(outcome).await;
            continue;
        }
        tokio::select! {
            biased;
            cmd = rx.recv() => match cmd {
                Some(cmd) => p.take(cmd, &mut rx),
                None => {
                    p.seal();
                    loop {
                        p.send_ready().await;
                        if p.flight.is_empty() {
                            return;
                        }
                        let outcome = p.acks.next().await;
                        p.acked_or_retried(outcome).await;
                    }
                }
            },
            outcome = p.acks.next() => p.acked_or_retried(outcome).await,
        }
    }
}

/// One encoded batch: its message id, bytes and event count.
type Chunk = (String, bytes::Bytes, u64);

/// An awaited ack: whether the stream already had the message (a duplicate), within the ack
/// timeout (counted from the send).
type AckFuture = Pin<Box<dyn Future<Output = anyhow::Result<bool>> + Send>>;

/// The publishing task's state: batches encoded but not sent (`ready`), and those sent whose
/// acks are awaited, oldest first (`flight`, `acks`).
struct Pipeline {
    js: jetstream::Context,
    subject: String,
    worker_id: WorkerId,
    incarnation: String,
    config: PublisherConfig,
    stats: Arc<PublisherStats>,
    ready: VecDeque<Chunk>,
    flight: VecDeque<Chunk>,
    acks: FuturesOrdered<AckFuture>,
    /// Batches made so far, and acknowledged so far (a flush waits for a count).
    made: u64,
    acked: u64,
    flushes: VecDeque<(u64, oneshot::Sender<()>)>,
    /// A command taken out of the queue while coalescing, handled next.
    pending: Option<Command>,
    /// Events of one rank being coalesced into the next batch. While acks are awaited a batch
    /// is sent only once full (or when a flush or another rank's events come), so a busy
    /// publisher sends full batches and an idle one sends at once.
    building: Option<(DpRank, Vec<KvEvent>)>,
}

impl Pipeline {
    /// Adds a command's events to the batch being built (with what is already queued for the
    /// same rank), or registers a flush.
    fn take(&mut self, cmd: Command, rx: &mut mpsc::UnboundedReceiver<Command>) {
        let (dp_rank, events) = match cmd {
            Command::Flush(done) => {
                self.seal();
                if self.acked >= self.made {
                    let _ = done.send(());
                } else {
                    self.flushes.push_back((self.made, done));
                }
                return;
            }
            Command::Events { dp_rank, events } => (dp_rank, events),
        };
        if self.building.as_ref().is_some_and(|(r, _)| *r != dp_rank) {
            self.seal();
        }
        let max = self.config.max_batch_events.max(1);
        let building = &mut self.building.get_or_insert_with(|| (dp_rank, Vec::new())).1;
        building.extend(events);
        while building.len() < max {
            match rx.try_recv() {
                Ok(Command::Events {
                    dp_rank: r,
                    events: more,
                }) if r == dp_rank => building.extend(more),
                Ok(other) => {
                    self.pending = Some(other);
                    break;
                }
                Err(_) => break,
            }
        }
        if building.len() >= max || self.pending.is_some() {
            self.seal();
        }
    }

    /// Encodes the batch being built into `ready`.
    fn seal(&mut self) {
        let Some((dp_rank, events)) = self.building.take() else {
            return;
        };
        let n = events.len() as u64;
        let chunks = split_for_wire(
            self.worker_id,
            &self.incarnation,
            dp_rank,
            events,
            self.config.max_batch_events,
        );
        // Events that could not be encoded at all are no longer queued.
        let kept: u64 = chunks.iter().map(|c| c.2).sum();
        self.stats
            .events_queued
            .fetch_sub(n - kept, Ordering::Relaxed);
        self.made += chunks.len() as u64;
        self.ready.extend(chunks);
    }

    /// Sends ready batches while fewer than `max_in_flight` acks are awaited.
    async fn send_ready(&mut self) {
        while self.flight.len() < self.config.max_in_flight.max(1) {
            let Some(chunk) = self.ready.pop_front() else {
                return;
            };
            let ack = send(&self.js, &self.subject, &chunk, self.config.ack_timeout).await;
            self.flight.push_back(chunk);
            self.acks.push_back(ack);
        }
    }

    /// Handles the oldest ack. On a failure, every later batch in flight is awaited too, then
    /// the failed ones are published again in order, one at a time until acked: the stream's
    /// duplicate window drops those that did land, and nothing is sent meanwhile.
    async fn acked_or_retried(&mut self, outcome: Option<anyhow::Result<bool>>) {
        let Some(outcome) = outcome else { return };
        let chunk = self.flight.pop_front().expect("a batch per ack");
        let Err(first_error) = outcome else {
            return self.done(&chunk);
        };
        let mut failed = vec![(chunk, first_error)];
        let mut later_landed = false;
        while let Some(outcome) = self.acks.next().await {
            let chunk = self.flight.pop_front().expect("a batch per ack");
            match outcome {
                Ok(_) => {
                    later_landed = true;
                    self.done(&chunk);
                }
                Err(e) => failed.push((chunk, e)),
            }
        }
        for (i, (chunk, error)) in failed.into_iter().enumerate() {
            self.stats.publish_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(subject = self.subject, msg_id = chunk.0, error = %error, "publishing KV events failed; retrying in order");
            let duplicate =
                publish_until_acked(&self.js, &self.subject, &chunk, &self.config, &self.stats)
                    .await;
            // Only the first failure can have been overtaken without the stream holding it:
            // readers then see a gap at the later batch (and resync) and skip this one.
            if i == 0 && later_landed && !duplicate {
                self.stats.publish_reordered.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    subject = self.subject,
                    msg_id = chunk.0,
                    "a KV event batch landed after later ones; indexers will resync this worker"
                );
            }
            self.done(&chunk);
        }
    }

    fn done(&mut self, (_, _, count): &Chunk) {
        self.acked += 1;
        let stats = &self.stats;
        stats.events_published.fetch_add(*count, Ordering::Relaxed);
        stats.batches_published.fetch_add(1, Ordering::Relaxed);
        stats.events_queued.fetch_sub(*count, Ordering::Relaxed);
        while self.flushes.front().is_some_and(|(n, _)| *n <= self.acked) {
            if let Some((_, done)) = self.flushes.pop_front() {
                let _ = done.send(());
            }
        }
    }
}

/// Sends one batch; its ack to await (a send that failed at once is a failed ack).
async fn send(
    js: &jetstream::Context,
    subject: &str,
    (msg_id, bytes, _): &Chunk,
    ack_timeout: Duration,
) -> AckFuture {
    let publish = PublishMessage::build()
        .payload(bytes.clone())
        .message_id(msg_id);
    match js.send_publish(subject.to_owned(), publish).await {
        Ok(ack) => {
            let ack = tokio::time::timeout(ack_timeout, ack);
            Box::pin(async move {
                match ack.await {
                    Ok(Ok(ack)) => Ok(ack.duplicate),
                    Ok(Err(e)) => Err(e.into()),
                    Err(_) => Err(anyhow::anyhow!("no ack within {ack_timeout:?}")),
                }
            })
        }
        Err(e) => Box::pin(std::future::ready(Err(e.into()))),
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

/// Publishes `chunk` until acked; whether the stream already had it (a duplicate).
async fn publish_until_acked(
    js: &jetstream::Context,
    subject: &str,
    (msg_id, bytes, _): &Chunk,
    config: &PublisherConfig,
    stats: &PublisherStats,
) -> bool {
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
            Ok(ack) => return ack.duplicate,
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
