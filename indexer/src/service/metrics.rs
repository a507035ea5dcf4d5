//! The indexer's metrics, served on `/metrics`: every series is registered in
//! [`IndexerMetrics::new`] with its help text and labels.

use std::sync::Arc;

use kvroute_common::messages::IndexErrorCode;
use kvroute_common::ops::{
    Counter, CounterVec, Gauge, Histogram, OneOf, Registry, WatchdogMetrics,
};

use super::duties::StepDown;
use crate::replica::BadEntry;

/// The names of the families (the contract with dashboards and the tests).
pub mod names {
    pub const QUERIES: &str = "kvroute_indexer_queries_total";
    pub const LOG_MESSAGES: &str = "kvroute_indexer_log_messages_total";
    pub const EVENTS_APPLIED: &str = "kvroute_indexer_events_applied_total";
    pub const EVENTS_REFUSED: &str = "kvroute_indexer_events_refused_total";
    pub const DUPLICATE_EVENTS: &str = "kvroute_indexer_duplicate_events_total";
    pub const REMOVED_WORKER_EVENTS: &str = "kvroute_indexer_removed_worker_events_total";
    pub const BAD_MESSAGES: &str = "kvroute_indexer_bad_messages_total";
    pub const EVENT_GAPS: &str = "kvroute_indexer_event_gaps_total";
    pub const RESYNC_REQUESTS: &str = "kvroute_indexer_resync_requests_total";
    pub const WORKERS_REMOVED: &str = "kvroute_indexer_workers_removed_total";
    pub const APPLIED_SEQUENCE: &str = "kvroute_indexer_applied_sequence";
    pub const LAG_MESSAGES: &str = "kvroute_indexer_lag_messages";
    pub const INDEX_ENTRIES: &str = "kvroute_indexer_index_entries";
    pub const INDEX_NODES: &str = "kvroute_indexer_index_nodes";
    pub const INDEX_RUNS: &str = "kvroute_indexer_index_runs";
    pub const INDEX_BYTES: &str = "kvroute_indexer_index_bytes";
    pub const INDEX_EVICTED_ENTRIES: &str = "kvroute_indexer_index_evicted_entries";
    pub const QUERY_LATENCY_SECONDS: &str = "kvroute_indexer_query_latency_seconds";
    pub const SNAPSHOTS_WRITTEN: &str = "kvroute_indexer_snapshots_written_total";
    pub const SNAPSHOT_AGE_SECONDS: &str = "kvroute_indexer_snapshot_age_seconds";
    pub const STREAM_CONFIG_MISMATCHES: &str = "kvroute_indexer_stream_config_mismatches";
    pub const LEADER: &str = "kvroute_indexer_leader";
    pub const LEADER_TERM: &str = "kvroute_indexer_leader_term";
    pub const LEADER_TERMS: &str = "kvroute_indexer_leader_terms_total";
    pub const LEADER_STEP_DOWNS: &str = "kvroute_indexer_leader_step_downs_total";
    pub const STALE_TERM_RECORDS: &str = "kvroute_indexer_stale_term_records_total";
    pub const REMOVED_WORKERS_TRACKED: &str = "kvroute_indexer_removed_workers_tracked";
    pub const READY: &str = "kvroute_indexer_ready";
    pub const SERVING: &str = "kvroute_indexer_serving";
    pub const LAG_MILLISECONDS: &str = "kvroute_indexer_lag_milliseconds";
    pub const LAGGING: &str = "kvroute_indexer_lagging";
    pub const QUEUE_GROUP_LEAVES: &str = "kvroute_indexer_queue_group_leaves_total";
}

/// The labels of the families whose values the code lists (see [`OneOf`]).
pub mod labels {
    use super::*;

    /// A query's result besides its error codes: answered, or found past its deadline.
    pub const QUERY_OK: &str = "ok";
    pub const QUERY_EXPIRED: &str = "expired";
    pub const QUERIES: OneOf = OneOf {
        family: names::QUERIES,
        label: "result",
        values: || {
            let mut all = vec![QUERY_OK, QUERY_EXPIRED];
            all.extend(IndexErrorCode::ALL.map(IndexErrorCode::as_str));
            all
        },
    };
    pub const BAD_MESSAGES: OneOf = OneOf {
        family: names::BAD_MESSAGES,
        label: "reason",
        values: BadEntry::reasons,
    };
    pub const LEADER_STEP_DOWNS: OneOf = OneOf {
        family: names::LEADER_STEP_DOWNS,
        label: "reason",
        values: || StepDown::ALL.map(StepDown::as_str).to_vec(),
    };
    pub const GROUP_LEAVES: OneOf = OneOf {
        family: names::QUEUE_GROUP_LEAVES,
        label: "reason",
        values: kvroute_common::ops::watchdog::leave_reasons,
    };

    /// Every [`OneOf`] family of the indexer (the discovery's bad cards included).
    pub const ALL: [OneOf; 5] = [
        QUERIES,
        BAD_MESSAGES,
        LEADER_STEP_DOWNS,
        GROUP_LEAVES,
        kvroute_common::discovery::BAD_CARDS,
    ];
}

#[derive(Debug)]
pub struct IndexerMetrics {
    pub registry: Registry,
    pub log_messages: Arc<Counter>,
    pub events_applied: Arc<Counter>,
    pub events_refused: Arc<Counter>,
    pub duplicate_events: Arc<Counter>,
    pub ignored_removed_events: Arc<Counter>,
    /// Worker cards in etcd skipped, by reason.
    pub bad_cards: Arc<CounterVec>,
    pub bad_messages: Arc<CounterVec>,
    pub gaps: Arc<Counter>,
    pub resync_requests: Arc<Counter>,
    pub workers_removed: Arc<Counter>,
    pub applied_seq: Arc<Gauge>,
    pub lag: Arc<Gauge>,
    pub index_entries: Arc<Gauge>,
    pub index_nodes: Arc<Gauge>,
    pub index_runs: Arc<Gauge>,
    pub index_bytes: Arc<Gauge>,
    pub index_evicted: Arc<Gauge>,
    pub queries: Arc<CounterVec>,
    pub query_latency: Arc<Histogram>,
    pub snapshots_written: Arc<Counter>,
    pub snapshot_age_seconds: Arc<Gauge>,
    pub stream_mismatches: Arc<Gauge>,
    pub leader: Arc<Gauge>,
    /// The leader term this replica acts in (0: not leading).
    pub leader_term: Arc<Gauge>,
    pub leader_terms: Arc<Counter>,
    pub step_downs: Arc<CounterVec>,
    /// Control records of a deposed leader's term, ignored.
    pub stale_term_records: Arc<Counter>,
    /// Workers the tracker remembers as removed.
    pub removed_workers_tracked: Arc<Gauge>,
    pub ready: Arc<Gauge>,
    /// 1 while the replica is in the query queue group.
    pub serving: Arc<Gauge>,
    /// The watchdog: its last measure, whether behind, and leaves of the group by reason.
    pub lag_ms: Arc<Gauge>,
    pub lagging: Arc<Gauge>,
    pub group_leaves: Arc<CounterVec>,
}

impl IndexerMetrics {
    pub fn new() -> Self {
        let r = Registry::default();
        // Every result is exported from the start (at 0), so a rate or a difference over a
        // window is defined before the first query of that kind.
        let queries = r.counter_one_of(labels::QUERIES, "Overlap queries, by result.");
        Self {
            log_messages: r.counter(
                names::LOG_MESSAGES,
                "Log messages consumed (good and bad).",
            ),
            events_applied: r.counter(
                names::EVENTS_APPLIED,
                "KV events applied to the index.",
            ),
            events_refused: r.counter(
                names::EVENTS_REFUSED,
                "KV events the index refused (e.g. unknown parent).",
            ),
            duplicate_events: r.counter(
                names::DUPLICATE_EVENTS,
                "KV events skipped as already applied.",
            ),
            ignored_removed_events: r.counter(
                names::REMOVED_WORKER_EVENTS,
                "KV events of removed workers, ignored.",
            ),
            bad_cards: kvroute_common::discovery::bad_cards_metric(&r),
            bad_messages: r.counter_one_of(
                labels::BAD_MESSAGES,
                "Log messages skipped, by reason.",
            ),
            gaps: r.counter(
                names::EVENT_GAPS,
                "Jumps in a worker's event ids (lost events).",
            ),
            resync_requests: r.counter(
                names::RESYNC_REQUESTS,
                "Resync requests sent to workers.",
            ),
            workers_removed: r.counter(
                names::WORKERS_REMOVED,
                "WorkerRemoved records applied.",
            ),
            applied_seq: r.gauge(
                names::APPLIED_SEQUENCE,
                "Last stream sequence applied.",
            ),
            lag: r.gauge(
                names::LAG_MESSAGES,
                "Stream messages not yet applied.",
            ),
            index_entries: r.gauge(
                names::INDEX_ENTRIES,
                "(block, worker, rank) entries in the index.",
            ),
            index_nodes: r.gauge(
                names::INDEX_NODES,
                "Blocks in the radix tree (prefixes held by some worker).",
            ),
            index_runs: r.gauge(
                names::INDEX_RUNS,
                "Radix tree nodes, each a run of consecutive blocks.",
            ),
            index_bytes: r.gauge(
                names::INDEX_BYTES,
                "Bytes allocated by the index (the writer's side once, and both views once the replica serves).",
            ),
            index_evicted: r.gauge(
                names::INDEX_EVICTED_ENTRIES,
                "Entries evicted by the memory cap.",
            ),
            queries,
            query_latency: r.histogram(
                names::QUERY_LATENCY_SECONDS,
                "Time to answer an overlap query.",
            ),
            snapshots_written: r.counter(
                names::SNAPSHOTS_WRITTEN,
                "Snapshots written by this replica.",
            ),
            snapshot_age_seconds: r.gauge(
                names::SNAPSHOT_AGE_SECONDS,
                "Age of the newest snapshot this replica wrote or loaded (-1: none).",
            ),
            stream_mismatches: r.gauge(
                names::STREAM_CONFIG_MISMATCHES,
                "Events-stream settings that differ from this process's flags.",
            ),
            leader: r.gauge(
                names::LEADER,
                "1 if this replica is the snapshot leader.",
            ),
            leader_term: r.gauge(
                names::LEADER_TERM,
                "The leader term this replica acts in: the leader key's create revision (0: not leading).",
            ),
            leader_terms: r.counter(
                names::LEADER_TERMS,
                "Leader terms this replica began.",
            ),
            step_downs: r.counter_one_of(
                labels::LEADER_STEP_DOWNS,
                "Times this replica stopped acting as leader, by reason.",
            ),
            stale_term_records: r.counter(
                names::STALE_TERM_RECORDS,
                "Control records from a leader term older than the newest seen, ignored.",
            ),
            removed_workers_tracked: r.gauge(
                names::REMOVED_WORKERS_TRACKED,
                "Removed workers whose late events are still ignored (bounded).",
            ),
            ready: r.gauge(names::READY, "1 if this replica has caught up."),
            serving: r.gauge(
                names::SERVING,
                "1 while the replica is in the query queue group (ready and keeping up).",
            ),
            lag_ms: r.gauge(
                names::LAG_MILLISECONDS,
                "The watchdog's last measure: timer lateness or the oldest query in flight.",
            ),
            lagging: r.gauge(
                names::LAGGING,
                "1 while the watchdog finds the replica behind on queries.",
            ),
            group_leaves: r.counter_one_of(
                labels::GROUP_LEAVES,
                "Times the replica left the query queue group, per reason.",
            ),
            registry: r,
        }
    }
}

impl IndexerMetrics {
    /// The watchdog's series.
    pub fn watchdog(&self) -> WatchdogMetrics {
        WatchdogMetrics {
            lag_ms: self.lag_ms.clone(),
            lagging: self.lagging.clone(),
            leaves: self.group_leaves.clone(),
        }
    }
}

impl Default for IndexerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_query_result_is_exported_before_the_first_query() {
        let text = IndexerMetrics::new().registry.render();
        for result in ["ok", "expired", "not_ready", "bad_request"] {
            let line = format!("kvroute_indexer_queries_total{{result=\"{result}\"}} 0\n");
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
    }
}
