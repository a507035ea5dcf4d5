//! The admission actor: the one owner of the queues and the classifier instances; it handles
//! one [`Input`] at a time, does no I/O but sending answers (each in a task of its own, so a
//! slow connection never holds it up), and leaves the selections of queued requests to the
//! round task.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_common::messages::{ErrorCode, SelectResponse, now_ms};
use tokio::sync::mpsc;

use super::queues::{Entry, Queues, Waiting};
use super::{Admit, Admitted, Arrival, Input, Join, Queued, Turned, round};
use crate::classify::{Completion, Verdict};
use crate::decide::candidates::PartitionKey;
use crate::decide::wire;
use crate::queue::{Left, QueueConfig};
use crate::service::Router;
use crate::service::classifying::Classifiers;
use crate::service::reply;

/// After an owner did not take a handed-over request, the next hand-over waits this long.
const HAND_OVER_BACKOFF_MS: u64 = 1_000;
/// A round runs at least this often while anything is queued.
const IDLE_ROUND: Duration = Duration::from_millis(250);

/// See the module docs.
#[derive(Debug)]
pub(in crate::service) struct Actor {
    queues: Queues,
    classifiers: Classifiers,
    held: Arc<AtomicUsize>,
    poked: Arc<AtomicBool>,
    /// For the round tasks' results.
    tx: mpsc::UnboundedSender<Input>,
    rx: mpsc::UnboundedReceiver<Input>,
    /// A round task is running (one at a time: a partition's turns go in order).
    round_running: bool,
    /// A round is due (capacity may have freed, something joined, a timer came).
    round_wanted: bool,
    hand_over_blocked_until: Option<u64>,
}

impl Actor {
    pub(super) fn new(
        config: QueueConfig,
        classifiers: Classifiers,
        held: Arc<AtomicUsize>,
        poked: Arc<AtomicBool>,
        tx: mpsc::UnboundedSender<Input>,
        rx: mpsc::UnboundedReceiver<Input>,
    ) -> Self {
        Self {
            queues: Queues::new(config),
            classifiers,
            held,
            poked,
            tx,
            rx,
            round_running: false,
            round_wanted: false,
            hand_over_blocked_until: None,
        }
    }

    /// Handles inputs until shutdown (or until every handle is gone).
    pub async fn run(mut self, router: Arc<Router>) {
        loop {
            let timer = (self.queues.held() > 0).then(|| {
                self.queues.next_timer().map_or(IDLE_ROUND, |at| {
                    Duration::from_millis(at.saturating_sub(now_ms())).min(IDLE_ROUND)
                })
            });
            let input = match timer {
                Some(wait) => match tokio::time::timeout(wait, self.rx.recv()).await {
                    Ok(input) => input,
                    Err(_) => {
                        self.round_wanted = true;
                        self.maybe_round(&router);
                        continue;
                    }
                },
                None => self.rx.recv().await,
            };
            let Some(input) = input else { return };
            if let Input::Shutdown(done) = input {
                self.refuse_all(&router).await;
                let _ = done.send(());
                return;
            }
            self.handle(input, &router);
            self.maybe_round(&router);
        }
    }

    fn recount(&self) {
        self.held.store(self.queues.held(), Ordering::Release);
    }

    fn handle(&mut self, input: Input, router: &Arc<Router>) {
        match input {
            Input::Arrival(arrival, answer) => {
                let admit = self.arrive(*arrival, router);
                let _ = answer.send(admit);
            }
            Input::Join(join, answer) => {
                let Join {
                    key,
                    waiting,
                    admitted,
                    arrived_ms,
                    now_ms,
                } = *join;
                let admit = self.join(&key, waiting, admitted.entry, arrived_ms, now_ms, router);
                let _ = answer.send(admit);
            }
            Input::Ended { id, rank, now_ms } => match rank {
                Some(rank) => self.classifiers.sent(id, rank, now_ms),
                None => self.classifiers.completed(id, Completion::Rejected, now_ms),
            },
            Input::Capacity => {
                self.poked.store(false, Ordering::Release);
                self.round_wanted = true;
            }
            Input::Lifecycle(event) => self.classifiers.lifecycle(&event, now_ms()),
            Input::Workers {
                departed,
                partitions,
            } => {
                let now = now_ms();
                for worker_id in departed {
                    self.classifiers.worker_departed(worker_id, now);
                }
                self.classifiers
                    .workers_changed(|key| partitions.get(key).map(|p| (**p).clone()));
                self.round_wanted = true;
            }
            Input::Turned(turned) => self.turned(*turned, router),
            Input::Kept { left, failed } => {
                let now = now_ms();
                if failed {
                    self.hand_over_blocked_until = Some(now + HAND_OVER_BACKOFF_MS);
                }
                for (key, left) in left {
                    // Back in with its first arrival and its place (it was waiting already).
                    let entry = Entry::of_left(&left);
                    let arrived = left.ticket.arrived_ms;
                    let _ = self
                        .queues
                        .join(&key, left.id, left.item, entry, arrived, now);
                }
                self.recount();
                self.round_wanted = true;
            }
            Input::RoundDone => {
                self.round_running = false;
                self.gauges(router);
            }
            Input::Tick => {
                let m = &router.metrics;
                self.classifiers
                    .expire(now_ms(), router.prediction_max_age_ms);
                m.classifier_tracked.set(self.classifiers.tracked() as i64);
            }
            Input::Shutdown(_) => unreachable!("handled by the loop"),
        }
    }

    /// Classifies a new request (a retry of a queued one takes its place instead), and queues
    /// it when its classifier defers it or admitted requests wait before it.
    fn arrive(&mut self, arrival: Arrival, router: &Router) -> Admit {
        let Arrival {
            key,
            prepared,
            reply_to,
            arrived_ms,
            now_ms,
        } = arrival;
        let id = prepared.request_id;
        if let Some(reply_to) = &reply_to
            && self.queues.is_queued(&key, &id)
        {
            let waiting = Waiting {
                prepared,
                reply_to: reply_to.clone(),
                overlap: None,
                classify: None,
            };
            return self.join(&key, waiting, Entry::Default, arrived_ms, now_ms, router);
        }
        let mut admitted = Admitted::default();
        if self.classifiers.enabled() {
            let request = &prepared.request;
            let mut classify =
                Classifiers::request(request, id, prepared.prompt.tokens, arrived_ms);
            match self
                .classifiers
                .classify(&key, &prepared.partition, &mut classify, now_ms)
            {
                Some(Verdict::Admit(c)) => admitted.entry = Entry::Classified(c),
                Some(Verdict::Defer) => admitted.entry = Entry::Deferred,
                None => {}
            }
            admitted.classify = Some(classify);
        }
        let joins_now = matches!(admitted.entry, Entry::Deferred) || self.queues.others_wait(&key);
        if !joins_now {
            return Admit::Select(admitted);
        }
        let Some(reply_to) = reply_to else {
            // Deferred where nothing may queue (`--queue-max-len 0`).
            self.classifiers.completed(id, Completion::Rejected, now_ms);
            return Admit::Refused(Box::new(wire::error(
                ErrorCode::QueueFull,
                format!(
                    "the request classifier deferred the request and router {} has no admission queue (--queue-max-len 0)",
                    router.router_id
                ),
                Some(id),
            )));
        };
        let waiting = Waiting {
            prepared,
            reply_to,
            overlap: None,
            classify: admitted.classify,
        };
        self.join(&key, waiting, admitted.entry, arrived_ms, now_ms, router)
    }

    /// Queues `waiting` (see [`Queues::join`]), with the metrics; a full queue refuses it
    /// `queue_full`.
    fn join(
        &mut self,
        key: &PartitionKey,
        waiting: Waiting,
        entry: Entry,
        arrived_ms: u64,
        now_ms: u64,
        router: &Router,
    ) -> Admit {
        let id = waiting.prepared.request_id;
        let labels = [key.0.as_str(), key.1.as_str()];
        let joined = self
            .queues
            .join(key, id, waiting, entry, arrived_ms, now_ms);
        self.recount();
        self.round_wanted = true;
        match joined {
            Ok(()) => {
                router.metrics.queue_joined.with(&labels).inc();
                Admit::Queued
            }
            Err(e) => {
                router.metrics.queue_full.with(&labels).inc();
                self.classifiers.completed(id, Completion::Rejected, now_ms);
                Admit::Refused(Box::new(wire::error(
                    ErrorCode::QueueFull,
                    format!(
                        "every eligible worker is busy and router {}'s queue for this model is full: {e}",
                        router.router_id
                    ),
                    Some(id),
                )))
            }
        }
    }

    /// Starts a round when one is due and none runs: hands over the partitions another
    /// replica owns now, answers what expired, classifies deferred requests again, and gives
    /// the heads of the queues to a round task.
    fn maybe_round(&mut self, router: &Arc<Router>) {
        if !self.round_wanted || self.round_running || self.queues.held() == 0 {
            return;
        }
        self.round_wanted = false;
        let now = now_ms();
        let moving = match router.peers.is_some()
            && self
                .hand_over_blocked_until
                .is_none_or(|until| now >= until)
        {
            true => self
                .queues
                .drain_where(|key| router.owner_of_partition(key).is_none()),
            false => Vec::new(),
        };
        let (expired, tries) = self.queues.round(now, &mut self.classifiers);
        self.recount();
        for (key, left) in expired {
            self.answer_left(router, &key, left, ErrorCode::QueueTimeout, now);
        }
        if moving.is_empty() && tries.is_empty() {
            self.gauges(router);
            return;
        }
        self.round_running = true;
        tokio::spawn(round::run(router.clone(), moving, tries, self.tx.clone()));
    }

    /// What a round did with a turn: a served or refused request leaves the queue and its
    /// client gets the answer; a decision for a request no longer queued (expired or handed
    /// over meanwhile) is withdrawn.
    fn turned(&mut self, turned: Turned, router: &Router) {
        let Turned {
            key,
            id,
            queued,
            fresh_overlap,
            now_ms: now,
        } = turned;
        let (response, decision) = match queued {
            Queued::Overloaded => {
                if let Some(overlap) = fresh_overlap {
                    self.queues.remember_overlap(&key, &id, overlap, now);
                }
                return;
            }
            Queued::Expired => {
                if let Some(left) = self.queues.take(&key, &id) {
                    self.recount();
                    self.answer_left(router, &key, left, ErrorCode::QueueTimeout, now);
                }
                return;
            }
            Queued::Answer(response, decision) => (response, decision),
        };
        let Some(left) = self.queues.take(&key, &id) else {
            if let Some(d) = &decision {
                router.load.withdraw(d);
            }
            return;
        };
        self.recount();
        let m = &router.metrics;
        let class = left.ticket.class.to_string();
        let labels = [key.0.as_str(), key.1.as_str(), class.as_str()];
        let waited = now.saturating_sub(left.ticket.arrived_ms) as f64 / 1000.0;
        match &response {
            SelectResponse::Ok(reply) => {
                m.queue_dispatched.with(&labels).inc();
                m.queue_wait.with(&labels).observe(waited);
                let rank = crate::worker::WorkerRank::new(reply.worker_id, reply.dp_rank);
                self.classifiers.sent(id, rank, now);
            }
            SelectResponse::Error(e) => {
                m.errors.inc(e.code.as_str());
                m.queue_refused.with(&labels).inc();
                self.classifiers.completed(id, Completion::Rejected, now);
            }
        }
        let (nats, subject) = (router.nats.clone(), router.decisions_subject.clone());
        let inbox = left.item.reply_to;
        tokio::spawn(async move {
            if let Some(d) = decision {
                reply::publish_decision(&nats, &subject, &d).await;
            }
            reply::send(&nats, inbox, &response).await;
        });
    }

    /// Answers a request leaving the queue unserved (in a task of its own).
    fn answer_left(
        &mut self,
        router: &Router,
        key: &PartitionKey,
        left: Left<Waiting>,
        code: ErrorCode,
        now: u64,
    ) {
        let (inbox, response) = self.refusal(router, key, left, code, now);
        let nats = router.nats.clone();
        tokio::spawn(async move { reply::send(&nats, inbox, &response).await });
    }

    fn refusal(
        &mut self,
        router: &Router,
        key: &PartitionKey,
        left: Left<Waiting>,
        code: ErrorCode,
        now: u64,
    ) -> (async_nats::Subject, SelectResponse) {
        let m = &router.metrics;
        let class = left.ticket.class.to_string();
        let labels = [key.0.as_str(), key.1.as_str(), class.as_str()];
        let waited = now.saturating_sub(left.ticket.arrived_ms);
        self.classifiers
            .completed(left.id, Completion::Expired, now);
        let message = match code {
            ErrorCode::QueueTimeout => {
                m.queue_timeouts.with(&labels).inc();
                format!(
                    "every eligible worker stayed busy for the {waited} ms the request could wait in router {}'s queue",
                    router.router_id
                )
            }
            _ => format!("router {} is shutting down; retry", router.router_id),
        };
        m.errors.inc(code.as_str());
        (
            left.item.reply_to,
            wire::error(code, message, Some(left.id)),
        )
    }

    /// Answers every queued request `unavailable` (the process is stopping): clients retry
    /// at another replica.
    async fn refuse_all(&mut self, router: &Router) {
        let now = now_ms();
        let all = self.queues.drain_where(|_| false);
        self.recount();
        for (key, left) in all {
            let (inbox, response) = self.refusal(router, &key, left, ErrorCode::Unavailable, now);
            reply::send(&router.nats, inbox, &response).await;
        }
    }

    /// Gauges of what waits now.
    fn gauges(&self, router: &Router) {
        let m = &router.metrics;
        m.queue_depth.clear();
        m.queue_deferred.clear();
        for ((model, role), queue) in self.queues.partitions() {
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
