//! The indexer process: consumes the event log in order into a [`ReplicaState`], snapshots it
//! (leader), removes departed workers through the log (leader), asks workers with gaps to
//! resync (leader), and serves overlap queries.
//!
//! One main loop owns the state and handles every trigger of one closed [`Input`] enum; the
//! tasks around it (log consumer, etcd watch, leader campaign, query and HTTP serving) only
//! feed it or read the shared index. The leader's decisions are made by the pure
//! [`LeaderDuties`] (`duties.rs`); this loop executes its [`Action`]s.

mod bootstrap;
mod duties;
mod follower;
pub mod ingest;
mod leader;
pub mod metrics;
mod serve;
mod snapshots;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage};
use kvroute_common::codec::encode;
use kvroute_common::discovery::{WorkerEvent, watch_workers};
use kvroute_common::events_stream::ensure_events_stream;
use kvroute_common::ids::WorkerId;
use kvroute_common::jetstream::require_jetstream;
use kvroute_common::messages::{
    ControlAction, ControlRecord, ReplicaStatus, SchemaVersion, now_ms,
};
use kvroute_common::names::Names;
use kvroute_common::ops::{InFlight, spawn_watchdog, watchdog_observer};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

pub use self::duties::{Action, DutiesConfig, LeaderDuties, LeaderLease, StepDown, TickInput};
pub use self::follower::{IndexFollower, IndexFollowerConfig};
use self::ingest::LogMessage;
pub use self::metrics::IndexerMetrics;
pub use self::serve::{Answer, Readiness, ServeState, answer};
pub use self::snapshots::SnapshotStore;
use crate::config::IndexerConfig;
use crate::replica::{ApplyReport, Continuity, ReplicaState, continuity};

const TICK: Duration = Duration::from_millis(250);

/// Every trigger of the main loop.
enum Input {
    Log(LogMessage),
    Worker(WorkerEvent),
    /// The campaign's lease on leadership (`None`: not holding the key).
    Leader(Option<LeaderLease>),
    Tick,
    Status(oneshot::Sender<ReplicaStatus>),
    SnapshotDone(anyhow::Result<u64>),
    /// A bootstrap resync of every worker finished; the replica is ready once it applied
    /// the log up to this sequence.
    ResyncAllDone(u64),
    Shutdown,
}

/// Why the loop stopped consuming.
enum Stop {
    Shutdown,
    /// The log skipped messages (purged or expired under us): bootstrap again.
    Rebootstrap,
}

/// Runs an indexer replica until `shutdown` resolves.
pub async fn run(
    config: IndexerConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    config.validate()?;
    let replica_id = config.replica_id();
    let names = Names::new(&config.namespace.namespace);
    // HTTP first, so /healthz answers (and /readyz says "not ready") while connecting.
    let metrics = IndexerMetrics::new();
    metrics.snapshot_age_seconds.set(-1);
    let (status_tx, mut status_rx) = mpsc::channel(64);
    let state = ReplicaState::new(&names, config.index_config());
    let shared = Arc::new(ServeState {
        replica_id: replica_id.clone(),
        names: names.clone(),
        index: std::sync::RwLock::new(state.index().clone()),
        cards: Default::default(),
        applied_seq: Default::default(),
        ready: Default::default(),
        serving: Default::default(),
        leader_term: Default::default(),
        metrics,
        status_requests: status_tx,
    });
    let (addr, _http) = kvroute_common::ops::serve_http(
        "http-addr",
        config.http_addr,
        Arc::new(serve::Http(shared.clone())),
    )
    .await?;
    tracing::info!(replica_id, %addr, "indexer http listening");

    let nats = config.nats.connect(&replica_id).await?;
    let js = require_jetstream(&nats, &config.nats.urls.join(",")).await?;
    let etcd = config.etcd.connect().await?;
    let (stream, mismatched) = ensure_events_stream(&js, &names, &config.stream).await?;
    for m in &mismatched {
        tracing::warn!(
            stream = names.events_stream(),
            "events stream setting differs: {m}"
        );
    }
    shared
        .metrics
        .stream_mismatches
        .set(mismatched.len() as i64);
    let store = SnapshotStore::open(&js, &names, config.stream.replicas).await?;
    serve::serve_digest(nats.clone(), shared.clone()).await?;
    // Overlap queries: in the queue group only while ready and keeping up.
    let in_flight = InFlight::new();
    let (serve, _watchdog) = spawn_watchdog(
        config.watchdog(),
        in_flight.clone(),
        {
            let shared = shared.clone();
            move || shared.ready.is_ready()
        },
        watchdog_observer("query", shared.metrics.watchdog()),
    );
    let _queries = serve::serve_queries(nats.clone(), shared.clone(), serve, in_flight);

    // Everything that feeds the main loop.
    let (input_tx, mut inputs) = mpsc::channel::<Input>(4096);
    forward(
        watch_workers(etcd.clone(), &names),
        input_tx.clone(),
        Input::Worker,
    );
    let (leader_rx, resign) = leader::campaign(
        etcd.clone(),
        names.indexer_leader_key(),
        replica_id.clone(),
        config.leader_ttl(),
    );
    forward_watch(leader_rx, input_tx.clone());
    {
        let tx = input_tx.clone();
        tokio::spawn(async move {
            while let Some(reply) = status_rx.recv().await {
                if tx.send(Input::Status(reply)).await.is_err() {
                    return;
                }
            }
        });
        let tx = input_tx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            loop {
                tick.tick().await;
                if tx.send(Input::Tick).await.is_err() {
                    return;
                }
            }
        });
        let tx = input_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            let _ = tx.send(Input::Shutdown).await;
        });
    }

    // Lives as long as the receiver: the process.
    let (stream_end, _poll) = ingest::poll_stream_end(stream.clone(), TICK);
    let duties = LeaderDuties::new(DutiesConfig::from_flags(&config));
    let mut replica = IndexerProcess {
        config,
        names,
        nats,
        etcd,
        js,
        stream,
        store,
        shared,
        state,
        input_tx,
        duties,
        ready: false,
        cards_loaded: false,
        awaiting_resync_until: None,
        stream_last_seq: 0,
        stream_end,
        start_seq: 1,
        bad_logged: 0,
    };
    loop {
        let (log_tx, mut log_rx) = mpsc::channel::<LogMessage>(8192);
        let start = replica.bootstrap().await?;
        replica.start_seq = start;
        let consumer = ingest::spawn_consumer(
            replica.names.clone(),
            replica.nats.clone(),
            replica.stream.clone(),
            start,
            log_tx,
        );
        let stop = replica.run_loop(&mut inputs, &mut log_rx).await;
        consumer.abort();
        match stop {
            Stop::Shutdown => break,
            Stop::Rebootstrap => {
                tracing::warn!(
                    "the log skipped messages this replica had not applied; bootstrapping again"
                );
            }
        }
    }
    let actions = replica.duties.resign();
    replica.execute(actions);
    leader::resign(&resign);
    // Give the resignation a moment to revoke the lease.
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

fn forward<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
    tx: mpsc::Sender<Input>,
    wrap: fn(T) -> Input,
) {
    tokio::spawn(async move {
        while let Some(item) = rx.recv().await {
            if tx.send(wrap(item)).await.is_err() {
                return;
            }
        }
    });
}

fn forward_watch(mut rx: watch::Receiver<Option<LeaderLease>>, tx: mpsc::Sender<Input>) {
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let value = *rx.borrow_and_update();
            if tx.send(Input::Leader(value)).await.is_err() {
                return;
            }
        }
    });
}

/// The main loop's state: the replicated state plus this process's view of the world.
struct IndexerProcess {
    config: IndexerConfig,
    names: Names,
    nats: async_nats::Client,
    etcd: etcd_client::Client,
    js: jetstream::Context,
    stream: jetstream::stream::Stream,
    store: SnapshotStore,
    shared: Arc<ServeState>,
    state: ReplicaState,
    input_tx: mpsc::Sender<Input>,
    duties: LeaderDuties,
    ready: bool,
    cards_loaded: bool,
    /// Set while a bootstrap without usable snapshot waits for every worker's resync to land:
    /// not ready until the applied sequence reaches it.
    awaiting_resync_until: Option<u64>,
    stream_last_seq: u64,
    /// The stream's last sequence, polled off this loop ([`ingest::poll_stream_end`]).
    stream_end: watch::Receiver<u64>,
    /// Where the current consumer started (the bootstrap's choice).
    start_seq: u64,
    bad_logged: u64,
}

impl IndexerProcess {
    async fn run_loop(
        &mut self,
        inputs: &mut mpsc::Receiver<Input>,
        log: &mut mpsc::Receiver<LogMessage>,
    ) -> Stop {
        loop {
            let input = tokio::select! {
                biased;
                Some(i) = inputs.recv() => i,
                Some(m) = log.recv() => Input::Log(m),
                else => return Stop::Shutdown,
            };
            match input {
                Input::Log(msg) => {
                    let mut next = Some(msg);
                    // Drain what is already queued before looking at other inputs.
                    while let Some(msg) = next {
                        if let Continuity::Missing { expected } =
                            continuity(self.state.applied_seq(), self.start_seq, msg.seq)
                        {
                            tracing::error!(
                                applied = self.state.applied_seq(),
                                expected,
                                next = msg.seq,
                                "log messages are missing (purged or expired before this replica applied them)"
                            );
                            self.set_ready(false);
                            return Stop::Rebootstrap;
                        }
                        self.apply(msg);
                        next = if inputs.is_empty() {
                            log.try_recv().ok()
                        } else {
                            None
                        };
                    }
                    self.shared
                        .applied_seq
                        .store(self.state.applied_seq(), Ordering::Release);
                }
                Input::Worker(event) => self.on_worker_event(event),
                Input::Leader(lease) => {
                    let actions = self.duties.on_lease(lease, clock_now());
                    self.execute(actions);
                }
                Input::Tick => self.on_tick(),
                Input::Status(reply) => {
                    let _ = reply.send(self.status());
                }
                Input::SnapshotDone(result) => {
                    self.duties.on_snapshot_done();
                    match result {
                        Ok(seq) => {
                            self.shared.metrics.snapshots_written.inc();
                            tracing::info!(seq, "snapshot written");
                        }
                        Err(e) => tracing::warn!(error = %e, "writing a snapshot failed"),
                    }
                }
                Input::ResyncAllDone(target) => self.awaiting_resync_until = Some(target),
                Input::Shutdown => return Stop::Shutdown,
            }
        }
    }

    fn status(&self) -> ReplicaStatus {
        ReplicaStatus {
            v: SchemaVersion::CURRENT,
            replica_id: self.shared.replica_id.clone(),
            applied_seq: self.state.applied_seq(),
            digest: self.state.digest(),
            ready: self.ready,
            leader: self.duties.leading(clock_now()).is_some(),
            entries: self.state.index().stats().entries as u64,
            stream_last_seq: self.stream_last_seq,
        }
    }

    fn apply(&mut self, msg: LogMessage) {
        let report = self.state.apply_entry(msg.seq, msg.entry);
        self.duties.on_applied(1);
        self.record(&report);
    }

    fn record(&mut self, r: &ApplyReport) {
        let m = &self.shared.metrics;
        m.log_messages.inc();
        m.events_applied.add(u64::from(r.events_applied));
        m.events_refused.add(u64::from(r.events_refused));
        m.duplicate_events.add(u64::from(r.duplicates));
        m.ignored_removed_events.add(u64::from(r.ignored_removed));
        m.gaps.add(r.gaps.len() as u64);
        if let Some(w) = r.removed_worker {
            m.workers_removed.inc();
            m.removed_workers_tracked
                .set(self.state.tracker().removed_count() as i64);
            tracing::info!(worker_id = w, "worker removed from the index");
        }
        if let Some(term) = r.stale_term {
            m.stale_term_records.inc();
            tracing::warn!(
                term,
                newest_term = self.state.tracker().term(),
                seq = self.state.applied_seq(),
                "ignored a control record of a deposed leader's term"
            );
        }
        if let Some(bad) = &r.bad {
            m.bad_messages.inc(bad.reason());
            self.bad_logged += 1;
            if self.bad_logged <= 10 || self.bad_logged.is_multiple_of(1000) {
                tracing::warn!(seq = self.state.applied_seq(), error = %bad, count = self.bad_logged, "skipped a bad log message");
            }
        }
        for (w, rank, expected, got) in &r.gaps {
            tracing::warn!(worker_id = w, dp_rank = rank, expected, got, "event gap");
        }
        let now = clock_now();
        let asks: Vec<Action> = r
            .needs_resync
            .iter()
            .filter_map(|&w| self.duties.on_needs_resync(w, self.ready, now))
            .collect();
        self.execute(asks);
    }

    /// Carries out the leader duties' decisions.
    fn execute(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::BecameLeader { term } => {
                    let m = &self.shared.metrics;
                    self.shared.leader_term.store(term, Ordering::Release);
                    m.leader.set(1);
                    m.leader_term.set(term as i64);
                    m.leader_terms.inc();
                    tracing::info!(term, replica_id = %self.shared.replica_id, "became snapshot leader");
                }
                Action::SteppedDown { term, reason } => {
                    let m = &self.shared.metrics;
                    self.shared.leader_term.store(0, Ordering::Release);
                    m.leader.set(0);
                    m.leader_term.set(0);
                    m.step_downs.inc(reason.as_str());
                    tracing::warn!(term, reason = %reason.as_str(), replica_id = %self.shared.replica_id, "stepped down");
                }
                Action::AppendRemoval {
                    worker_id,
                    msg_id,
                    term,
                } => self.append_removal(worker_id, msg_id, term),
                Action::RequestResync { worker_id } => self.request_resync(worker_id),
                Action::WriteSnapshot { seq, term } => self.write_snapshot(seq, term),
            }
        }
    }

    fn request_resync(&mut self, worker_id: WorkerId) {
        self.shared.metrics.resync_requests.inc();
        let nats = self.nats.clone();
        let subject = self.names.worker_resync(worker_id);
        tokio::spawn(async move {
            match tokio::time::timeout(Duration::from_secs(10), nats.request(subject, "".into()))
                .await
            {
                Ok(Ok(_)) => tracing::info!(worker_id, "worker resynced"),
                Ok(Err(e)) => tracing::warn!(worker_id, error = %e, "resync request failed"),
                Err(_) => tracing::warn!(worker_id, "resync request timed out"),
            }
        });
    }

    fn on_worker_event(&mut self, event: WorkerEvent) {
        let mut cards = self.shared.cards.write().expect("cards lock");
        match event {
            WorkerEvent::Snapshot { cards: all, .. } => {
                *cards = all.into_iter().map(|c| (c.worker_id, c)).collect();
                self.cards_loaded = true;
            }
            WorkerEvent::Put { card, .. } => {
                cards.insert(card.worker_id, card);
            }
            WorkerEvent::Delete {
                worker_id,
                revision,
            } => {
                cards.remove(&worker_id);
                drop(cards);
                let action = self
                    .duties
                    .on_worker_deleted(worker_id, revision, clock_now());
                self.execute(action.into_iter().collect());
            }
            WorkerEvent::Invalid { key, reason, error } => {
                self.shared.metrics.bad_cards.inc(reason.label());
                tracing::warn!(key, error, "ignoring an undecodable worker card");
            }
        }
    }

    /// Appends `WorkerRemoved` to the log in leader term `term` (JetStream deduplicates by
    /// `msg_id`); retries stop as soon as this replica no longer acts in that term.
    fn append_removal(&mut self, worker_id: WorkerId, msg_id: String, term: u64) {
        let record = ControlRecord {
            v: SchemaVersion::CURRENT,
            action: ControlAction::WorkerRemoved { worker_id },
            replica_id: self.shared.replica_id.clone(),
            term,
            at_ms: now_ms(),
        };
        let Ok(bytes) = encode(&record) else { return };
        let js = self.js.clone();
        let subject = self.names.kv_control();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            for attempt in 0..20 {
                if shared.leader_term.load(Ordering::Acquire) != term {
                    tracing::warn!(
                        worker_id,
                        term,
                        "no longer leading; not appending WorkerRemoved"
                    );
                    return;
                }
                let msg = PublishMessage::build()
                    .payload(bytes.clone())
                    .message_id(&msg_id);
                if let Ok(ack) = js.send_publish(subject.clone(), msg).await
                    && ack.await.is_ok()
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(250 * (attempt + 1))).await;
            }
            tracing::error!(worker_id, "could not append WorkerRemoved to the log");
        });
    }

    fn on_tick(&mut self) {
        // The poll's newest answer (never older than the bootstrap's: the stream only grows).
        self.stream_last_seq = self.stream_last_seq.max(*self.stream_end.borrow());
        let lag = self
            .stream_last_seq
            .saturating_sub(self.state.applied_seq());
        let m = &self.shared.metrics;
        m.lag.set(lag as i64);
        m.applied_seq.set(self.state.applied_seq() as i64);
        let stats = self.state.index().stats();
        m.index_entries.set(stats.entries as i64);
        m.index_nodes.set(stats.nodes as i64);
        m.index_runs.set(stats.runs as i64);
        m.index_bytes.set(stats.bytes_in_use as i64);
        m.index_evicted.set(stats.anomalies.evicted_entries as i64);
        m.removed_workers_tracked
            .set(self.state.tracker().removed_count() as i64);
        let now = clock_now();
        if let Some(age) = self.duties.snapshot_age(now) {
            m.snapshot_age_seconds.set(age.as_secs() as i64);
        }
        let resync_done = match self.awaiting_resync_until {
            Some(target) => target > 0 && self.state.applied_seq() >= target,
            None => true,
        };
        if resync_done {
            self.awaiting_resync_until = None;
        }
        self.set_ready(resync_done && lag <= self.config.ready_max_lag);
        let registered: Option<HashSet<WorkerId>> = self.cards_loaded.then(|| {
            self.shared
                .cards
                .read()
                .expect("cards lock")
                .keys()
                .copied()
                .collect()
        });
        let live = self.state.tracker().live_workers();
        let actions = self.duties.tick(
            now,
            TickInput {
                ready: self.ready,
                applied_seq: self.state.applied_seq(),
                registered: registered.as_ref(),
                live: &live,
            },
        );
        self.execute(actions);
    }

    /// Readiness (`/readyz`); a replica that is not ready answers queries `not_ready` and
    /// leaves the query group.
    fn set_ready(&mut self, ready: bool) {
        self.ready = ready;
        if self.shared.ready.set(ready) {
            let applied_seq = self.state.applied_seq();
            if ready {
                // From now on queries read the index: readers must never wait for the writer.
                self.state.index().attach_second_copy();
                tracing::info!(applied_seq, "ready: caught up with the log");
            } else {
                tracing::warn!(
                    applied_seq,
                    "not ready: answering overlap queries not_ready"
                );
            }
        }
        self.shared.metrics.ready.set(i64::from(ready));
    }

    /// Takes the state as of `seq` now and writes it off this loop (the log keeps being
    /// applied meanwhile); purging the log waits until the snapshot is stored and is skipped
    /// if this replica no longer acts in `term` by then.
    fn write_snapshot(&mut self, seq: u64, term: u64) {
        let pending = self.state.snapshot_later().written_in_term(term);
        debug_assert_eq!(pending.applied_seq(), seq);
        let store = self.store.clone();
        let keep = self.config.snapshot_keep;
        let purge = self.config.purge_log;
        let stream = self.stream.clone();
        let tx = self.input_tx.clone();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let result = async {
                let bytes = tokio::task::spawn_blocking(move || pending.write()).await?;
                store.save(seq, bytes).await?;
                if shared.leader_term.load(Ordering::Acquire) != term {
                    anyhow::bail!("stepped down from term {term} while writing; not pruning");
                }
                let kept = store.prune(keep).await?;
                if purge && let Some(oldest) = kept.last() {
                    // Everything up to the oldest kept snapshot is inside every kept snapshot.
                    stream.purge().sequence(oldest + 1).await?;
                }
                Ok(seq)
            }
            .await;
            let _ = tx.send(Input::SnapshotDone(result)).await;
        });
    }
}

/// The main loop's clock, read here and handed to the duties (a core: no clock of its own).
#[allow(
    clippy::disallowed_methods,
    reason = "the shell reads the clock for the cores"
)]
fn clock_now() -> Instant {
    Instant::now()
}
