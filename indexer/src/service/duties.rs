//! The snapshot leader's duties as a pure state machine: given the lease the campaign holds,
//! worker-set changes, the applied sequence and `now`, it decides which actions to take
//! (append a removal record, ask a worker to resync, write a snapshot) and when this replica
//! starts or stops acting as leader. The service loop only executes the [`Action`]s; nothing
//! here reads a clock or touches the network.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use kvroute_common::ids::WorkerId;
use tokio::time::Instant;

/// Leadership as the campaign last reported it: the term (the leader key's create
/// revision) and until when the lease may be trusted ([`kvroute_common::lease::LeaseFence`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaderLease {
    pub term: u64,
    pub valid_until: Instant,
}

/// The duties' settings (from [`crate::config::IndexerConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DutiesConfig {
    /// A worker with events but no registration for this long is removed.
    pub unregistered_grace: Duration,
    /// At most one resync request per worker per interval.
    pub resync_interval: Duration,
    /// Snapshot after this many applied messages (0: never by count).
    pub snapshot_every_messages: u64,
    /// Snapshot when the last one is this old (`None`: never by time).
    pub snapshot_interval: Option<Duration>,
}

/// At most one resync request per worker per interval.
const RESYNC_REQUEST_INTERVAL: Duration = Duration::from_secs(3);

impl DutiesConfig {
    /// The duties' settings from the process's flags.
    pub fn from_flags(config: &crate::config::IndexerConfig) -> Self {
        Self {
            unregistered_grace: Duration::from_secs(config.unregistered_grace_secs),
            resync_interval: RESYNC_REQUEST_INTERVAL,
            snapshot_every_messages: config.snapshot_every_messages,
            snapshot_interval: (config.snapshot_interval_secs > 0)
                .then(|| Duration::from_secs(config.snapshot_interval_secs)),
        }
    }
}

/// Why this replica stopped acting as leader (the `reason` of the step-down log line and
/// metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepDown {
    /// No keep-alive was acknowledged in time: the lease may be about to expire on the server.
    LeaseDeadline,
    /// The campaign lost the lease (or another term replaced it).
    LeaseLost,
    /// The process is shutting down and resigns.
    Shutdown,
}

impl StepDown {
    pub const ALL: [StepDown; 3] = [
        StepDown::LeaseDeadline,
        StepDown::LeaseLost,
        StepDown::Shutdown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StepDown::LeaseDeadline => "lease_deadline",
            StepDown::LeaseLost => "lease_lost",
            StepDown::Shutdown => "shutdown",
        }
    }
}

/// What the service must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    BecameLeader {
        term: u64,
    },
    SteppedDown {
        term: u64,
        reason: StepDown,
    },
    /// Append `WorkerRemoved` for `worker_id` with JetStream message id `msg_id`.
    AppendRemoval {
        worker_id: WorkerId,
        msg_id: String,
        term: u64,
    },
    RequestResync {
        worker_id: WorkerId,
    },
    /// Write a snapshot of the state as of applied sequence `seq`.
    WriteSnapshot {
        seq: u64,
        term: u64,
    },
}

/// What a tick needs to know about the replica.
#[derive(Debug, Clone, Copy)]
pub struct TickInput<'a> {
    pub ready: bool,
    pub applied_seq: u64,
    /// Registered workers, once the worker watch delivered its first snapshot.
    pub registered: Option<&'a HashSet<WorkerId>>,
    /// Workers with events in the state and not removed.
    pub live: &'a BTreeSet<WorkerId>,
}

/// The leader's bookkeeping (kept by every replica; it acts only while leading).
#[derive(Debug)]
pub struct LeaderDuties {
    config: DutiesConfig,
    lease: Option<LeaderLease>,
    /// The term this replica currently acts in.
    acting: Option<u64>,
    unregistered_since: HashMap<WorkerId, Instant>,
    removal_sent: HashMap<WorkerId, Instant>,
    resync_sent: HashMap<WorkerId, Instant>,
    since_snapshot: u64,
    last_snapshot: Option<(u64, Instant)>,
    snapshot_in_flight: bool,
}

impl LeaderDuties {
    pub fn new(config: DutiesConfig) -> Self {
        Self {
            config,
            lease: None,
            acting: None,
            unregistered_since: HashMap::new(),
            removal_sent: HashMap::new(),
            resync_sent: HashMap::new(),
            since_snapshot: 0,
            last_snapshot: None,
            snapshot_in_flight: false,
        }
    }

    /// The term this replica acts in as of `now`, if it leads: it holds a lease whose
    /// deadline has not passed. Every leader action is taken only under this check.
    pub fn leading(&self, now: Instant) -> Option<u64> {
        let lease = self.lease?;
        (self.acting == Some(lease.term) && now < lease.valid_until).then_some(lease.term)
    }

    /// The campaign's latest report (`None`: not holding the leader key).
    pub fn on_lease(&mut self, lease: Option<LeaderLease>, now: Instant) -> Vec<Action> {
        let previous = std::mem::replace(&mut self.lease, lease);
        self.transitions(now, previous)
    }

    /// Stops acting as leader for good (shutdown).
    pub fn resign(&mut self) -> Vec<Action> {
        self.lease = None;
        match self.acting.take() {
            Some(term) => vec![Action::SteppedDown {
                term,
                reason: StepDown::Shutdown,
            }],
            None => Vec::new(),
        }
    }

    /// Starts or stops acting as leader according to the lease and `now`; `previous` is the
    /// lease before the latest report (a deadline that passed before the campaign gave up is
    /// still a deadline step-down).
    fn transitions(&mut self, now: Instant, previous: Option<LeaderLease>) -> Vec<Action> {
        let mut out = Vec::new();
        let valid = self.lease.filter(|l| now < l.valid_until);
        if let Some(term) = self.acting
            && valid.is_none_or(|l| l.term != term)
        {
            let expired =
                |l: Option<LeaderLease>| l.is_some_and(|l| l.term == term && now >= l.valid_until);
            let reason = if expired(self.lease) || expired(previous) {
                StepDown::LeaseDeadline
            } else {
                StepDown::LeaseLost
            };
            out.push(Action::SteppedDown { term, reason });
            self.acting = None;
            // A term's bookkeeping ends with it (and stays bounded while following).
            self.unregistered_since.clear();
            self.removal_sent.clear();
            self.resync_sent.clear();
        }
        if let (None, Some(lease)) = (self.acting, valid) {
            // A new term starts from a clean slate: grace periods count from now.
            self.unregistered_since.clear();
            self.acting = Some(lease.term);
            out.push(Action::BecameLeader { term: lease.term });
        }
        out
    }

    /// `messages` more log messages were applied.
    pub fn on_applied(&mut self, messages: u64) {
        self.since_snapshot += messages;
    }

    /// A bootstrap restored the snapshot at `seq` (or started empty: `None`).
    pub fn on_bootstrap(&mut self, snapshot_seq: Option<u64>, now: Instant) {
        self.since_snapshot = 0;
        if let Some(seq) = snapshot_seq {
            self.last_snapshot = Some((seq, now));
        }
    }

    /// The snapshot started by [`Action::WriteSnapshot`] finished (written or failed).
    pub fn on_snapshot_done(&mut self) {
        self.snapshot_in_flight = false;
    }

    /// Age of the newest snapshot written or loaded.
    pub fn snapshot_age(&self, now: Instant) -> Option<Duration> {
        self.last_snapshot.map(|(_, at)| now.duration_since(at))
    }

    /// A worker's card was deleted (at etcd `revision`): the leader appends its removal.
    pub fn on_worker_deleted(
        &mut self,
        worker_id: WorkerId,
        revision: i64,
        now: Instant,
    ) -> Option<Action> {
        let term = self.leading(now)?;
        self.removal_sent.insert(worker_id, now);
        Some(Action::AppendRemoval {
            worker_id,
            msg_id: format!("removed-{worker_id}-rev{revision}"),
            term,
        })
    }

    /// The state of `worker_id` is incomplete (a gap or a refused event). Only a leader that
    /// has caught up asks (gaps met while catching up were handled back then), at most once
    /// per resync interval per worker.
    pub fn on_needs_resync(
        &mut self,
        worker_id: WorkerId,
        ready: bool,
        now: Instant,
    ) -> Option<Action> {
        self.leading(now)?;
        if !ready
            || self
                .resync_sent
                .get(&worker_id)
                .is_some_and(|t| now.duration_since(*t) < self.config.resync_interval)
        {
            return None;
        }
        self.resync_sent.insert(worker_id, now);
        Some(Action::RequestResync { worker_id })
    }

    /// The periodic duties: leadership transitions, then (leading and ready) a snapshot when
    /// due and removals of workers unregistered past the grace period.
    pub fn tick(&mut self, now: Instant, input: TickInput<'_>) -> Vec<Action> {
        let mut out = self.transitions(now, self.lease);
        let Some(term) = self.leading(now) else {
            return out;
        };
        if !input.ready {
            return out;
        }
        out.extend(self.maybe_snapshot(now, term, input.applied_seq));
        if let Some(registered) = input.registered {
            out.extend(self.reconcile_unregistered(now, term, &input, registered));
        }
        out
    }

    fn maybe_snapshot(&mut self, now: Instant, term: u64, seq: u64) -> Option<Action> {
        if self.snapshot_in_flight || seq == 0 || self.last_snapshot.is_some_and(|(s, _)| s >= seq)
        {
            return None;
        }
        let every = self.config.snapshot_every_messages;
        let by_count = every > 0 && self.since_snapshot >= every;
        let by_time = self.config.snapshot_interval.is_some_and(|interval| {
            self.last_snapshot
                .is_none_or(|(_, at)| now.duration_since(at) >= interval)
        });
        if !(by_count || by_time) {
            return None;
        }
        self.since_snapshot = 0;
        self.last_snapshot = Some((seq, now));
        self.snapshot_in_flight = true;
        Some(Action::WriteSnapshot { seq, term })
    }

    /// Removes workers that have events in the log but no registration for longer than the
    /// grace period (crashed before the leader saw their delete, or never registered), at most
    /// once per grace period each.
    fn reconcile_unregistered(
        &mut self,
        now: Instant,
        term: u64,
        input: &TickInput<'_>,
        registered: &HashSet<WorkerId>,
    ) -> Vec<Action> {
        let grace = self.config.unregistered_grace;
        let live = input.live;
        self.unregistered_since
            .retain(|w, _| live.contains(w) && !registered.contains(w));
        self.removal_sent
            .retain(|_, at| now.duration_since(*at) < grace);
        self.resync_sent
            .retain(|_, at| now.duration_since(*at) < self.config.resync_interval);
        let mut out = Vec::new();
        for &w in live.iter().filter(|w| !registered.contains(w)) {
            let since = *self.unregistered_since.entry(w).or_insert(now);
            if now.duration_since(since) >= grace && !self.removal_sent.contains_key(&w) {
                self.removal_sent.insert(w, now);
                out.push(Action::AppendRemoval {
                    worker_id: w,
                    msg_id: format!("removed-{w}-unregistered-{}", input.applied_seq),
                    term,
                });
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "the tests pick their own now; the duties never read one"
)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn config() -> DutiesConfig {
        DutiesConfig {
            unregistered_grace: 15 * SECOND,
            resync_interval: 3 * SECOND,
            snapshot_every_messages: 1000,
            snapshot_interval: Some(30 * SECOND),
        }
    }

    /// [`config`] without snapshots, for the tests of the other duties.
    fn no_snapshots() -> DutiesConfig {
        DutiesConfig {
            snapshot_every_messages: 0,
            snapshot_interval: None,
            ..config()
        }
    }

    fn lease(term: u64, now: Instant) -> Option<LeaderLease> {
        Some(LeaderLease {
            term,
            valid_until: now + SECOND,
        })
    }

    fn tick(d: &mut LeaderDuties, ready: bool, seq: u64, live: &[WorkerId]) -> Vec<Action> {
        let registered: HashSet<WorkerId> = [1].into_iter().collect();
        let live: BTreeSet<WorkerId> = live.iter().copied().collect();
        d.tick(
            Instant::now(),
            TickInput {
                ready,
                applied_seq: seq,
                registered: Some(&registered),
                live: &live,
            },
        )
    }

    fn step(by: Duration) -> impl std::future::Future<Output = ()> {
        tokio::time::advance(by)
    }

    #[tokio::test(start_paused = true)]
    async fn steps_down_when_the_lease_deadline_passes_without_a_keep_alive() {
        let mut d = LeaderDuties::new(config());
        let t0 = Instant::now();
        assert_eq!(
            d.on_lease(lease(7, t0), t0),
            vec![Action::BecameLeader { term: 7 }]
        );
        assert_eq!(d.leading(t0), Some(7));
        // Keep-alives acknowledged: the deadline moves, leadership holds.
        step(SECOND / 2).await;
        d.on_lease(lease(7, Instant::now()), Instant::now());
        step(SECOND / 2 + SECOND / 4).await;
        assert!(tick(&mut d, true, 0, &[]).is_empty());
        assert_eq!(d.leading(Instant::now()), Some(7));
        // etcd stops answering: no action at or after the deadline, whether or not the
        // campaign has noticed, and the step-down is reported once.
        step(SECOND / 4).await;
        assert_eq!(d.leading(Instant::now()), None);
        assert_eq!(d.on_worker_deleted(5, 10, Instant::now()), None);
        assert_eq!(
            tick(&mut d, true, 0, &[]),
            vec![Action::SteppedDown {
                term: 7,
                reason: StepDown::LeaseDeadline
            }]
        );
        assert!(tick(&mut d, true, 0, &[]).is_empty());
        // The campaign gives up and wins again later: a new term.
        assert!(d.on_lease(None, Instant::now()).is_empty());
        renew(&mut d, 8);
        step(2 * SECOND).await;
        assert_eq!(
            d.on_lease(None, Instant::now()),
            vec![Action::SteppedDown {
                term: 8,
                reason: StepDown::LeaseDeadline
            }],
            "the deadline passed before the campaign noticed"
        );
        step(3 * SECOND).await;
        assert_eq!(
            d.on_lease(lease(9, Instant::now()), Instant::now()),
            vec![Action::BecameLeader { term: 9 }]
        );
        assert_eq!(
            d.on_lease(lease(11, Instant::now()), Instant::now()),
            vec![
                Action::SteppedDown {
                    term: 9,
                    reason: StepDown::LeaseLost
                },
                Action::BecameLeader { term: 11 }
            ]
        );
        // The campaign gives up before the deadline (an error, an unanswered keep-alive).
        assert_eq!(
            d.on_lease(None, Instant::now()),
            vec![Action::SteppedDown {
                term: 11,
                reason: StepDown::LeaseLost
            }]
        );
        renew(&mut d, 12);
        assert_eq!(
            d.resign(),
            vec![Action::SteppedDown {
                term: 12,
                reason: StepDown::Shutdown
            }]
        );
        assert_eq!(d.leading(Instant::now()), None);
    }

    /// Keeps the lease fresh, as an acknowledged keep-alive would.
    fn renew(d: &mut LeaderDuties, term: u64) {
        d.on_lease(lease(term, Instant::now()), Instant::now());
    }

    #[tokio::test(start_paused = true)]
    async fn removes_an_unregistered_worker_after_the_grace_period_once() {
        let mut d = LeaderDuties::new(no_snapshots());
        renew(&mut d, 3);
        // Worker 1 is registered, worker 2 has events but no card.
        assert!(tick(&mut d, true, 40, &[1, 2]).is_empty());
        for _ in 0..14 {
            step(SECOND).await;
            renew(&mut d, 3);
            let actions = tick(&mut d, true, 40, &[1, 2]);
            assert!(
                !actions
                    .iter()
                    .any(|a| matches!(a, Action::AppendRemoval { .. })),
                "{actions:?}"
            );
        }
        step(SECOND).await;
        renew(&mut d, 3);
        let removal = Action::AppendRemoval {
            worker_id: 2,
            msg_id: "removed-2-unregistered-40".into(),
            term: 3,
        };
        assert_eq!(tick(&mut d, true, 40, &[1, 2]), vec![removal.clone()]);
        // Not re-sent while the record is on its way; re-sent after another grace period.
        step(SECOND).await;
        renew(&mut d, 3);
        assert!(tick(&mut d, true, 40, &[1, 2]).is_empty());
        step(14 * SECOND).await;
        renew(&mut d, 3);
        assert_eq!(tick(&mut d, true, 40, &[1, 2]), vec![removal]);
        // Once applied (no longer live) nothing more; a follower never removes.
        step(SECOND).await;
        renew(&mut d, 3);
        assert!(tick(&mut d, true, 41, &[1]).is_empty());
        let mut follower = LeaderDuties::new(no_snapshots());
        step(60 * SECOND).await;
        assert!(tick(&mut follower, true, 41, &[1, 2]).is_empty());
        assert_eq!(follower.on_worker_deleted(2, 5, Instant::now()), None);
        renew(&mut d, 3);
        // A deleted card: removed at once, by revision.
        assert_eq!(
            d.on_worker_deleted(1, 77, Instant::now()),
            Some(Action::AppendRemoval {
                worker_id: 1,
                msg_id: "removed-1-rev77".into(),
                term: 3
            })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn grace_counts_from_the_start_of_a_term() {
        let mut d = LeaderDuties::new(no_snapshots());
        renew(&mut d, 3);
        tick(&mut d, true, 1, &[2]);
        step(10 * SECOND).await;
        // Another term begins (lost and won again): the 10 s seen do not count.
        d.on_lease(None, Instant::now());
        renew(&mut d, 4);
        tick(&mut d, true, 1, &[2]);
        step(10 * SECOND).await;
        renew(&mut d, 4);
        assert!(tick(&mut d, true, 1, &[2]).is_empty());
        step(5 * SECOND).await;
        renew(&mut d, 4);
        assert_eq!(tick(&mut d, true, 1, &[2]).len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn resync_requests_are_spaced_per_worker_and_only_from_a_ready_leader() {
        let mut d = LeaderDuties::new(config());
        let now = Instant::now();
        assert_eq!(d.on_needs_resync(4, true, now), None, "not leading");
        renew(&mut d, 1);
        assert_eq!(
            d.on_needs_resync(4, false, Instant::now()),
            None,
            "not ready"
        );
        let ask = Some(Action::RequestResync { worker_id: 4 });
        assert_eq!(d.on_needs_resync(4, true, Instant::now()), ask);
        assert_eq!(d.on_needs_resync(4, true, Instant::now()), None);
        assert_eq!(
            d.on_needs_resync(5, true, Instant::now()),
            Some(Action::RequestResync { worker_id: 5 })
        );
        step(3 * SECOND - Duration::from_millis(1)).await;
        renew(&mut d, 1);
        assert_eq!(d.on_needs_resync(4, true, Instant::now()), None);
        step(Duration::from_millis(1)).await;
        assert_eq!(d.on_needs_resync(4, true, Instant::now()), ask);
    }

    #[tokio::test(start_paused = true)]
    async fn snapshots_by_count_and_by_time_one_at_a_time() {
        let mut d = LeaderDuties::new(DutiesConfig {
            snapshot_every_messages: 100,
            ..config()
        });
        renew(&mut d, 2);
        // None yet: the first is due at once (by time), once ready and with something applied.
        assert!(tick(&mut d, false, 5, &[]).is_empty());
        assert!(tick(&mut d, true, 0, &[]).is_empty());
        let snap = |seq| vec![Action::WriteSnapshot { seq, term: 2 }];
        assert_eq!(tick(&mut d, true, 5, &[]), snap(5));
        // One in flight at a time.
        d.on_applied(500);
        assert!(tick(&mut d, true, 505, &[]).is_empty());
        d.on_snapshot_done();
        assert_eq!(tick(&mut d, true, 505, &[]), snap(505));
        d.on_snapshot_done();
        // By count: 99 messages are not enough, 100 are.
        d.on_applied(99);
        assert!(tick(&mut d, true, 604, &[]).is_empty());
        d.on_applied(1);
        assert_eq!(tick(&mut d, true, 605, &[]), snap(605));
        d.on_snapshot_done();
        // By time: 30 s after the last one, if the log moved.
        step(29 * SECOND).await;
        renew(&mut d, 2);
        d.on_applied(1);
        assert!(tick(&mut d, true, 606, &[]).is_empty());
        step(SECOND).await;
        renew(&mut d, 2);
        assert_eq!(tick(&mut d, true, 606, &[]), snap(606));
        d.on_snapshot_done();
        step(60 * SECOND).await;
        renew(&mut d, 2);
        assert!(
            tick(&mut d, true, 606, &[]).is_empty(),
            "nothing new to snapshot"
        );
        assert_eq!(d.snapshot_age(Instant::now()), Some(60 * SECOND));
        // A loaded snapshot counts as the last one.
        d.on_bootstrap(Some(900), Instant::now());
        assert!(tick(&mut d, true, 900, &[]).is_empty());
    }
}
