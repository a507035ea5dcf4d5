//! The admission queue in the service: requests that found every eligible worker busy wait in
//! their partition's [`AdmissionQueue`] on the replica that owns the partition, and one task
//! (the dispatcher) serves them when capacity may have freed — after load reports, lifecycle
//! events, decisions and worker changes (the feeds wake it) — and answers `queue_timeout` when
//! their deadline comes.
//!
//! One replica queues a partition's requests: its owner (`crate::decide::owner`), to which the
//! other replicas forward them, or any replica when ownership is off. A replica whose forward
//! found no owner answering (it died and its registration has not expired yet, or it stalls)
//! queues the request itself and hands it over once a live owner takes it; only while an
//! owner is alive but unresponsive can two replicas' queues dispatch onto one freed slot (the
//! second decision is still counted by every load view). A forwarded request
//! carries its client's inbox (`Kvroute-Reply-To`); when the owner queues it, it tells the
//! forwarding replica so (`Kvroute-Queued`) and answers the client itself later. Its
//! decisions are charged to its own load view under the partition's lock, so two queued
//! requests never take one freed slot. A replica that stops owning a partition hands its
//! queued requests to the new owner (with their first arrival, `Kvroute-Arrived-Ms`, so they
//! keep their place); at shutdown it answers them `unavailable`, which clients retry.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_common::RequestId;
use kvroute_common::messages::{Decision, ErrorCode, SelectRequest, SelectResponse, now_ms};
use kvroute_common::names::headers;
use tokio::sync::Notify;

use super::Router;
use super::classifying::Classifiers;
use super::clock::Clock;
use super::reply;
use crate::classify::{Classification, ClassifyRequest, Verdict};
use crate::decide::candidates::PartitionKey;
use crate::decide::prompt::Prepared;
use crate::decide::wire;
use crate::queue::{AdmissionQueue, Left, Pushed, QueueConfig, QueueError, Ticket};
use crate::signals::SignalSnapshot;
use crate::worker::WorkerTarget;

/// Requests looked at per partition per dispatch round, in order; the round stops earlier
/// after this many consecutive requests found every eligible worker busy.
const SCAN: usize = 64;
const MAX_OVERLOADED_IN_A_ROW: usize = 8;
/// A queued request's overlap is fetched again when older than this.
const OVERLAP_MAX_AGE_MS: u64 = 500;
/// After an owner did not take a handed-over request, the next hand-over waits this long.
const HAND_OVER_BACKOFF_MS: u64 = 1_000;
/// The dispatcher runs at least this often while anything is queued.
const IDLE_ROUND: Duration = Duration::from_millis(250);

/// One queued request.
#[derive(Debug)]
pub(super) struct Waiting {
    /// Its latest attempt, prepared (hashed) once.
    pub prepared: Arc<Prepared>,
    /// Where its client waits for the answer.
    pub reply_to: async_nats::Subject,
    /// The overlap fetched for it, and when.
    pub overlap: Option<(SignalSnapshot, u64)>,
    /// What its classifier saw (with the selection target it set), when one is configured.
    pub classify: Option<ClassifyRequest>,
}

/// A queued request's turn: a copy of what deciding it needs.
pub(super) struct Turn {
    pub id: RequestId,
    pub prepared: Arc<Prepared>,
    pub overlap: Option<(SignalSnapshot, u64)>,
    pub target: Option<WorkerTarget>,
}

/// How a request enters the queue.
#[derive(Debug, Clone, Copy)]
pub(super) enum Entry {
    /// No classifier: the defaults.
    Default,
    Classified(Classification),
    /// Its classifier holds it back.
    Deferred,
}

/// What [`Admission::join`] did.
pub(super) enum Joined {
    /// Queued (or, for a retry of a queued request, its entry updated): answer later.
    Queued,
    Full(QueueError),
}

/// What a queued request's turn came to.
#[allow(clippy::large_enum_variant)]
pub(super) enum Queued {
    /// Every eligible worker is still busy: it keeps waiting.
    Overloaded,
    /// Served or refused: answer, and publish the decision if one was made.
    Answer(SelectResponse, Option<Decision>),
    /// Past its attempt's deadline.
    Expired,
}

/// Every partition's queue and classifier instance on this replica.
#[derive(Debug)]
struct State {
    partitions: HashMap<PartitionKey, AdmissionQueue<Waiting>>,
    classifiers: Classifiers,
}

/// Every partition's queue on this replica, and the request classifier's instances: one owner
/// of admission, so a dispatch round reclassifies deferred requests under the one lock it
/// already holds.
#[derive(Debug)]
pub(super) struct Admission {
    pub config: QueueConfig,
    /// The queues and the classifier instances, under one lock: nothing here takes another.
    state: Mutex<State>,
    /// Whether a classifier is configured (read without the lock).
    classifying: bool,
    held: AtomicUsize,
    pub wake: Notify,
    hand_over_blocked_until: Mutex<Option<u64>>,
}

impl Admission {
    pub fn new(config: QueueConfig, classifiers: Classifiers) -> Self {
        Self {
            config,
            classifying: classifiers.enabled(),
            state: Mutex::new(State {
                partitions: HashMap::new(),
                classifiers,
            }),
            held: AtomicUsize::new(0),
            wake: Notify::new(),
            hand_over_blocked_until: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request classifier is configured.
    pub fn classifying(&self) -> bool {
        self.classifying
    }

    /// Runs `f` on the classifier instances (nothing, without a configured classifier).
    pub fn classifiers<R: Default>(&self, f: impl FnOnce(&mut Classifiers) -> R) -> R {
        if !self.classifying {
            return R::default();
        }
        f(&mut self.lock().classifiers)
    }

    /// Requests held on this replica.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Wakes the dispatcher when something is queued (capacity may have freed).
    pub fn poke(&self) {
        if self.held() > 0 {
            self.wake.notify_one();
        }
    }

    fn recount(&self, partitions: &HashMap<PartitionKey, AdmissionQueue<Waiting>>) {
        let held = partitions.values().map(AdmissionQueue::len).sum();
        self.held.store(held, Ordering::Release);
    }

    /// Whether `id` waits in its partition's queue (a retry of it takes its place).
    pub fn is_queued(&self, key: &PartitionKey, id: &RequestId) -> bool {
        self.held() > 0
            && self
                .lock()
                .partitions
                .get(key)
                .is_some_and(|q| q.contains(id))
    }

    /// Whether admitted requests wait in the partition (a new request goes behind them).
    pub fn others_wait(&self, key: &PartitionKey) -> bool {
        self.held() > 0
            && self
                .lock()
                .partitions
                .get(key)
                .is_some_and(|q| q.waiting() > 0)
    }

    /// Queues `waiting` (a retry of a queued request takes its entry's place): admitted with
    /// its classification (or the defaults: class 0, due = arrival − priority jump, cost 1),
    /// or deferred by its classifier. `arrived_ms` is its first arrival, `now_ms` this
    /// attempt's.
    pub fn join(
        &self,
        key: &PartitionKey,
        id: RequestId,
        waiting: Waiting,
        entry: Entry,
        arrived_ms: u64,
        now_ms: u64,
    ) -> Joined {
        let mut state = self.lock();
        let partitions = &mut state.partitions;
        let config = self.config;
        let queue = partitions
            .entry(key.clone())
            .or_insert_with(|| AdmissionQueue::new(config));
        let first_arrival = queue.get(&id).map_or(arrived_ms, |(_, t)| t.arrived_ms);
        let request = &waiting.prepared.request;
        let (class, due_ms, cost, deferred) = match entry {
            Entry::Default => (
                0,
                config.due(first_arrival, request.priority_jump_ms),
                1,
                false,
            ),
            Entry::Classified(c) => (c.class, c.due_ms, c.cost.max(1), false),
            Entry::Deferred => (0, first_arrival, 1, true),
        };
        let ticket = Ticket {
            class,
            strict_priority: request.priority.unwrap_or(0),
            due_ms,
            cost,
            arrived_ms: first_arrival,
            deadline_ms: config.deadline(
                first_arrival,
                request.queue_timeout_ms,
                now_ms,
                request.deadline_ms,
            ),
        };
        let joined = match queue.push(id, waiting, ticket, deferred) {
            Ok(Pushed::New | Pushed::Replaced(_)) => Joined::Queued,
            Err(e) => Joined::Full(e),
        };
        if queue.is_empty() {
            partitions.remove(key);
        }
        self.recount(partitions);
        drop(state);
        self.wake.notify_one();
        joined
    }

    /// Takes `id` out of its partition (served or refused).
    fn take(&self, key: &PartitionKey, id: &RequestId) -> Option<Left<Waiting>> {
        let mut state = self.lock();
        let partitions = &mut state.partitions;
        let left = partitions.get_mut(key)?.take(id);
        if partitions.get(key).is_some_and(AdmissionQueue::is_empty) {
            partitions.remove(key);
        }
        self.recount(partitions);
        left
    }

    /// Takes everything out (shutdown, hand-over), with the partition of each.
    fn drain_where(
        &self,
        keep: impl Fn(&PartitionKey) -> bool,
    ) -> Vec<(PartitionKey, Left<Waiting>)> {
        let mut state = self.lock();
        let partitions = &mut state.partitions;
        let keys: Vec<PartitionKey> = partitions.keys().filter(|k| !keep(k)).cloned().collect();
        let mut out = Vec::new();
        for key in keys {
            if let Some(mut queue) = partitions.remove(&key) {
                out.extend(queue.drain().into_iter().map(|l| (key.clone(), l)));
            }
        }
        self.recount(partitions);
        out
    }

    /// Ages and expires every partition at `now_ms`, classifies deferred requests again
    /// (admitting those their classifier now admits); returns the expired requests, and the
    /// requests to try in order per partition.
    #[allow(clippy::type_complexity)]
    fn round(
        &self,
        now_ms: u64,
    ) -> (
        Vec<(PartitionKey, Left<Waiting>)>,
        Vec<(PartitionKey, Vec<Turn>)>,
    ) {
        let mut state = self.lock();
        let State {
            partitions,
            classifiers,
        } = &mut *state;
        let mut expired = Vec::new();
        let mut tries = Vec::new();
        for (key, queue) in partitions.iter_mut() {
            queue.age(now_ms);
            expired.extend(queue.expire(now_ms).into_iter().map(|l| (key.clone(), l)));
            for id in queue.deferred_ids() {
                let Some(classify) = queue.get_mut(&id).and_then(|w| w.classify.as_mut()) else {
                    continue;
                };
                if let Some(Verdict::Admit(c)) = classifiers.reclassify(key, classify, now_ms) {
                    queue.admit(&id, c.class, c.due_ms);
                }
            }
            let head: Vec<Turn> = queue
                .head(SCAN)
                .into_iter()
                .filter_map(|id| {
                    let (w, _) = queue.get(&id)?;
                    Some(Turn {
                        id,
                        prepared: w.prepared.clone(),
                        overlap: w.overlap.clone(),
                        target: w
                            .classify
                            .as_ref()
                            .and_then(ClassifyRequest::worker_selection_target),
                    })
                })
                .collect();
            if !head.is_empty() {
                tries.push((key.clone(), head));
            }
        }
        partitions.retain(|_, q| !q.is_empty());
        self.recount(partitions);
        (expired, tries)
    }

    fn remember_overlap(
        &self,
        key: &PartitionKey,
        id: &RequestId,
        overlap: SignalSnapshot,
        at: u64,
    ) {
        let mut state = self.lock();
        if let Some(queue) = state.partitions.get_mut(key)
            && let Some(w) = queue.get_mut(id)
        {
            w.overlap = Some((overlap, at));
        }
    }

    /// When the dispatcher must run next by itself: the earliest deadline or ageing.
    fn next_timer(&self) -> Option<u64> {
        self.lock()
            .partitions
            .values()
            .filter_map(AdmissionQueue::next_timer)
            .min()
    }

    /// Gauges of what waits now.
    fn gauges(&self, router: &Router) {
        let m = &router.metrics;
        m.queue_depth.clear();
        m.queue_deferred.clear();
        let state = self.lock();
        for ((model, role), queue) in state.partitions.iter() {
            if queue.deferred() > 0 {
                m.queue_deferred
                    .with(&[model, role.as_str()])
                    .set(queue.deferred() as i64);
            }
            for (class, depth) in queue.depth_by_class() {
                m.queue_depth
                    .with(&[model, role.as_str(), &class.to_string()])
                    .set(depth as i64);
            }
        }
    }
}

impl Router {
    /// Whether this replica queues requests of `request`'s partition: it owns the partition,
    /// ownership is off, or `anyway` (the request was forwarded here by a replica that thinks
    /// this one owns it, or the owner did not answer).
    pub(super) fn queues_here(&self, request: &SelectRequest, anyway: bool) -> bool {
        self.admission.config.enabled() && (anyway || self.owner_of(request).is_none())
    }
}

/// Serves the queues until the process ends: a round whenever the feeds say capacity may have
/// freed, a request joins, or a deadline or an ageing comes.
pub(super) async fn dispatch_loop(router: Arc<Router>) {
    loop {
        let timer = router
            .admission
            .next_timer()
            .map(|at| Duration::from_millis(at.saturating_sub(now_ms())).min(IDLE_ROUND));
        match timer {
            Some(wait) => {
                let _ = tokio::time::timeout(wait, router.admission.wake.notified()).await;
            }
            None => router.admission.wake.notified().await,
        }
        router.dispatch_round().await;
    }
}

impl Router {
    async fn dispatch_round(&self) {
        self.hand_over().await;
        let now = now_ms();
        let (expired, tries) = self.admission.round(now);
        for (key, left) in expired {
            self.answer_left(&key, left, ErrorCode::QueueTimeout, now)
                .await;
        }
        for (key, turns) in tries {
            let mut overloaded = 0;
            for turn in turns {
                match self.try_queued(&key, turn).await {
                    Tried::Overloaded => {
                        overloaded += 1;
                        if overloaded >= MAX_OVERLOADED_IN_A_ROW {
                            break;
                        }
                    }
                    Tried::Done => overloaded = 0,
                }
            }
        }
        self.admission.gauges(self);
    }

    /// One queued request's turn: decide it as a new request would be; served or refused, it
    /// leaves the queue and its client gets the answer.
    async fn try_queued(&self, key: &PartitionKey, turn: Turn) -> Tried {
        let clock = Clock::now();
        let now = clock.now_ms();
        let id = turn.id;
        let overlap = turn
            .overlap
            .filter(|(_, at)| now.saturating_sub(*at) <= OVERLAP_MAX_AGE_MS);
        let result = self
            .decide_queued(
                &turn.prepared,
                overlap.map(|(o, _)| o),
                turn.target,
                clock,
                |fresh| self.admission.remember_overlap(key, &id, fresh, now),
            )
            .await;
        let (response, decision) = match result {
            Queued::Overloaded => return Tried::Overloaded,
            Queued::Answer(response, decision) => (response, decision),
            Queued::Expired => {
                if let Some(left) = self.admission.take(key, &id) {
                    self.answer_left(key, left, ErrorCode::QueueTimeout, now)
                        .await;
                }
                return Tried::Done;
            }
        };
        let Some(left) = self.admission.take(key, &id) else {
            // Expired or handed over meanwhile (only this task does either): the decision
            // was charged; withdraw it, nobody will use it.
            if let Some(d) = &decision {
                self.load.withdraw(d);
            }
            return Tried::Done;
        };
        let m = &self.metrics;
        let class = left.ticket.class.to_string();
        let labels = [key.0.as_str(), key.1.as_str(), class.as_str()];
        let waited = now.saturating_sub(left.ticket.arrived_ms) as f64 / 1000.0;
        match &response {
            SelectResponse::Ok(reply) => {
                m.queue_dispatched.with(&labels).inc();
                m.queue_wait.with(&labels).observe(waited);
                let rank = crate::worker::WorkerRank::new(reply.worker_id, reply.dp_rank);
                self.admission.classifiers(|c| c.sent(id, rank, now));
            }
            SelectResponse::Error(e) => {
                m.errors.inc(e.code.as_str());
                m.queue_refused.with(&labels).inc();
                self.admission
                    .classifiers(|c| c.completed(id, crate::classify::Completion::Rejected, now));
            }
        }
        if let Some(d) = decision {
            reply::publish_decision(&self.nats, &self.decisions_subject, &d).await;
        }
        reply::send(&self.nats, left.item.reply_to, &response).await;
        Tried::Done
    }

    /// Answers a request leaving the queue unserved.
    async fn answer_left(
        &self,
        key: &PartitionKey,
        left: Left<Waiting>,
        code: ErrorCode,
        now: u64,
    ) {
        let m = &self.metrics;
        let class = left.ticket.class.to_string();
        let labels = [key.0.as_str(), key.1.as_str(), class.as_str()];
        let waited = now.saturating_sub(left.ticket.arrived_ms);
        self.admission
            .classifiers(|c| c.completed(left.id, crate::classify::Completion::Expired, now));
        let message = match code {
            ErrorCode::QueueTimeout => {
                m.queue_timeouts.with(&labels).inc();
                format!(
                    "every eligible worker stayed busy for the {waited} ms the request could wait in router {}'s queue",
                    self.router_id
                )
            }
            _ => format!("router {} is shutting down; retry", self.router_id),
        };
        m.errors.inc(code.as_str());
        let response = wire::error(code, message, Some(left.id));
        reply::send(&self.nats, left.item.reply_to, &response).await;
    }

    /// Hands the queued requests of partitions this replica does not own to their owner,
    /// keeping their first arrival; when the owner does not take one, the rest stay here too,
    /// and the next try waits [`HAND_OVER_BACKOFF_MS`].
    async fn hand_over(&self) {
        if self.peers.is_none() || self.admission.held() == 0 {
            return;
        }
        let now = now_ms();
        {
            let blocked = self.admission.hand_over_blocked_until.lock();
            if blocked
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|until| now < until)
            {
                return;
            }
        }
        let moving = self.admission.drain_where(|(model, role)| {
            let probe = SelectRequest {
                model: model.clone(),
                role: *role,
                ..SelectRequest::default()
            };
            self.owner_of(&probe).is_none()
        });
        let mut failed = false;
        for (key, left) in moving {
            let probe = SelectRequest {
                model: key.0.clone(),
                role: key.1,
                ..SelectRequest::default()
            };
            let owner = self.owner_of(&probe).filter(|_| !failed);
            let handed = match &owner {
                Some(owner) => self.hand_to(owner, &left).await,
                None => false,
            };
            if owner.is_some() && !handed {
                failed = true;
                *self
                    .admission
                    .hand_over_blocked_until
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(now + HAND_OVER_BACKOFF_MS);
            }
            if handed {
                self.metrics.queue_handed_over.inc();
                continue;
            }
            // Keep it: re-queue with its first arrival (forced: it was waiting already).
            let now = now_ms();
            let arrived = left.ticket.arrived_ms;
            let entry = if left.deferred {
                Entry::Deferred
            } else {
                Entry::Classified(Classification {
                    class: left.ticket.class,
                    due_ms: left.ticket.due_ms,
                    cost: left.ticket.cost,
                })
            };
            let _ = self
                .admission
                .join(&key, left.id, left.item, entry, arrived, now);
        }
    }

    async fn hand_to(&self, owner: &str, left: &Left<Waiting>) -> bool {
        let Ok(payload) = kvroute_common::codec::encode(&left.item.prepared.request) else {
            return false;
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(headers::FORWARDED_BY, self.router_id.as_str());
        headers.insert(headers::REPLY_TO, left.item.reply_to.as_str());
        headers.insert(
            headers::ARRIVED_MS,
            left.ticket.arrived_ms.to_string().as_str(),
        );
        let request = async_nats::Request::new()
            .payload(payload)
            .headers(headers)
            .timeout(Some(self.forward_timeout));
        match self
            .nats
            .send_request(self.names.router_select(owner), request)
            .await
        {
            Ok(answer) => {
                let queued = answer
                    .headers
                    .as_ref()
                    .is_some_and(|h| h.get(headers::QUEUED).is_some());
                if !queued {
                    // The owner decided at once: pass its answer on.
                    if let Err(e) = self
                        .nats
                        .publish(left.item.reply_to.clone(), answer.payload)
                        .await
                    {
                        tracing::warn!(error = %e, "passing on the new owner's reply failed");
                    }
                }
                true
            }
            Err(e) => {
                tracing::debug!(owner, error = %e, "the new owner did not take a queued request; keeping it");
                false
            }
        }
    }

    /// Answers every queued request `unavailable` (the process is stopping): clients retry
    /// at another replica.
    pub(super) async fn refuse_queued(&self) {
        let now = now_ms();
        for (key, left) in self.admission.drain_where(|_| false) {
            self.answer_left(&key, left, ErrorCode::Unavailable, now)
                .await;
        }
    }
}

enum Tried {
    Overloaded,
    Done,
}
