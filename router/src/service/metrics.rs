//! The router's metrics, rendered on `/metrics`: every series is registered in
//! [`RouterMetrics::new`] with its help text and labels.

use std::sync::Arc;

use kvroute_common::messages::{BindingState, ErrorCode};
use kvroute_common::ops::{
    Counter, CounterVec, Family, Gauge, Histogram, OneOf, Registry, WatchdogMetrics,
};

use super::overlap::Fallback;

/// The names of the families (the contract with dashboards and the tests).
pub mod names {
    pub const SELECTION_LATENCY_SECONDS: &str = "kvroute_router_selection_latency_seconds";
    pub const OVERLAP_LATENCY_SECONDS: &str = "kvroute_router_overlap_latency_seconds";
    pub const DECISIONS: &str = "kvroute_router_decisions_total";
    pub const ERRORS: &str = "kvroute_router_errors_total";
    pub const OVERLAP_BLOCKS: &str = "kvroute_router_overlap_blocks_total";
    pub const REQUEST_BLOCKS: &str = "kvroute_router_request_blocks_total";
    pub const OVERLAP_FALLBACKS: &str = "kvroute_router_overlap_fallbacks_total";
    pub const SESSIONS: &str = "kvroute_router_sessions_total";
    pub const DECISIONS_APPLIED: &str = "kvroute_router_decisions_applied_total";
    pub const DECISIONS_DUPLICATE: &str = "kvroute_router_decisions_duplicate_total";
    pub const LOAD_REPORTS: &str = "kvroute_router_load_reports_total";
    pub const LOAD_REPORTS_STALE: &str = "kvroute_router_load_reports_stale_total";
    pub const LIFECYCLE_EVENTS: &str = "kvroute_router_lifecycle_events_total";
    pub const BAD_MESSAGES: &str = "kvroute_router_bad_messages_total";
    pub const PREDICTED_REQUESTS: &str = "kvroute_router_predicted_requests";
    pub const APPROX_RANKS: &str = "kvroute_router_approx_ranks";
    pub const APPROX_BLOCKS: &str = "kvroute_router_approx_blocks";
    pub const FORWARDS: &str = "kvroute_router_forwards_total";
    pub const EXPIRED_REQUESTS: &str = "kvroute_router_expired_requests_total";
    pub const RETRIES_RECEIVED: &str = "kvroute_router_retries_received_total";
    pub const REPEATED_REQUESTS: &str = "kvroute_router_repeated_requests_total";
    pub const OVERLAP_RETRIES: &str = "kvroute_router_overlap_retries_total";
    pub const SERVING: &str = "kvroute_router_serving";
    pub const LAGGING: &str = "kvroute_router_lagging";
    pub const LAG_MILLISECONDS: &str = "kvroute_router_lag_milliseconds";
    pub const QUEUE_GROUP_LEAVES: &str = "kvroute_router_queue_group_leaves_total";
    pub const NATS_RECONNECTS: &str = "kvroute_router_nats_reconnects_total";
    pub const PREDICTIONS_FORGOTTEN: &str = "kvroute_router_predictions_forgotten_total";
    pub const WORKERS: &str = "kvroute_router_workers";
    pub const READY: &str = "kvroute_router_ready";
    pub const LOCAL_APPLIED_SEQ: &str = "kvroute_router_local_applied_seq";
    pub const QUEUE_DEPTH: &str = "kvroute_router_queue_depth";
    pub const QUEUE_DEFERRED: &str = "kvroute_router_queue_deferred";
    pub const CLASSIFIER_TRACKED_REQUESTS: &str = "kvroute_router_classifier_tracked_requests";
    pub const QUEUE_JOINED: &str = "kvroute_router_queue_joined_total";
    pub const QUEUE_FULL: &str = "kvroute_router_queue_full_total";
    pub const QUEUE_DISPATCHED: &str = "kvroute_router_queue_dispatched_total";
    pub const QUEUE_REFUSED: &str = "kvroute_router_queue_refused_total";
    pub const QUEUE_TIMEOUTS: &str = "kvroute_router_queue_timeouts_total";
    pub const QUEUE_WAIT_SECONDS: &str = "kvroute_router_queue_wait_seconds";
    pub const QUEUE_HANDED_OVER: &str = "kvroute_router_queue_handed_over_total";
    pub const DISAGGREGATION: &str = "kvroute_router_disaggregation_total";
}

/// The labels of the families whose values the code lists (see [`OneOf`]).
pub mod labels {
    use super::*;

    pub const ERRORS: OneOf = OneOf {
        family: names::ERRORS,
        label: "code",
        values: || ErrorCode::ALL.map(ErrorCode::as_str).to_vec(),
    };
    pub const SESSIONS: OneOf = OneOf {
        family: names::SESSIONS,
        label: "binding",
        values: || BindingState::ALL.map(BindingState::as_str).to_vec(),
    };
    pub const OVERLAP_FALLBACKS: OneOf = OneOf {
        family: names::OVERLAP_FALLBACKS,
        label: "reason",
        values: || Fallback::ALL.map(Fallback::reason).to_vec(),
    };
    /// What became of a request of a model with prefill and decode workers that could be
    /// disaggregated: a pair; served by its prefill worker end to end (the conditional rule
    /// said so); or end to end because no decode worker could take it.
    pub const DISAGG_PAIRED: &str = "paired";
    pub const DISAGG_PREFILL_ONLY: &str = "prefill_only";
    pub const DISAGG_DECODE_UNAVAILABLE: &str = "decode_unavailable";
    pub const DISAGGREGATION: OneOf = OneOf {
        family: names::DISAGGREGATION,
        label: "outcome",
        values: || {
            vec![
                DISAGG_PAIRED,
                DISAGG_PREFILL_ONLY,
                DISAGG_DECODE_UNAVAILABLE,
            ]
        },
    };
    /// A forward's outcome: the owner answered, or queued the request; or it was decided here.
    pub const FORWARD_ANSWERED: &str = "answered";
    pub const FORWARD_QUEUED: &str = "queued";
    pub const FORWARD_NO_RESPONDERS: &str = "no_responders";
    pub const FORWARD_TIMEOUT: &str = "timeout";
    pub const FORWARD_ERROR: &str = "error";
    pub const FORWARDS: OneOf = OneOf {
        family: names::FORWARDS,
        label: "outcome",
        values: || {
            vec![
                FORWARD_ANSWERED,
                FORWARD_QUEUED,
                FORWARD_NO_RESPONDERS,
                FORWARD_TIMEOUT,
                FORWARD_ERROR,
            ]
        },
    };
    /// Where a request was found past its deadline.
    pub const EXPIRED_INTAKE: &str = "intake";
    pub const EXPIRED_QUEUED: &str = "queued";
    pub const EXPIRED_SELECTED: &str = "selected";
    pub const EXPIRED: OneOf = OneOf {
        family: names::EXPIRED_REQUESTS,
        label: "stage",
        values: || vec![EXPIRED_INTAKE, EXPIRED_QUEUED, EXPIRED_SELECTED],
    };
    pub const GROUP_LEAVES: OneOf = OneOf {
        family: names::QUEUE_GROUP_LEAVES,
        label: "reason",
        values: kvroute_common::ops::watchdog::leave_reasons,
    };

    /// Every [`OneOf`] family of the router (the discovery's bad cards included).
    pub const ALL: [OneOf; 8] = [
        ERRORS,
        SESSIONS,
        OVERLAP_FALLBACKS,
        FORWARDS,
        DISAGGREGATION,
        EXPIRED,
        GROUP_LEAVES,
        kvroute_common::discovery::BAD_CARDS,
    ];
}

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
    /// Approximate mode: ranks of workers without KV events, and the blocks predicted on them.
    pub approx_ranks: Arc<Gauge>,
    pub approx_blocks: Arc<Gauge>,
    /// Requests dropped past their deadline, by stage (`intake`, `queued`).
    pub expired: Arc<CounterVec>,
    /// Requests received with `attempt` > 0 (client retries).
    pub retries_received: Arc<Counter>,
    /// Requests answered with the decision their id already had.
    pub repeated: Arc<Counter>,
    /// Requests forwarded to their partition's owner, by outcome (`answered`,
    /// `no_responders`, `timeout`, `error`: the last three were decided here instead).
    pub forwards: Arc<CounterVec>,
    /// Requests that could be disaggregated, by outcome.
    pub disaggregation: Arc<CounterVec>,
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
                names::SELECTION_LATENCY_SECONDS,
                "Time from receiving a select request to publishing its reply.",
            ),
            overlap_latency: r.histogram(
                names::OVERLAP_LATENCY_SECONDS,
                "Time to get a prompt's overlap (remote query or local lookup).",
            ),
            decisions: r.counter_vec(
                names::DECISIONS,
                "Selections made by this replica, per worker rank.",
                "worker",
            ),
            errors: r.counter_one_of(
                labels::ERRORS,
                "Error replies, per error code.",
            ),
            overlap_blocks: r.counter(
                names::OVERLAP_BLOCKS,
                "Device blocks the chosen worker already held (overlap ratio = this / request blocks).",
            ),
            request_blocks: r.counter(
                names::REQUEST_BLOCKS,
                "Full prompt blocks of the selections.",
            ),
            overlap_fallbacks: r.counter_one_of(
                labels::OVERLAP_FALLBACKS,
                "Selections scored on load alone because overlap was unavailable, per reason.",
            ),
            sessions: r.counter_one_of(
                labels::SESSIONS,
                "Session binding outcomes (kept = affinity hit).",
            ),
            decisions_applied: r.counter(
                names::DECISIONS_APPLIED,
                "Decisions (every replica's) applied to the load view.",
            ),
            decisions_duplicate: r.counter(
                names::DECISIONS_DUPLICATE,
                "Other replicas' decisions seen again (a redelivery) or superseded by a decision of a later attempt, and skipped; this replica's own decisions echoed back are not counted.",
            ),
            load_reports: r.counter(
                names::LOAD_REPORTS,
                "Worker load reports applied.",
            ),
            load_reports_stale: r.counter(
                names::LOAD_REPORTS_STALE,
                "Worker load reports older than the last one, dropped.",
            ),
            lifecycle_events: r.counter(
                names::LIFECYCLE_EVENTS,
                "Request lifecycle events applied.",
            ),
            bad_cards: kvroute_common::discovery::bad_cards_metric(&r),
            bad_messages: r.counter_vec(
                names::BAD_MESSAGES,
                "Undecodable messages skipped, per input and reason.",
                "kind",
            ),
            predicted_requests: r.gauge(
                names::PREDICTED_REQUESTS,
                "Requests in the predicted load view, not yet finished.",
            ),
            approx_ranks: r.gauge(
                names::APPROX_RANKS,
                "Ranks of workers without KV events, whose caches are predicted (approximate mode).",
            ),
            approx_blocks: r.gauge(
                names::APPROX_BLOCKS,
                "Blocks predicted held on the ranks of workers without KV events.",
            ),
            forwards: r.counter_one_of(
                labels::FORWARDS,
                "Requests forwarded to their partition's owner replica, by outcome.",
            ),
            disaggregation: r.counter_one_of(
                labels::DISAGGREGATION,
                "Requests of models with prefill and decode workers that could be disaggregated, by outcome.",
            ),
            expired: r.counter_one_of(
                labels::EXPIRED,
                "Requests dropped unanswered because their deadline had passed, per stage.",
            ),
            retries_received: r.counter(
                names::RETRIES_RECEIVED,
                "Requests received as a retry (attempt above 0).",
            ),
            repeated: r.counter(
                names::REPEATED_REQUESTS,
                "Requests answered with the decision their request id already had.",
            ),
            overlap_retries: r.counter(
                names::OVERLAP_RETRIES,
                "Remote overlap query attempts beyond the first.",
            ),
            serving: r.gauge(
                names::SERVING,
                "1 while the replica is in the select queue group.",
            ),
            lagging: r.gauge(
                names::LAGGING,
                "1 while the watchdog finds the replica behind (out of the queue group).",
            ),
            lag_ms: r.gauge(
                names::LAG_MILLISECONDS,
                "The watchdog's last measure: timer lateness or the oldest selection in flight.",
            ),
            group_leaves: r.counter_one_of(
                labels::GROUP_LEAVES,
                "Times the replica left the select queue group, per reason.",
            ),
            nats_reconnects: r.counter(
                names::NATS_RECONNECTS,
                "Reconnections to NATS after a lost connection.",
            ),
            predictions_forgotten: r.counter(
                names::PREDICTIONS_FORGOTTEN,
                "Predictions dropped after a reconnection (events of the gap may be missing).",
            ),
            workers: r.gauge(names::WORKERS, "Registered workers."),
            ready: r.gauge(names::READY, "1 when the replica answers selections."),
            local_applied_seq: r.gauge(
                names::LOCAL_APPLIED_SEQ,
                "Local overlap mode: the embedded replica's applied log sequence.",
            ),
            queue_depth: r.gauge_family(
                names::QUEUE_DEPTH,
                "Admitted requests waiting in the admission queue, per partition and class.",
                &["model", "role", "class"],
            ),
            queue_deferred: r.gauge_family(
                names::QUEUE_DEFERRED,
                "Requests in the admission queue that their classifier holds back, per partition.",
                &["model", "role"],
            ),
            classifier_tracked: r.gauge(
                names::CLASSIFIER_TRACKED_REQUESTS,
                "Requests the request classifier follows (classified, not yet completed).",
            ),
            queue_joined: r.counter_family(
                names::QUEUE_JOINED,
                "Requests that joined the admission queue (a retry of a queued request counts again).",
                &["model", "role"],
            ),
            queue_full: r.counter_family(
                names::QUEUE_FULL,
                "Requests refused with queue_full.",
                &["model", "role"],
            ),
            queue_dispatched: r.counter_family(
                names::QUEUE_DISPATCHED,
                "Queued requests served (a worker chosen).",
                &["model", "role", "class"],
            ),
            queue_refused: r.counter_family(
                names::QUEUE_REFUSED,
                "Queued requests answered with an error other than queue_timeout when their turn came.",
                &["model", "role", "class"],
            ),
            queue_timeouts: r.counter_family(
                names::QUEUE_TIMEOUTS,
                "Queued requests answered queue_timeout.",
                &["model", "role", "class"],
            ),
            queue_wait: r.wait_histogram_family(
                names::QUEUE_WAIT_SECONDS,
                "Time from a served request's first arrival to its dispatch from the admission queue.",
                &["model", "role", "class"],
            ),
            queue_handed_over: r.counter(
                names::QUEUE_HANDED_OVER,
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
