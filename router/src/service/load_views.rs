//! One [`LoadView`] per partition ((model, role)), each under its own lock, so selections of
//! different partitions never wait for each other and a feed message takes only the lock of
//! the partition it concerns.
//!
//! A worker's card names one model and one role, so each rank belongs to one partition, and
//! every message about a request stays in the request's partition: a decision names its
//! model and role; a load report and a lifecycle event go to their worker's partition. What
//! cannot be placed yet is kept as one view would have kept it: a report of a worker whose
//! card has not arrived waits (its latest per rank, up to the prediction age) and is applied
//! when the card comes; a lifecycle event of an unknown worker goes to every view (each
//! ignores a request it does not know, or remembers a `finished` that came before its
//! decision).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use kvroute_common::WorkerId;
use kvroute_common::messages::{Decision, RequestLifecycle, WorkerCard, WorkerLoad};

use super::intake::Clock;
use super::policies::PolicySlot;
use crate::decide::candidates::PartitionKey;
use crate::decide::load_view::{Applied, LoadView, LoadViewConfig, RankView};
use crate::decide::{DecisionState, PartitionPolicy, wire};
use crate::worker::WorkerRank;

/// One partition's view, shared by the selections of the partition and the feeds.
pub(super) type SharedView = Arc<Mutex<LoadView>>;

/// Locks a partition's view (a poisoned lock is taken over: the view's state is kept
/// consistent by each call, which does not panic midway in practice).
pub(super) fn lock(view: &SharedView) -> MutexGuard<'_, LoadView> {
    view.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the view of each partition is, and what cannot be placed in one yet.
#[derive(Debug, Default)]
struct Placement {
    views: HashMap<PartitionKey, SharedView>,
    /// Each registered worker's partition.
    workers: HashMap<WorkerId, PartitionKey>,
    /// The latest report of each rank whose worker has no card yet, and when it came.
    unplaced: HashMap<WorkerRank, (WorkerLoad, u64)>,
}

/// Every partition's load view on this replica.
#[derive(Debug)]
pub(super) struct LoadViews {
    config: LoadViewConfig,
    placement: RwLock<Placement>,
}

/// What a load report came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reported {
    /// Newer than the rank's last: applied.
    Applied,
    /// Not newer than the rank's last.
    Stale,
    /// Its worker has no card yet: kept until the card comes.
    Unplaced,
}

impl LoadViews {
    pub fn new(config: LoadViewConfig) -> Self {
        Self {
            config,
            placement: RwLock::new(Placement::default()),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Placement> {
        self.placement.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Placement> {
        self.placement.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The view of `key`'s partition (made empty the first time).
    pub fn partition(&self, key: &PartitionKey) -> SharedView {
        if let Some(view) = self.read().views.get(key) {
            return view.clone();
        }
        let config = self.config;
        self.write()
            .views
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Mutex::new(LoadView::new(config))))
            .clone()
    }

    fn of_worker(&self, worker_id: WorkerId) -> Option<SharedView> {
        let placement = self.read();
        let key = placement.workers.get(&worker_id)?;
        placement.views.get(key).cloned()
    }

    fn all(&self) -> Vec<SharedView> {
        self.read().views.values().cloned().collect()
    }

    /// The registered workers are now `cards`; `departed` left (or moved to another
    /// partition): their ranks go from the view they were in. Workers without KV events get
    /// (or lose) their approximate caches, and the reports kept for workers that now have a
    /// card are applied.
    pub fn set_workers<'a>(
        &self,
        cards: impl IntoIterator<Item = &'a WorkerCard>,
        departed: &[WorkerId],
    ) {
        let mut placement = self.write();
        for worker_id in departed {
            if let Some(view) = placement
                .workers
                .get(worker_id)
                .and_then(|key| placement.views.get(key))
            {
                lock(view).remove_worker(*worker_id);
            }
        }
        let mut by_partition: HashMap<PartitionKey, Vec<&WorkerCard>> = HashMap::new();
        for card in cards {
            by_partition
                .entry((card.model.clone(), card.role))
                .or_default()
                .push(card);
        }
        placement.workers = by_partition
            .iter()
            .flat_map(|(key, cards)| cards.iter().map(|c| (c.worker_id, key.clone())))
            .collect();
        let config = self.config;
        for key in by_partition.keys() {
            placement
                .views
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Mutex::new(LoadView::new(config))));
        }
        let Placement {
            views,
            workers,
            unplaced,
        } = &mut *placement;
        for (key, view) in views.iter() {
            let cards = by_partition.get(key).map(Vec::as_slice).unwrap_or_default();
            lock(view).set_workers(cards.iter().copied());
        }
        unplaced.retain(|rank, (report, at_ms)| {
            let Some(view) = workers.get(&rank.worker_id).and_then(|k| views.get(k)) else {
                return true;
            };
            lock(view).apply_report(report, *at_ms);
            false
        });
    }

    /// Applies a decision (any replica's) to its partition's view; a paired decision's decode
    /// hop to the decode partition's view too (what it did there is not reported: the prefill
    /// half's outcome counts the decision).
    pub fn apply_decision(&self, d: &Decision, now_ms: u64) -> Applied {
        if let Some(decode) = wire::decode_half(d) {
            let view = self.partition(&(decode.model.clone(), decode.role));
            lock(&view).apply_decision(&decode, now_ms);
        }
        let view = self.partition(&(d.model.clone(), d.role));
        lock(&view).apply_decision(d, now_ms)
    }

    /// Completes this replica's decision `d` with its decode hop in its partition's view (see
    /// [`LoadView::attach_decode`]).
    pub fn attach_decode(&self, d: &Decision) {
        let view = self.partition(&(d.model.clone(), d.role));
        lock(&view).attach_decode(d);
    }

    /// Applies a worker's load report to its partition's view, or keeps it until the worker's
    /// card comes.
    pub fn apply_report(&self, report: &WorkerLoad, now_ms: u64) -> Reported {
        if let Some(view) = self.of_worker(report.worker_id) {
            return match lock(&view).apply_report(report, now_ms) {
                true => Reported::Applied,
                false => Reported::Stale,
            };
        }
        let rank = WorkerRank::new(report.worker_id, report.dp_rank);
        let mut placement = self.write();
        let newer = placement
            .unplaced
            .get(&rank)
            .is_none_or(|(last, _)| report.seq == 0 || report.seq > last.seq);
        if !newer {
            return Reported::Stale;
        }
        placement.unplaced.insert(rank, (report.clone(), now_ms));
        Reported::Unplaced
    }

    /// Applies a lifecycle event to its worker's partition's view (to every view when the
    /// worker is unknown).
    pub fn apply_lifecycle(&self, event: &RequestLifecycle, now_ms: u64) {
        match self.of_worker(event.worker_id) {
            Some(view) => lock(&view).apply_lifecycle(event, now_ms),
            None => {
                for view in self.all() {
                    lock(&view).apply_lifecycle(event, now_ms);
                }
            }
        }
    }

    /// Withdraws a decision of this replica's that will not be used (see
    /// [`LoadView::withdraw`]).
    pub fn withdraw(&self, d: &Decision) -> bool {
        if let Some(decode) = wire::decode_half(d) {
            let view = self.partition(&(decode.model.clone(), decode.role));
            lock(&view).withdraw(&decode);
        }
        let view = self.partition(&(d.model.clone(), d.role));
        lock(&view).withdraw(d)
    }

    /// [`LoadView::forget_predictions_until`] in every view; how many were dropped.
    pub fn forget_predictions_until(&self, cutoff_ms: u64) -> usize {
        self.all()
            .iter()
            .map(|v| lock(v).forget_predictions_until(cutoff_ms))
            .sum()
    }

    /// [`LoadView::expire`] in every view, and reports kept longer than the prediction age
    /// for workers that never registered are dropped. Returns the totals for the gauges.
    pub fn expire(&self, now_ms: u64) -> Totals {
        let cutoff = now_ms.saturating_sub(self.config.prediction_max_age_ms);
        self.write().unplaced.retain(|_, (_, at)| *at > cutoff);
        let mut totals = Totals::default();
        for view in self.all() {
            let mut view = lock(&view);
            view.expire(now_ms);
            totals.predictions += view.predictions();
            totals.approx_ranks += view.approx().ranks();
            totals.approx_blocks += view.approx().total_blocks();
        }
        totals
    }

    /// Every rank any view holds anything of, in rank order.
    pub fn ranks(&self, now_ms: u64) -> Vec<RankView> {
        let mut ranks: Vec<RankView> = self
            .all()
            .iter()
            .flat_map(|v| lock(v).ranks(now_ms))
            .collect();
        ranks.sort_by_key(|r| r.rank);
        ranks
    }
}

/// What every view holds, summed (the gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Totals {
    pub predictions: usize,
    pub approx_ranks: usize,
    pub approx_blocks: u64,
}

/// The service's decision state: a partition's policy slot and the replica's load view, locked
/// in that order for one decision.
pub(super) struct Locked<'a> {
    pub slot: &'a PolicySlot,
    pub view: SharedView,
    pub clock: Clock,
}

impl DecisionState for Locked<'_> {
    fn with<R>(&mut self, f: impl FnOnce(&mut PartitionPolicy, &mut LoadView, u64) -> R) -> R {
        let mut policy = self.slot.lock();
        let mut view = lock(&self.view);
        f(&mut policy, &mut view, self.clock.now_ms())
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::{LifecycleKind, SchemaVersion, WorkerRole};
    use uuid::Uuid;

    use super::*;

    fn card(worker_id: WorkerId, model: &str, role: WorkerRole) -> WorkerCard {
        WorkerCard {
            model: model.into(),
            role,
            ..crate::testing::card(worker_id)
        }
    }

    fn report(worker_id: WorkerId, seq: u64, tokens: u64) -> WorkerLoad {
        WorkerLoad {
            v: SchemaVersion::CURRENT,
            worker_id,
            dp_rank: 0,
            seq,
            active_prefill_tokens: tokens,
            active_decode_blocks: 0,
            active_requests: 0,
            waiting_requests: 0,
            kv_used_blocks: 0,
            total_kv_blocks: 0,
            ts: 0,
            new_requests: None,
            adapters: None,
        }
    }

    fn decision(worker_id: WorkerId, model: &str, role: WorkerRole) -> Decision {
        Decision {
            model: model.into(),
            role,
            ..crate::testing::decision(worker_id, Uuid::new_v4(), 4, 100)
        }
    }

    fn load_of(views: &LoadViews, key: &PartitionKey, worker_id: WorkerId) -> Option<u64> {
        lock(&views.partition(key))
            .load(WorkerRank::new(worker_id, 0), 10)
            .map(|l| l.active_prefill_tokens)
    }

    #[test]
    fn each_message_reaches_its_partitions_view_only() {
        let views = LoadViews::new(crate::testing::view_config());
        let a = ("m".to_owned(), WorkerRole::Prefill);
        let b = ("m".to_owned(), WorkerRole::Decode);
        let cards = [
            card(1, "m", WorkerRole::Prefill),
            card(2, "m", WorkerRole::Decode),
        ];
        views.set_workers(&cards, &[]);
        assert_eq!(views.apply_report(&report(1, 1, 7), 1), Reported::Applied);
        assert_eq!(load_of(&views, &a, 1), Some(7));
        assert_eq!(load_of(&views, &b, 1), None);
        let d = decision(2, "m", WorkerRole::Decode);
        assert_eq!(views.apply_decision(&d, 2), Applied::Added);
        assert_eq!(lock(&views.partition(&b)).predictions(), 1);
        assert_eq!(lock(&views.partition(&a)).predictions(), 0);
        let finished = RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id: d.request_id,
            worker_id: 2,
            dp_rank: 0,
            kind: LifecycleKind::Finished { output_tokens: 1 },
            ts: 0,
        };
        views.apply_lifecycle(&finished, 3);
        assert_eq!(views.expire(4).predictions, 0);
    }

    #[test]
    fn a_paired_decision_charges_both_partitions_once_and_is_withdrawn_from_both() {
        let views = LoadViews::new(crate::testing::view_config());
        let prefill = ("m".to_owned(), WorkerRole::Prefill);
        let decode = ("m".to_owned(), WorkerRole::Decode);
        let cards = [
            card(1, "m", WorkerRole::Prefill),
            card(2, "m", WorkerRole::Decode),
        ];
        views.set_workers(&cards, &[]);
        let mut d = decision(1, "m", WorkerRole::Prefill);
        d.decode = Some(kvroute_common::messages::DecodeHop {
            decision_id: Uuid::new_v4(),
            worker_id: 2,
            dp_rank: 0,
            request_subject: "w.2".into(),
            cost: Default::default(),
            policy: "least-busy".into(),
            bootstrap_room: 5,
        });
        assert_eq!(views.apply_decision(&d, 1), Applied::Added);
        // Another replica's echo of the same pair changes nothing.
        assert_eq!(views.apply_decision(&d, 2), Applied::Duplicate);
        let charged = |key: &PartitionKey, worker| {
            lock(&views.partition(key))
                .load(WorkerRank::new(worker, 0), 3)
                .map(|l| (l.active_prefill_tokens, l.active_decode_blocks))
        };
        // The prefill worker prefills; the decode worker holds the blocks, prefilling nothing.
        assert_eq!(charged(&prefill, 1), Some((100, 4)));
        assert_eq!(charged(&decode, 2), Some((0, 4)));
        assert_eq!(views.expire(4).predictions, 2);
        // A retry in the decode partition is answered with the hop's decision.
        let hop = lock(&views.partition(&decode))
            .decided(&d.request_id)
            .map(|k| k.decision_id);
        assert_eq!(hop, d.decode.as_ref().map(|h| h.decision_id));
        assert!(views.withdraw(&d));
        assert_eq!(views.expire(5).predictions, 0);
    }

    #[test]
    fn a_report_before_its_workers_card_is_applied_when_the_card_comes() {
        let views = LoadViews::new(crate::testing::view_config());
        let key = ("m".to_owned(), WorkerRole::Prefill);
        assert_eq!(views.apply_report(&report(5, 3, 11), 1), Reported::Unplaced);
        assert_eq!(views.apply_report(&report(5, 2, 99), 2), Reported::Stale);
        views.set_workers(&[card(5, "m", WorkerRole::Prefill)], &[]);
        assert_eq!(load_of(&views, &key, 5), Some(11));
        // Once placed, the same sequence number is stale in the view itself.
        assert_eq!(views.apply_report(&report(5, 3, 12), 4), Reported::Stale);
    }

    #[test]
    fn unplaced_reports_go_after_the_prediction_age() {
        let views = LoadViews::new(crate::testing::view_config());
        views.apply_report(&report(5, 1, 11), 1);
        views.expire(60_002);
        views.set_workers(&[card(5, "m", WorkerRole::Prefill)], &[]);
        assert_eq!(
            load_of(&views, &("m".to_owned(), WorkerRole::Prefill), 5),
            None
        );
    }

    #[test]
    fn a_departed_worker_leaves_the_view_it_was_in() {
        let views = LoadViews::new(crate::testing::view_config());
        let key = ("m".to_owned(), WorkerRole::Prefill);
        views.set_workers(&[card(1, "m", WorkerRole::Prefill)], &[]);
        views.apply_report(&report(1, 1, 7), 1);
        // It moved to another model: gone from the old view, placed in the new one.
        views.set_workers(&[card(1, "n", WorkerRole::Prefill)], &[1]);
        assert_eq!(load_of(&views, &key, 1), None);
        assert_eq!(views.apply_report(&report(1, 2, 9), 3), Reported::Applied);
        assert_eq!(
            load_of(&views, &("n".to_owned(), WorkerRole::Prefill), 1),
            Some(9)
        );
        assert_eq!(views.ranks(4).len(), 1);
    }
}
