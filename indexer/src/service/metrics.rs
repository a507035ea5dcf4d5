//! The indexer's metrics (served on `/metrics`; the list is in ARCHITECTURE.md).

use std::sync::Arc;

use kvroute_common::messages::IndexErrorCode;
use kvroute_common::ops::{Counter, CounterVec, Gauge, Histogram, Registry, WatchdogMetrics};

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
        let queries = r.counter_vec(
            "kvroute_indexer_queries_total",
            "Overlap queries, by result.",
            "result",
        );
        // Every result is exported from the start (at 0), so a rate or a difference over a
        // window is defined before the first query of that kind.
        for result in ["ok", "expired"]
            .into_iter()
            .chain(IndexErrorCode::ALL.map(IndexErrorCode::as_str))
        {
            queries.add(result, 0);
        }
        Self {
            log_messages: r.counter(
                "kvroute_indexer_log_messages_total",
                "Log messages consumed (good and bad).",
            ),
            events_applied: r.counter(
                "kvroute_indexer_events_applied_total",
                "KV events applied to the index.",
            ),
            events_refused: r.counter(
                "kvroute_indexer_events_refused_total",
                "KV events the index refused (e.g. unknown parent).",
            ),
            duplicate_events: r.counter(
                "kvroute_indexer_duplicate_events_total",
                "KV events skipped as already applied.",
            ),
            ignored_removed_events: r.counter(
                "kvroute_indexer_removed_worker_events_total",
                "KV events of removed workers, ignored.",
            ),
            bad_cards: kvroute_common::discovery::bad_cards_metric(&r),
            bad_messages: r.counter_vec(
                "kvroute_indexer_bad_messages_total",
                "Log messages skipped, by reason.",
                "reason",
            ),
            gaps: r.counter(
                "kvroute_indexer_event_gaps_total",
                "Jumps in a worker's event ids (lost events).",
            ),
            resync_requests: r.counter(
                "kvroute_indexer_resync_requests_total",
                "Resync requests sent to workers.",
            ),
            workers_removed: r.counter(
                "kvroute_indexer_workers_removed_total",
                "WorkerRemoved records applied.",
            ),
            applied_seq: r.gauge(
                "kvroute_indexer_applied_sequence",
                "Last stream sequence applied.",
            ),
            lag: r.gauge(
                "kvroute_indexer_lag_messages",
                "Stream messages not yet applied.",
            ),
            index_entries: r.gauge(
                "kvroute_indexer_index_entries",
                "(block, worker, rank) entries in the index.",
            ),
            index_nodes: r.gauge(
                "kvroute_indexer_index_nodes",
                "Blocks in the radix tree (prefixes held by some worker).",
            ),
            index_runs: r.gauge(
                "kvroute_indexer_index_runs",
                "Radix tree nodes, each a run of consecutive blocks.",
            ),
            index_bytes: r.gauge(
                "kvroute_indexer_index_bytes",
                "Bytes allocated by the index (the writer's side once, and both views once the replica serves).",
            ),
            index_evicted: r.gauge(
                "kvroute_indexer_index_evicted_entries",
                "Entries evicted by the memory cap.",
            ),
            queries,
            query_latency: r.histogram(
                "kvroute_indexer_query_latency_seconds",
                "Time to answer an overlap query.",
            ),
            snapshots_written: r.counter(
                "kvroute_indexer_snapshots_written_total",
                "Snapshots written by this replica.",
            ),
            snapshot_age_seconds: r.gauge(
                "kvroute_indexer_snapshot_age_seconds",
                "Age of the newest snapshot this replica wrote or loaded (-1: none).",
            ),
            stream_mismatches: r.gauge(
                "kvroute_indexer_stream_config_mismatches",
                "Events-stream settings that differ from this process's flags.",
            ),
            leader: r.gauge(
                "kvroute_indexer_leader",
                "1 if this replica is the snapshot leader.",
            ),
            leader_term: r.gauge(
                "kvroute_indexer_leader_term",
                "The leader term this replica acts in: the leader key's create revision (0: not leading).",
            ),
            leader_terms: r.counter(
                "kvroute_indexer_leader_terms_total",
                "Leader terms this replica began.",
            ),
            step_downs: r.counter_vec(
                "kvroute_indexer_leader_step_downs_total",
                "Times this replica stopped acting as leader, by reason.",
                "reason",
            ),
            stale_term_records: r.counter(
                "kvroute_indexer_stale_term_records_total",
                "Control records from a leader term older than the newest seen, ignored.",
            ),
            removed_workers_tracked: r.gauge(
                "kvroute_indexer_removed_workers_tracked",
                "Removed workers whose late events are still ignored (bounded).",
            ),
            ready: r.gauge("kvroute_indexer_ready", "1 if this replica has caught up."),
            serving: r.gauge(
                "kvroute_indexer_serving",
                "1 while the replica is in the query queue group (ready and keeping up).",
            ),
            lag_ms: r.gauge(
                "kvroute_indexer_lag_milliseconds",
                "The watchdog's last measure: timer lateness or the oldest query in flight.",
            ),
            lagging: r.gauge(
                "kvroute_indexer_lagging",
                "1 while the watchdog finds the replica behind on queries.",
            ),
            group_leaves: r.counter_vec(
                "kvroute_indexer_queue_group_leaves_total",
                "Times the replica left the query queue group, per reason.",
                "reason",
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
