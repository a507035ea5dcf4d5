//! The loops that keep the router's inputs current: the worker watch (etcd → candidates) and
//! the load feed, one loop over one closed [`Feed`] enum: every replica's decisions (this
//! replica's own come back too: applied again, not counted as duplicates), worker
//! load reports, lifecycle events, the NATS connection's events (after a lost connection the
//! predictions made before it are dropped: the gap's lifecycle events are missing), and a tick
//! that expires old predictions.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use kvroute_common::codec::{DecodeError, decode};
use kvroute_common::discovery::WorkerEvent;
use kvroute_common::messages::{Decision, RequestLifecycle, WorkerLoad, now_ms};
use tokio::sync::mpsc;

use super::Router;
use super::load_views::Reported;
use crate::decide::load_view::Applied;

const TICK: Duration = Duration::from_secs(1);

/// Every trigger of the load feed.
enum Feed {
    Decision(async_nats::Message),
    Load(async_nats::Message),
    Lifecycle(async_nats::Message),
    Nats(async_nats::Event),
    Tick,
}

/// Applies worker events until the watch ends.
pub async fn watch_workers(router: Arc<Router>, mut events: mpsc::Receiver<WorkerEvent>) {
    while let Some(event) = events.recv().await {
        if let WorkerEvent::Invalid { reason, .. } = &event {
            router.metrics.bad_cards.inc(reason.label());
        }
        let change = {
            let mut candidates = router.candidates.write().unwrap_or_else(|p| p.into_inner());
            let change = candidates.apply(event);
            router.metrics.workers.set(candidates.len() as i64);
            // Each partition's view: departed workers go, workers without KV events get (or
            // lose) their approximate caches.
            router
                .load
                .set_workers(candidates.cards(), &change.departed);
            change
        };
        if change.loaded {
            tracing::info!("worker snapshot loaded");
            router.loaded.store(true, Ordering::Release);
        }
        for worker_id in &change.departed {
            tracing::info!(
                worker_id,
                "worker departed; its load and bindings are dropped"
            );
        }
        // A worker that joined (or left, failing requests pinned to it) changes what queued
        // requests can get, and the classifiers hear of it.
        router.admission.workers(change.departed, || {
            router
                .candidates
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .partitions()
        });
    }
}

/// Subscribes to decisions, load reports and lifecycle events and applies them until every
/// subscription ends.
pub async fn run_load_feed(
    router: Arc<Router>,
    nats: async_nats::Client,
    mut connection: mpsc::UnboundedReceiver<async_nats::Event>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let names = &router.names;
    let mut decisions = nats.subscribe(names.decisions()).await?;
    let mut loads = nats.subscribe(names.load_all()).await?;
    let mut lifecycle = nats.subscribe(names.lifecycle_all()).await?;
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(TICK);
        let mut disconnected = false;
        loop {
            // Biased: of what is already waiting (a backlog after a stall), decisions go before
            // the lifecycle events that end their requests.
            let feed = tokio::select! {
                biased;
                Some(m) = decisions.next() => Feed::Decision(m),
                Some(m) = loads.next() => Feed::Load(m),
                Some(m) = lifecycle.next() => Feed::Lifecycle(m),
                Some(e) = connection.recv() => Feed::Nats(e),
                _ = tick.tick() => Feed::Tick,
            };
            router.on_feed(feed, &mut disconnected);
        }
    }))
}

impl Router {
    fn bad(&self, input: &str, e: &DecodeError) {
        self.metrics
            .bad_messages
            .inc(&format!("{input}_{}", e.reason()));
    }

    /// `disconnected`: the NATS connection was lost and is not back yet.
    fn on_feed(&self, feed: Feed, disconnected: &mut bool) {
        self.apply_feed(feed, disconnected);
        // Whatever changed the load view may have freed capacity for queued requests.
        self.admission.poke();
    }

    fn apply_feed(&self, feed: Feed, disconnected: &mut bool) {
        let m = &self.metrics;
        match feed {
            Feed::Decision(msg) => match decode::<Decision>(&msg.payload) {
                Ok(d) => {
                    // This replica's own decisions come back on the subject too: the selection
                    // already applied and counted them, so their echo is no duplicate.
                    let own = d.router_id == self.router_id;
                    match self.load.apply_decision(&d, now_ms()) {
                        Applied::Added | Applied::Replaced | Applied::AlreadyCounted => {
                            m.decisions_applied.inc()
                        }
                        Applied::Duplicate | Applied::Superseded if own => {}
                        Applied::Duplicate | Applied::Superseded => m.decisions_duplicate.inc(),
                    }
                }
                Err(e) => self.bad("decision", &e),
            },
            Feed::Nats(async_nats::Event::Disconnected) => *disconnected = true,
            Feed::Nats(async_nats::Event::Connected) => {
                if std::mem::take(disconnected) {
                    // Up to now: what was read from the dead connection was applied after the
                    // loss was noticed (decisions first), and its lifecycle events may be gone.
                    let dropped = self.load.forget_predictions_until(now_ms());
                    m.nats_reconnects.inc();
                    m.predictions_forgotten.add(dropped as u64);
                    tracing::warn!(
                        dropped,
                        "reconnected to NATS; dropped the predictions held until now (their lifecycle events may be missing)"
                    );
                }
            }
            Feed::Nats(_) => {}
            Feed::Load(msg) => match decode::<WorkerLoad>(&msg.payload) {
                Ok(report) => match self.load.apply_report(&report, now_ms()) {
                    Reported::Applied | Reported::Unplaced => m.load_reports.inc(),
                    Reported::Stale => m.load_reports_stale.inc(),
                },
                Err(e) => self.bad("load", &e),
            },
            Feed::Lifecycle(msg) => match decode::<RequestLifecycle>(&msg.payload) {
                Ok(event) => {
                    let now = now_ms();
                    self.load.apply_lifecycle(&event, now);
                    self.admission.lifecycle(&event);
                    m.lifecycle_events.inc();
                }
                Err(e) => self.bad("lifecycle", &e),
            },
            Feed::Tick => {
                let now = now_ms();
                self.admission.tick();
                let totals = self.load.expire(now);
                m.predicted_requests.set(totals.predictions as i64);
                m.approx_ranks.set(totals.approx_ranks as i64);
                m.approx_blocks.set(totals.approx_blocks as i64);
                if let super::overlap::OverlapSource::Local(replica) = &self.overlap {
                    m.local_applied_seq.set(replica.applied_seq() as i64);
                }
                m.ready.set(i64::from(self.is_ready()));
            }
        }
    }
}
