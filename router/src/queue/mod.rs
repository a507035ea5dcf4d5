//! The admission queue of one (model, role) partition, pure: requests that found every
//! eligible worker busy wait here, in order, until a worker has room or their deadline passes.
//!
//! Order (the head is served first):
//! 1. **aged** requests — those that have waited `age_limit_ms` — oldest arrival first, ahead
//!    of everything else. This bounds starvation: once aged, a request is overtaken only by
//!    requests that arrived before it, so it waits at most `age_limit_ms` plus the time to
//!    serve the aged requests older than itself (and never past its deadline);
//! 2. then by policy **class** (the classifier's; lower first);
//! 3. then by **strict priority** (larger first);
//! 4. then FCFS by **due time**: arrival minus the request's `priority_jump_ms` (negative
//!    treated as 0, at most `max_priority_jump_ms`), unless the classifier set another. A
//!    request is overtaken within its class and priority only by requests due before it.
//!
//! A request can also be **deferred** by its classifier: it holds its queue slots and its
//! deadline but is not in the order until the classifier admits it.
//!
//! Capacity is counted in cost units (a request's `cost`, 1 by default): `max_len` in all,
//! deferred requests included; a request that does not fit is refused (`queue_full`).
//!
//! A request id appears once. A retry of a queued request (same id) takes over the entry's
//! item and deadline and keeps its place.
//!
//! No clock: every time is an argument.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvroute_common::RequestId;

#[cfg(test)]
mod tests;

/// The most a queued request's deadline is moved before its attempt's (see
/// [`QueueConfig::deadline`]).
pub const ANSWER_MARGIN_MS: u64 = 25;

/// The queue's limits (the router's `--queue-*` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueConfig {
    /// Cost units the queue holds (deferred requests included); 0 turns queueing off.
    pub max_len: u32,
    /// How long a request without its own `queue_timeout_ms` may wait.
    pub default_timeout_ms: u64,
    /// The longest wait a request may ask for.
    pub max_timeout_ms: u64,
    /// The largest `priority_jump_ms` honoured.
    pub max_priority_jump_ms: u64,
    /// A request waiting this long goes ahead of every class and priority (oldest first).
    pub age_limit_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_len: 1024,
            default_timeout_ms: 30_000,
            max_timeout_ms: 300_000,
            max_priority_jump_ms: 60_000,
            age_limit_ms: 10_000,
        }
    }
}

impl QueueConfig {
    /// Whether requests may queue at all.
    pub fn enabled(&self) -> bool {
        self.max_len > 0
    }

    /// When a request that first arrived at `arrived_ms` stops waiting: its own queue timeout
    /// (capped at `max_timeout_ms`) or the default; and, when its current attempt (received
    /// at `now_ms`) has a deadline, a little before that — a quarter of the attempt's time
    /// left, at most [`ANSWER_MARGIN_MS`] — so that the `queue_timeout` answer reaches a client
    /// still waiting for it.
    pub fn deadline(
        &self,
        arrived_ms: u64,
        queue_timeout_ms: Option<u64>,
        now_ms: u64,
        attempt_deadline_ms: Option<u64>,
    ) -> u64 {
        let wait = queue_timeout_ms
            .unwrap_or(self.default_timeout_ms)
            .min(self.max_timeout_ms);
        let own = arrived_ms.saturating_add(wait);
        attempt_deadline_ms.map_or(own, |d| {
            let margin = (d.saturating_sub(now_ms) / 4).min(ANSWER_MARGIN_MS);
            own.min(d - margin)
        })
    }

    /// The FCFS key of a request without a classifier's: arrival moved forward by its
    /// priority jump (negative → 0, capped at `max_priority_jump_ms`).
    pub fn due(&self, arrived_ms: u64, priority_jump_ms: Option<i64>) -> u64 {
        let jump = u64::try_from(priority_jump_ms.unwrap_or(0).max(0)).unwrap_or(0);
        arrived_ms.saturating_sub(jump.min(self.max_priority_jump_ms))
    }
}

/// Where a request goes in the order, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// The classifier's policy class; lower first.
    pub class: u8,
    /// Larger first.
    pub strict_priority: i32,
    /// The FCFS key (see [`QueueConfig::due`]).
    pub due_ms: u64,
    /// Queue slots it occupies (at least 1).
    pub cost: u32,
    /// When it first arrived (its age and the aged order count from here).
    pub arrived_ms: u64,
    /// When it stops waiting (`queue_timeout`).
    pub deadline_ms: u64,
}

/// Why a request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("the queue is full ({used} of {max} slots used; the request needs {cost})")]
    Full { used: u32, max: u32, cost: u32 },
}

/// What [`AdmissionQueue::push`] did.
#[derive(Debug, PartialEq)]
pub enum Pushed<T> {
    New,
    /// The id was already queued (a retry): its item and deadline were replaced, its place
    /// kept; here is the item it had.
    Replaced(T),
}

/// A request leaving the queue.
#[derive(Debug, PartialEq)]
pub struct Left<T> {
    pub id: RequestId,
    pub item: T,
    pub ticket: Ticket,
    /// It was deferred by its classifier, never admitted.
    pub deferred: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct OrderKey {
    /// 0 once aged, else 1.
    band: u8,
    class: u8,
    /// `i32::MAX - strict_priority`, so larger priorities sort first.
    inverted_priority: u32,
    /// Due time (arrival once aged).
    key_ms: u64,
    seq: u64,
}

#[derive(Debug)]
struct Entry<T> {
    item: T,
    ticket: Ticket,
    seq: u64,
    /// `None` while deferred.
    order: Option<OrderKey>,
}

/// One partition's waiting requests (see the module docs).
#[derive(Debug)]
pub struct AdmissionQueue<T> {
    config: QueueConfig,
    entries: HashMap<RequestId, Entry<T>>,
    order: BTreeMap<OrderKey, RequestId>,
    /// Admitted, not yet aged entries by arrival: who ages next.
    not_aged: BTreeSet<(u64, u64, RequestId)>,
    deferred: BTreeSet<(u64, u64, RequestId)>,
    deadlines: BTreeSet<(u64, u64, RequestId)>,
    used: u32,
    next_seq: u64,
}

impl<T> AdmissionQueue<T> {
    pub fn new(config: QueueConfig) -> Self {
        Self {
            config,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            not_aged: BTreeSet::new(),
            deferred: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            used: 0,
            next_seq: 0,
        }
    }

    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Requests held (admitted and deferred).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Admitted requests waiting for a worker (in the order).
    pub fn waiting(&self) -> usize {
        self.order.len()
    }

    /// Requests their classifier holds back.
    pub fn deferred(&self) -> usize {
        self.deferred.len()
    }

    /// Cost units in use.
    pub fn used(&self) -> u32 {
        self.used
    }

    pub fn contains(&self, id: &RequestId) -> bool {
        self.entries.contains_key(id)
    }

    pub fn get(&self, id: &RequestId) -> Option<(&T, &Ticket)> {
        self.entries.get(id).map(|e| (&e.item, &e.ticket))
    }

    /// The item of a queued request (its ticket is the queue's).
    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut T> {
        self.entries.get_mut(id).map(|e| &mut e.item)
    }

    /// Queues an admitted request (`deferred` false) or a deferred one. A request id already
    /// queued keeps its place and ticket and takes `item` and `ticket.deadline_ms` (a retry's
    /// attempt says when its client stops waiting; compute it from the first arrival, see
    /// [`AdmissionQueue::get`]).
    pub fn push(
        &mut self,
        id: RequestId,
        item: T,
        ticket: Ticket,
        deferred: bool,
    ) -> Result<Pushed<T>, QueueError> {
        if let Some(entry) = self.entries.get_mut(&id) {
            let old = std::mem::replace(&mut entry.item, item);
            self.deadlines
                .remove(&(entry.ticket.deadline_ms, entry.seq, id));
            entry.ticket.deadline_ms = ticket.deadline_ms;
            self.deadlines.insert((ticket.deadline_ms, entry.seq, id));
            return Ok(Pushed::Replaced(old));
        }
        let cost = ticket.cost.max(1);
        if self.used.saturating_add(cost) > self.config.max_len {
            return Err(QueueError::Full {
                used: self.used,
                max: self.config.max_len,
                cost,
            });
        }
        let ticket = Ticket { cost, ..ticket };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.used += cost;
        self.deadlines.insert((ticket.deadline_ms, seq, id));
        let mut entry = Entry {
            item,
            ticket,
            seq,
            order: None,
        };
        if deferred {
            self.deferred.insert((ticket.arrived_ms, seq, id));
        } else {
            self.admit_entry(id, &mut entry, false);
        }
        self.entries.insert(id, entry);
        Ok(Pushed::New)
    }

    fn admit_entry(&mut self, id: RequestId, entry: &mut Entry<T>, aged: bool) {
        let t = &entry.ticket;
        let key = if aged {
            OrderKey {
                band: 0,
                class: 0,
                inverted_priority: 0,
                key_ms: t.arrived_ms,
                seq: entry.seq,
            }
        } else {
            self.not_aged.insert((t.arrived_ms, entry.seq, id));
            OrderKey {
                band: 1,
                class: t.class,
                inverted_priority: (i64::from(i32::MAX) - i64::from(t.strict_priority)) as u32,
                key_ms: t.due_ms,
                seq: entry.seq,
            }
        };
        self.order.insert(key, id);
        entry.order = Some(key);
    }

    /// Moves requests that have waited `age_limit_ms` by `now_ms` ahead of the rest; returns
    /// how many aged.
    pub fn age(&mut self, now_ms: u64) -> usize {
        let mut aged = 0;
        while let Some(&(arrived, seq, id)) = self.not_aged.first() {
            if arrived.saturating_add(self.config.age_limit_ms) > now_ms {
                break;
            }
            self.not_aged.remove(&(arrived, seq, id));
            if let Some(mut entry) = self.entries.remove(&id) {
                if let Some(key) = entry.order.take() {
                    self.order.remove(&key);
                }
                self.admit_entry(id, &mut entry, true);
                self.entries.insert(id, entry);
                aged += 1;
            }
        }
        aged
    }

    /// Deferred requests, oldest first (to classify again).
    pub fn deferred_ids(&self) -> Vec<RequestId> {
        self.deferred.iter().map(|&(_, _, id)| id).collect()
    }

    /// Admits a deferred request with its classification (`class`, `due_ms`; the cost it was
    /// queued with stays). Returns false when `id` is not deferred here.
    pub fn admit(&mut self, id: &RequestId, class: u8, due_ms: u64) -> bool {
        let Some(mut entry) = self.entries.remove(id) else {
            return false;
        };
        if entry.order.is_some() {
            self.entries.insert(*id, entry);
            return false;
        }
        self.deferred
            .remove(&(entry.ticket.arrived_ms, entry.seq, *id));
        entry.ticket.class = class;
        entry.ticket.due_ms = due_ms;
        self.admit_entry(*id, &mut entry, false);
        self.entries.insert(*id, entry);
        true
    }

    /// Admitted requests in serving order, at most `limit`.
    pub fn head(&self, limit: usize) -> Vec<RequestId> {
        self.order.values().take(limit).copied().collect()
    }

    /// Takes a request out (served, refused, or handed on).
    pub fn take(&mut self, id: &RequestId) -> Option<Left<T>> {
        let entry = self.entries.remove(id)?;
        let t = entry.ticket;
        self.used -= t.cost;
        self.deadlines.remove(&(t.deadline_ms, entry.seq, *id));
        self.not_aged.remove(&(t.arrived_ms, entry.seq, *id));
        let deferred = match entry.order {
            Some(key) => {
                self.order.remove(&key);
                false
            }
            None => {
                self.deferred.remove(&(t.arrived_ms, entry.seq, *id));
                true
            }
        };
        Some(Left {
            id: *id,
            item: entry.item,
            ticket: t,
            deferred,
        })
    }

    /// Takes out every request whose deadline is before `now_ms`, earliest first.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Left<T>> {
        let mut out = Vec::new();
        while let Some(&(deadline, _, id)) = self.deadlines.first() {
            if deadline >= now_ms {
                break;
            }
            out.extend(self.take(&id));
        }
        out
    }

    /// Takes out everything, in serving order, deferred requests last (shutdown, hand-over).
    pub fn drain(&mut self) -> Vec<Left<T>> {
        let mut ids: Vec<RequestId> = self.order.values().copied().collect();
        ids.extend(self.deferred.iter().map(|&(_, _, id)| id));
        ids.iter().filter_map(|id| self.take(id)).collect()
    }

    /// The next time something changes by itself: a deadline passing or a request ageing.
    pub fn next_timer(&self) -> Option<u64> {
        let deadline = self.deadlines.first().map(|&(d, _, _)| d.saturating_add(1));
        let ages = self
            .not_aged
            .first()
            .map(|&(a, _, _)| a.saturating_add(self.config.age_limit_ms));
        match (deadline, ages) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Admitted requests per class (for the depth gauge); aged ones count in their class.
    pub fn depth_by_class(&self) -> BTreeMap<u8, usize> {
        let mut depth = BTreeMap::new();
        for id in self.order.values() {
            if let Some(e) = self.entries.get(id) {
                *depth.entry(e.ticket.class).or_insert(0) += 1;
            }
        }
        depth
    }
}
