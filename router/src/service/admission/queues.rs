//! Every partition's [`AdmissionQueue`] on this replica, owned by the admission actor: no
//! lock, no I/O, time as an argument.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_common::RequestId;

use super::super::classifying::Classifiers;
use crate::classify::{Classification, ClassifyRequest, Verdict};
use crate::decide::candidates::PartitionKey;
use crate::decide::prompt::Prepared;
use crate::queue::{AdmissionQueue, Left, Pushed, QueueConfig, QueueError, Ticket};
use crate::signals::SignalSnapshot;
use crate::worker::WorkerTarget;

/// Requests looked at per partition per dispatch round, in order.
const SCAN: usize = 64;

/// One queued request.
#[derive(Debug)]
pub(in super::super) struct Waiting {
    /// Its latest attempt, prepared (hashed) once.
    pub prepared: Arc<Prepared>,
    /// Where its client waits for the answer.
    pub reply_to: async_nats::Subject,
    /// The overlap fetched for it, and when.
    pub overlap: Option<(SignalSnapshot, u64)>,
    /// What its classifier saw (with the selection target it set), when one is configured.
    pub classify: Option<ClassifyRequest>,
}

/// How a request enters the queue.
#[derive(Debug, Clone, Copy, Default)]
pub(in super::super) enum Entry {
    /// No classifier: the defaults.
    #[default]
    Default,
    Classified(Classification),
    /// Its classifier holds it back.
    Deferred,
}

impl Entry {
    /// How a request that left the queue unserved (a hand-over its new owner did not take)
    /// enters it again: as it was.
    pub fn of_left(left: &Left<Waiting>) -> Self {
        if left.deferred {
            return Self::Deferred;
        }
        Self::Classified(Classification {
            class: left.ticket.class,
            due_ms: left.ticket.due_ms,
            cost: left.ticket.cost,
        })
    }
}

/// A queued request's turn: a copy of what deciding it needs.
#[derive(Debug)]
pub(super) struct Turn {
    pub id: RequestId,
    pub prepared: Arc<Prepared>,
    pub overlap: Option<(SignalSnapshot, u64)>,
    pub target: Option<WorkerTarget>,
}

/// Every partition's queue.
#[derive(Debug)]
pub(super) struct Queues {
    config: QueueConfig,
    partitions: HashMap<PartitionKey, AdmissionQueue<Waiting>>,
}

impl Queues {
    pub fn new(config: QueueConfig) -> Self {
        Self {
            config,
            partitions: HashMap::new(),
        }
    }

    /// Requests held.
    pub fn held(&self) -> usize {
        self.partitions.values().map(AdmissionQueue::len).sum()
    }

    /// Whether `id` waits in its partition's queue (a retry of it takes its place).
    pub fn is_queued(&self, key: &PartitionKey, id: &RequestId) -> bool {
        self.partitions.get(key).is_some_and(|q| q.contains(id))
    }

    /// Whether admitted requests wait in the partition (a new request goes behind them).
    pub fn others_wait(&self, key: &PartitionKey) -> bool {
        self.partitions.get(key).is_some_and(|q| q.waiting() > 0)
    }

    /// Queues `waiting` (a retry of a queued request takes its entry's place): admitted with
    /// its classification (or the defaults: class 0, due = arrival − priority jump, cost 1),
    /// or deferred by its classifier. `arrived_ms` is its first arrival, `now_ms` this
    /// attempt's.
    pub fn join(
        &mut self,
        key: &PartitionKey,
        id: RequestId,
        waiting: Waiting,
        entry: Entry,
        arrived_ms: u64,
        now_ms: u64,
    ) -> Result<(), QueueError> {
        let config = self.config;
        let queue = self
            .partitions
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
        let pushed = queue.push(id, waiting, ticket, deferred);
        if queue.is_empty() {
            self.partitions.remove(key);
        }
        match pushed {
            Ok(Pushed::New | Pushed::Replaced(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Takes `id` out of its partition (served or refused).
    pub fn take(&mut self, key: &PartitionKey, id: &RequestId) -> Option<Left<Waiting>> {
        let left = self.partitions.get_mut(key)?.take(id);
        if self
            .partitions
            .get(key)
            .is_some_and(AdmissionQueue::is_empty)
        {
            self.partitions.remove(key);
        }
        left
    }

    /// Takes out every request of the partitions `keep` does not keep (shutdown, hand-over),
    /// with the partition of each.
    pub fn drain_where(
        &mut self,
        keep: impl Fn(&PartitionKey) -> bool,
    ) -> Vec<(PartitionKey, Left<Waiting>)> {
        let keys: Vec<PartitionKey> = self
            .partitions
            .keys()
            .filter(|k| !keep(k))
            .cloned()
            .collect();
        let mut out = Vec::new();
        for key in keys {
            if let Some(mut queue) = self.partitions.remove(&key) {
                out.extend(queue.drain().into_iter().map(|l| (key.clone(), l)));
            }
        }
        out
    }

    /// Ages and expires every partition at `now_ms`, classifies deferred requests again
    /// (admitting those their classifier now admits); returns the expired requests, and the
    /// requests to try in order per partition.
    #[allow(clippy::type_complexity)]
    pub fn round(
        &mut self,
        now_ms: u64,
        classifiers: &mut Classifiers,
    ) -> (
        Vec<(PartitionKey, Left<Waiting>)>,
        Vec<(PartitionKey, Vec<Turn>)>,
    ) {
        let mut expired = Vec::new();
        let mut tries = Vec::new();
        for (key, queue) in self.partitions.iter_mut() {
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
        self.partitions.retain(|_, q| !q.is_empty());
        (expired, tries)
    }

    /// Keeps the overlap fetched for a queued request's turn.
    pub fn remember_overlap(
        &mut self,
        key: &PartitionKey,
        id: &RequestId,
        overlap: SignalSnapshot,
        at: u64,
    ) {
        if let Some(queue) = self.partitions.get_mut(key)
            && let Some(w) = queue.get_mut(id)
        {
            w.overlap = Some((overlap, at));
        }
    }

    /// When a round must run next by itself: the earliest deadline or ageing.
    pub fn next_timer(&self) -> Option<u64> {
        self.partitions
            .values()
            .filter_map(AdmissionQueue::next_timer)
            .min()
    }

    /// Every partition's queue (the gauges).
    pub fn partitions(&self) -> impl Iterator<Item = (&PartitionKey, &AdmissionQueue<Waiting>)> {
        self.partitions.iter()
    }
}
