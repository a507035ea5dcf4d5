//! The router's metrics, rendered on `/metrics` (the list is in ARCHITECTURE.md).

use std::sync::Arc;

use kvroute_common::ops::{
    Counter, CounterVec, Family, Gauge, Histogram, Registry, WatchdogMetrics,
};

/// Every series the router exports.
#[derive(Debug)]
pub struct RouterMetrics {
    pub registry: Registry,
    /// From receiving a request to publishing its reply (ok or error).
    pub selection_latency: Arc<Histogram>,
    /// Remote query round trips and local lookups.
    pub overlap_latency: Arc<Histogram>,
    /// Decisions made by this replica, by `<worker>/<rank>`.
    pub decisions: Arc<CounterVec>,
    /// Error replies by code.
    pub errors: Arc<CounterVec>,
    /// Device overlap blocks and prompt blocks of the decisions (ratio = overlap / request).
    pub overlap_blocks: Arc<Counter>,
    pub request_blocks: Arc<Counter>,
    /// Selections scored on load alone because overlap was unavailable, by reason.
    pub overlap_fallbacks: Arc<CounterVec>,
    /// Session outcomes: `new`, `kept` (a hit), `rebound`, `released`.
    pub sessions: Arc<CounterVec>,
    /// Decisions applied to the load view (all replicas'), and duplicates skipped (another
    /// replica's decision seen again or superseded; this replica's own echo is not one).
    pub decisions_applied: Arc<Counter>,
    pub decisions_duplicate: Arc<Counter>,
    /// Load reports taken, and stale ones dropped.
    pub load_reports: Arc<Counter>,
    pub load_reports_stale: Arc<Counter>,
    pub lifecycle_events: Arc<Counter>,
    /// Undecodable messages on the inputs, by `<input>_<reason>`.
    /// Worker cards in etcd skipped, by reason.
    pub bad_cards: Arc<CounterVec>,
    pub bad_messages: Arc<CounterVec>,
    pub predicted_requests: Arc<Gauge>,
    /// Requests dropped past their deadline, by stage (`intake`, `queued`).
    pub expired: Arc<CounterVec>,
    /// Requests received with `attempt` > 0 (client retries).
    pub retries_received: Arc<Counter>,
    /// Requests answered with the decision their id already had.
    pub repeated: Arc<Counter>,
    /// Requests forwarded to their partition's owner, by outcome (`answered`,
    /// `no_responders`, `timeout`, `error`: the last three were decided here instead).
    pub forwards: Arc<CounterVec>,
    /// Remote overlap query attempts beyond the first.
    pub overlap_retries: Arc<Counter>,
    /// 1 while the replica is in the select queue group.
    pub serving: Arc<Gauge>,
    /// 1 while the watchdog finds the replica behind.
    pub lagging: Arc<Gauge>,
    /// The watchdog's last measure: timer lateness or oldest selection in flight.
    pub lag_ms: Arc<Gauge>,
    /// Times the replica left the select queue group, by reason (`lagging`, `not_ready`).
    pub group_leaves: Arc<CounterVec>,
    /// NATS reconnections, and the predictions dropped after them.
    pub nats_reconnects: Arc<Counter>,
    pub predictions_forgotten: Arc<Counter>,
    pub workers: Arc<Gauge>,
    pub ready: Arc<Gauge>,
    /// Local mode: the embedded replica's applied log sequence.
    pub local_applied_seq: Arc<Gauge>,
    /// Admission queue, by `model`, `role` (and `class`): requests waiting now, requests that
    /// joined, refused because the queue was full, served from it, refused from it (another
    /// error than busy workers, e.g. the pinned worker left), timed out in it, their wait
    /// when served, and requests handed to a partition's new owner.
    pub queue_depth: Arc<Family<Gauge>>,
    /// Requests their classifier holds back, by `model`, `role`.
    pub queue_deferred: Arc<Family<Gauge>>,
    /// Requests the request classifier follows (admitted, not completed).
    pub classifier_tracked: Arc<Gauge>,
    pub queue_joined: Arc<Family<Counter>>,
    pub queue_full: Arc<Family<Counter>>,
    pub queue_dispatched: Arc<Family<Counter>>,
    pub queue_refused: Arc<Family<Counter>>,
    pub queue_timeouts: Arc<Family<Counter>>,
    pub queue_wait: Arc<Family<Histogram>>,
    pub queue_handed_over: Arc<Counter>,
}

impl RouterMetrics {
    pub fn new() -> Self {
        let r = Registry::default();
        Self {
            selection_latency: r.histogram(
                "kvroute_router_selection_latency_seconds",
                "Time from receiving a select request to publishing its reply.",
            ),
            overlap_latency: r.histogram(
                "kvroute_router_overlap_latency_seconds",
                "Time to get a prompt's overlap (remote query or local lookup).",
            ),
            decisions: r.counter_vec(
                "kvroute_router_decisions_total",
                "Selections made by this replica, per worker rank.",
                "worker",
            ),
            errors: r.counter_vec(
                "kvroute_router_errors_total",
                "Error replies, per error code.",
                "code",
            ),
            overlap_blocks: r.counter(
                "kvroute_router_overlap_blocks_total",
                "Device blocks the chosen worker already held (overlap ratio = this / request blocks).",
            ),
            request_blocks: r.counter(
                "kvroute_router_request_blocks_total",
                "Full prompt blocks of the selections.",
            ),
            overlap_fallbacks: r.counter_vec(
                "kvroute_router_overlap_fallbacks_total",
                "Selections scored on load alone because overlap was unavailable, per reason.",
                "reason",
            ),
            sessions: r.counter_vec(
                "kvroute_router_sessions_total",
                "Session binding outcomes (kept = affinity hit).",
                "binding",
            ),
            decisions_applied: r.counter(
                "kvroute_router_decisions_applied_total",
                "Decisions (every replica's) applied to the load view.",
            ),
            decisions_duplicate: r.counter(
                "kvroute_router_decisions_duplicate_total",
                "Other replicas' decisions seen again (a redelivery) or superseded by a decision of a later attempt, and skipped; this replica's own decisions echoed back are not counted.",
            ),
            load_reports: r.counter(
                "kvroute_router_load_reports_total",
                "Worker load reports applied.",
            ),
            load_reports_stale: r.counter(
                "kvroute_router_load_reports_stale_total",
                "Worker load reports older than the last one, dropped.",
            ),
            lifecycle_events: r.counter(
                "kvroute_router_lifecycle_events_total",
                "Request lifecycle events applied.",
            ),
            bad_cards: kvroute_common::discovery::bad_cards_metric(&r),
            bad_messages: r.counter_vec(
                "kvroute_router_bad_messages_total",
                "Undecodable messages skipped, per input and reason.",
                "kind",
            ),
            predicted_requests: r.gauge(
                "kvroute_router_predicted_requests",
                "Requests in the predicted load view, not yet finished.",
            ),
            forwards: r.counter_vec(
                "kvroute_router_forwards_total",
                "Requests forwarded to their partition's owner replica, by outcome.",
                "outcome",
            ),
            expired: r.counter_vec(
                "kvroute_router_expired_requests_total",
                "Requests dropped unanswered because their deadline had passed, per stage.",
                "stage",
            ),
            retries_received: r.counter(
                "kvroute_router_retries_received_total",
                "Requests received as a retry (attempt above 0).",
            ),
            repeated: r.counter(
                "kvroute_router_repeated_requests_total",
                "Requests answered with the decision their request id already had.",
            ),
            overlap_retries: r.counter(
                "kvroute_router_overlap_retries_total",
                "Remote overlap query attempts beyond the first.",
            ),
            serving: r.gauge(
                "kvroute_router_serving",
                "1 while the replica is in the select queue group.",
            ),
            lagging: r.gauge(
                "kvroute_router_lagging",
                "1 while the watchdog finds the replica behind (out of the queue group).",
            ),
            lag_ms: r.gauge(
                "kvroute_router_lag_milliseconds",
                "The watchdog's last measure: timer lateness or the oldest selection in flight.",
            ),
            group_leaves: r.counter_vec(
                "kvroute_router_queue_group_leaves_total",
                "Times the replica left the select queue group, per reason.",
                "reason",
            ),
            nats_reconnects: r.counter(
                "kvroute_router_nats_reconnects_total",
                "Reconnections to NATS after a lost connection.",
            ),
            predictions_forgotten: r.counter(
                "kvroute_router_predictions_forgotten_total",
                "Predictions dropped after a reconnection (events of the gap may be missing).",
            ),
            workers: r.gauge("kvroute_router_workers", "Registered workers."),
            ready: r.gauge("kvroute_router_ready", "1 when the replica answers selections."),
            local_applied_seq: r.gauge(
                "kvroute_router_local_applied_seq",
                "Local overlap mode: the embedded replica's applied log sequence.",
            ),
            queue_depth: r.gauge_family(
                "kvroute_router_queue_depth",
                "Admitted requests waiting in the admission queue, per partition and class.",
                &["model", "role", "class"],
            ),
            queue_deferred: r.gauge_family(
                "kvroute_router_queue_deferred",
                "Requests in the admission queue that their classifier holds back, per partition.",
                &["model", "role"],
            ),
            classifier_tracked: r.gauge(
                "kvroute_router_classifier_tracked_requests",
                "Requests the request classifier follows (classified, not yet completed).",
            ),
            queue_joined: r.counter_family(
                "kvroute_router_queue_joined_total",
                "Requests that joined the admission queue (a retry of a queued request counts again).",
                &["model", "role"],
            ),
            queue_full: r.counter_family(
                "kvroute_router_queue_full_total",
                "Requests refused with queue_full.",
                &["model", "role"],
            ),
            queue_dispatched: r.counter_family(
                "kvroute_router_queue_dispatched_total",
                "Queued requests served (a worker chosen).",
                &["model", "role", "class"],
            ),
            queue_refused: r.counter_family(
                "kvroute_router_queue_refused_total",
                "Queued requests answered with an error other than queue_timeout when their turn came.",
                &["model", "role", "class"],
            ),
            queue_timeouts: r.counter_family(
                "kvroute_router_queue_timeouts_total",
                "Queued requests answered queue_timeout.",
                &["model", "role", "class"],
            ),
            queue_wait: r.wait_histogram_family(
                "kvroute_router_queue_wait_seconds",
                "Time from a served request's first arrival to its dispatch from the admission queue.",
                &["model", "role", "class"],
            ),
            queue_handed_over: r.counter(
                "kvroute_router_queue_handed_over_total",
                "Queued requests handed to their partition's new owner replica.",
            ),
            registry: r,
        }
    }
}

impl RouterMetrics {
    /// The watchdog's series.
    pub fn watchdog(&self) -> WatchdogMetrics {
        WatchdogMetrics {
            lag_ms: self.lag_ms.clone(),
            lagging: self.lagging.clone(),
            leaves: self.group_leaves.clone(),
        }
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}
