//! Every NATS subject, JetStream stream / consumer, bucket and etcd key, built from the
//! namespace. Nothing else in kvroute spells one by hand; PROTOCOL.md lists them all.

use crate::ids::{Namespace, WorkerId};

/// Names for one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    ns: Namespace,
    /// `kvroute.<ns>`
    subject_root: String,
    /// `KVROUTE_<ns>`: the stem of stream and bucket names.
    upper: String,
}

impl Names {
    pub fn new(ns: &Namespace) -> Self {
        // The namespace is kept verbatim (no case folding) so two namespaces never collide.
        let upper = format!("KVROUTE_{}", ns.as_str());
        Self {
            ns: ns.clone(),
            subject_root: format!("kvroute.{}", ns.as_str()),
            upper,
        }
    }

    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    // ---- NATS subjects -------------------------------------------------------------------

    /// Where worker `worker` publishes its [`crate::messages::KvEventBatch`]es.
    pub fn kv_events(&self, worker: WorkerId) -> String {
        format!("{}.kv.events.{worker}", self.subject_root)
    }

    /// Every worker's events (the events stream's subject filter).
    pub fn kv_events_all(&self) -> String {
        format!("{}.kv.events.*", self.subject_root)
    }

    /// Records the indexer leader appends to the event log (e.g. worker removed).
    pub fn kv_control(&self) -> String {
        format!("{}.kv.control", self.subject_root)
    }

    /// Every subject the events stream captures.
    pub fn events_stream_subjects(&self) -> Vec<String> {
        vec![self.kv_events_all(), self.kv_control()]
    }

    /// Request/reply: ask worker `worker` to publish `Cleared` and its full cache state.
    pub fn worker_resync(&self, worker: WorkerId) -> String {
        format!("{}.worker.{worker}.resync", self.subject_root)
    }

    /// Request/reply, kvroute-mocker only: drop the simulated worker's cache and running
    /// requests (it publishes `Cleared`), so benchmark runs start cold.
    pub fn worker_reset(&self, worker: WorkerId) -> String {
        format!("{}.worker.{worker}.reset", self.subject_root)
    }

    /// Worker load reports.
    pub fn load(&self, worker: WorkerId) -> String {
        format!("{}.load.{worker}", self.subject_root)
    }

    pub fn load_all(&self) -> String {
        format!("{}.load.*", self.subject_root)
    }

    /// Request lifecycle events (prefill done, finished) from worker `worker`.
    pub fn lifecycle(&self, worker: WorkerId) -> String {
        format!("{}.lifecycle.{worker}", self.subject_root)
    }

    pub fn lifecycle_all(&self) -> String {
        format!("{}.lifecycle.*", self.subject_root)
    }

    /// Default request subject of worker `worker` (its card may name another).
    pub fn worker_requests(&self, worker: WorkerId) -> String {
        format!("{}.worker.{worker}.generate", self.subject_root)
    }

    /// Request/reply: worker selection (router queue group [`Names::router_queue_group`]).
    pub fn select(&self) -> String {
        format!("{}.select", self.subject_root)
    }

    /// Request/reply: worker selection by one router replica only (its `router_id`), for a
    /// client's retry to a replica that answered it recently.
    pub fn router_select(&self, router_id: &str) -> String {
        format!("{}.router.{router_id}.select", self.subject_root)
    }

    /// Every routing decision, from every router replica.
    pub fn decisions(&self) -> String {
        format!("{}.decisions", self.subject_root)
    }

    /// Request/reply: overlap queries (indexer queue group [`Names::indexer_queue_group`]).
    pub fn index_query(&self) -> String {
        format!("{}.index.query", self.subject_root)
    }

    /// Request/reply: an overlap query to one indexer replica only (its `replica_id`), for a
    /// router's retry to a replica that answered it recently.
    pub fn indexer_query(&self, replica_id: &str) -> String {
        format!("{}.indexer.{replica_id}.query", self.subject_root)
    }

    /// Request/reply, every replica answers: (applied sequence, digest) for consistency checks.
    pub fn index_digest(&self) -> String {
        format!("{}.index.digest", self.subject_root)
    }

    pub fn router_queue_group(&self) -> String {
        format!("{}.routers", self.subject_root)
    }

    pub fn indexer_queue_group(&self) -> String {
        format!("{}.indexers", self.subject_root)
    }

    // ---- JetStream ------------------------------------------------------------------------

    /// The stream that orders every worker's KV events: `KVROUTE_<ns>_EVENTS`.
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.upper)
    }

    /// KV bucket holding session bindings.
    pub fn sessions_bucket(&self) -> String {
        format!("{}_SESSIONS", self.upper)
    }

    /// The key of session `session` in [`Names::sessions_bucket`]: `s.` and the id's UTF-8
    /// bytes in lowercase hex (session ids are free-form; bucket keys are not).
    pub fn session_key(&self, session: &str) -> String {
        use std::fmt::Write as _;
        let mut key = String::with_capacity(2 + 2 * session.len());
        key.push_str("s.");
        for b in session.bytes() {
            let _ = write!(key, "{b:02x}");
        }
        key
    }

    /// Object store holding index snapshots.
    pub fn snapshots_bucket(&self) -> String {
        format!("{}_SNAPSHOTS", self.upper)
    }

    // ---- etcd -----------------------------------------------------------------------------

    /// `/kvroute/<ns>/workers/` — the prefix every worker card lives under.
    pub fn workers_prefix(&self) -> String {
        format!("/kvroute/{}/workers/", self.ns.as_str())
    }

    /// `/kvroute/<ns>/workers/<worker>` — worker `worker`'s card, bound to its lease.
    pub fn worker_key(&self, worker: WorkerId) -> String {
        format!("{}{worker}", self.workers_prefix())
    }

    /// Parses the worker id out of a key under [`Names::workers_prefix`].
    pub fn worker_id_of_key(&self, key: &[u8]) -> Option<WorkerId> {
        let key = std::str::from_utf8(key).ok()?;
        parse_worker_id(key.strip_prefix(&self.workers_prefix())?)
    }

    /// `/kvroute/<ns>/routers/` — the prefix serving router replicas register under.
    pub fn routers_prefix(&self) -> String {
        format!("/kvroute/{}/routers/", self.ns.as_str())
    }

    /// `/kvroute/<ns>/routers/<router_id>` — router replica `router_id`'s registration, bound
    /// to its lease while it serves.
    pub fn router_key(&self, router_id: &str) -> String {
        format!("{}{router_id}", self.routers_prefix())
    }

    /// `/kvroute/<ns>/leader/indexer` — the snapshot leader's election key.
    pub fn indexer_leader_key(&self) -> String {
        format!("/kvroute/{}/leader/indexer", self.ns.as_str())
    }
}

/// The NATS headers routers put on the requests and answers they pass one another
/// (PROTOCOL.md, "Partition owners"); namespace-independent.
pub mod headers {
    /// On a request forwarded to its partition's owner: the forwarding replica's id. The owner
    /// decides such a request whatever it thinks of ownership (never a second hop).
    pub const FORWARDED_BY: &str = "Kvroute-Forwarded-By";
    /// On a forwarded request: the client's inbox, where the owner answers when it queues it.
    pub const REPLY_TO: &str = "Kvroute-Reply-To";
    /// On the owner's answer to a forwarding replica when it queued the request.
    pub const QUEUED: &str = "Kvroute-Queued";
    /// On a queued request handed to a new owner: its first arrival (ms since the epoch), so
    /// it keeps its place.
    pub const ARRIVED_MS: &str = "Kvroute-Arrived-Ms";
}

/// The name of the snapshot of log position `seq` in the snapshots bucket:
/// `snapshot-<seq, 20 digits>`, so names sort by position.
pub fn snapshot_object(seq: u64) -> String {
    format!("snapshot-{seq:020}")
}

/// The log position a snapshot object's name stands for ([`snapshot_object`]'s inverse).
pub fn snapshot_seq(name: &str) -> Option<u64> {
    name.strip_prefix("snapshot-")?.parse().ok()
}

/// Parses a worker id as kvroute writes it in keys and subjects: decimal digits, no sign, no
/// leading zero. So one worker has one key and one events subject: `+7` and `07` are not 7.
pub fn parse_worker_id(s: &str) -> Option<WorkerId> {
    let id: WorkerId = s.parse().ok()?;
    (id.to_string() == s).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_protocol() {
        let n = Names::new(&Namespace::new("prod-1").unwrap());
        assert_eq!(n.kv_events(7), "kvroute.prod-1.kv.events.7");
        assert_eq!(n.kv_events_all(), "kvroute.prod-1.kv.events.*");
        assert_eq!(n.select(), "kvroute.prod-1.select");
        assert_eq!(n.router_select("r-1"), "kvroute.prod-1.router.r-1.select");
        assert_eq!(n.indexer_query("ix_2"), "kvroute.prod-1.indexer.ix_2.query");
        assert_eq!(n.worker_resync(7), "kvroute.prod-1.worker.7.resync");
        assert_eq!(n.worker_reset(7), "kvroute.prod-1.worker.7.reset");
        assert_eq!(n.events_stream(), "KVROUTE_prod-1_EVENTS");
        assert_eq!(n.sessions_bucket(), "KVROUTE_prod-1_SESSIONS");
        assert_eq!(n.session_key("ab/1"), "s.61622f31");
        assert_eq!(n.worker_key(7), "/kvroute/prod-1/workers/7");
        assert_eq!(n.worker_id_of_key(b"/kvroute/prod-1/workers/7"), Some(7));
        assert_eq!(n.worker_id_of_key(b"/kvroute/other/workers/7"), None);
        assert_eq!(n.indexer_leader_key(), "/kvroute/prod-1/leader/indexer");
    }

    /// `+7` and `07` parsed as worker 7 (seen writing the `worker_card` fuzz target), so a stray key
    /// (or its deletion) stood for a live worker whose card is under another key.
    #[test]
    fn a_worker_has_one_key() {
        let n = Names::new(&Namespace::new("prod-1").unwrap());
        for key in ["+7", "07", "7 ", " 7", "", "-0", "18446744073709551616"] {
            let key = format!("/kvroute/prod-1/workers/{key}");
            assert_eq!(n.worker_id_of_key(key.as_bytes()), None, "{key}");
        }
        assert_eq!(n.worker_id_of_key(b"/kvroute/prod-1/workers/0"), Some(0));
        let max = n.worker_key(u64::MAX);
        assert_eq!(n.worker_id_of_key(max.as_bytes()), Some(u64::MAX));
    }

    #[test]
    fn snapshot_names_sort_by_position_and_parse_back() {
        assert_eq!(snapshot_object(42), "snapshot-00000000000000000042");
        assert!(snapshot_object(9) < snapshot_object(10));
        assert_eq!(snapshot_seq(&snapshot_object(u64::MAX)), Some(u64::MAX));
        assert_eq!(snapshot_seq("snapshot-x"), None);
        assert_eq!(snapshot_seq("other-1"), None);
    }
}
