//! The bridge's metrics, per engine and data-parallel rank, in Prometheus text.
//!
//! Every series carries `engine="<label>"` (the spec's name) and, where it is per rank,
//! `rank="<r>"`; reasons and kinds are a third label. Rendered after the process-wide
//! [`Registry`]'s metrics on `/metrics`, before its `# EOF` (OpenMetrics text).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use kvroute_common::DpRank;

/// A family of counters or gauges keyed by label values.
#[derive(Debug, Default)]
struct Family {
    help: &'static str,
    kind: &'static str,
    /// `(engine, rank or "", extra label value or "")` → value.
    series: BTreeMap<(String, String, String), f64>,
    extra: &'static str,
}

/// Every engine's series. Cheap enough for the event path: one short lock per batch.
#[derive(Debug, Default)]
pub struct BridgeMetrics {
    families: Mutex<BTreeMap<&'static str, Family>>,
}

/// Names of the families (the contract with dashboards; README lists them).
pub mod names {
    pub const BATCHES: &str = "kvroute_bridge_batches_total";
    pub const EVENTS: &str = "kvroute_bridge_events_total";
    pub const DECODE_ERRORS: &str = "kvroute_bridge_decode_errors_total";
    pub const GAPS: &str = "kvroute_bridge_gaps_total";
    pub const REPLAYS: &str = "kvroute_bridge_replays_total";
    pub const CLEARED: &str = "kvroute_bridge_ranks_cleared_total";
    pub const INCARNATIONS: &str = "kvroute_bridge_incarnations_total";
    pub const INCARNATION_CHECKS: &str = "kvroute_bridge_incarnation_checks_total";
    pub const DUPLICATE_COPIES: &str = "kvroute_bridge_duplicate_copies_total";
    pub const IGNORED: &str = "kvroute_bridge_ignored_total";
    pub const MIRROR_BLOCKS: &str = "kvroute_bridge_mirror_blocks";
    pub const PUBLISH_SECONDS: &str = "kvroute_bridge_publish_seconds_sum";
    pub const PUBLISHED_BATCHES: &str = "kvroute_bridge_published_batches_total";
    pub const LOAD_POLLS: &str = "kvroute_bridge_load_polls_total";
    pub const HEALTH: &str = "kvroute_bridge_health_probes_total";
    pub const REGISTERED: &str = "kvroute_bridge_registered";
    pub const REQUESTS: &str = "kvroute_bridge_requests_total";
    pub const LOAD_REPORTS: &str = "kvroute_bridge_load_reports_total";
    pub const REGISTRATIONS: &str = "kvroute_bridge_registrations_total";
    pub const RESETS: &str = "kvroute_bridge_cache_resets_total";
    pub const EVENTS_MISSING: &str = "kvroute_bridge_events_missing_total";
}

fn help(name: &str) -> (&'static str, &'static str, &'static str) {
    use names::*;
    match name {
        BATCHES => (
            "Event batches received from the engine (live and replayed).",
            "counter",
            "",
        ),
        EVENTS => ("Engine events decoded, by type.", "counter", "type"),
        DECODE_ERRORS => (
            "Messages from the engine skipped as undecodable, by reason.",
            "counter",
            "reason",
        ),
        GAPS => ("Sequence gaps detected.", "counter", ""),
        REPLAYS => (
            "Replays from the engine, by outcome (ok, failed, not_covered, incomplete; hole: an answer with a hole, asked again).",
            "counter",
            "outcome",
        ),
        CLEARED => (
            "Times a rank was cleared: a gap that could not be replayed, or an undecodable batch.",
            "counter",
            "",
        ),
        INCARNATIONS => (
            "New engine incarnations seen (seq restarted, another batch where the last applied was, or found by an incarnation check).",
            "counter",
            "",
        ),
        INCARNATION_CHECKS => (
            "Checks, when the engine answers /health again after being deemed down, of whether it kept its cache, by result (same: its last batch came back unchanged and the mirror was kept; new: the rank was cleared).",
            "counter",
            "result",
        ),
        DUPLICATE_COPIES => (
            "Events about a second copy of a cached block, absorbed by copy counting.",
            "counter",
            "",
        ),
        IGNORED => (
            "Blocks or events not indexed, by reason.",
            "counter",
            "reason",
        ),
        MIRROR_BLOCKS => ("Blocks in the rank's mirror.", "gauge", ""),
        PUBLISH_SECONDS => (
            "Seconds from receiving an engine batch to handing kvroute's batch to the publisher, summed.",
            "counter",
            "",
        ),
        PUBLISHED_BATCHES => ("kvroute KvEventBatches published.", "counter", ""),
        LOAD_POLLS => (
            "Load polls of the engine, by outcome.",
            "counter",
            "outcome",
        ),
        HEALTH => (
            "Health probes of the engine, by outcome.",
            "counter",
            "outcome",
        ),
        REGISTERED => (
            "1 while the engine's card is registered in etcd.",
            "gauge",
            "",
        ),
        REQUESTS => (
            "GenerateRequests answered, by outcome (ok or the error code).",
            "counter",
            "outcome",
        ),
        LOAD_REPORTS => ("WorkerLoad reports published.", "counter", ""),
        REGISTRATIONS => (
            "Registration events, by kind (registered, recovered: registered again after being deemed down, deregistered, refused).",
            "counter",
            "event",
        ),
        RESETS => (
            "Cache resets forwarded to the engine, by outcome (ok, refused).",
            "counter",
            "outcome",
        ),
        EVENTS_MISSING => (
            "Load polls at which the engine had computed prompt tokens but no KV event batch had arrived from it (check --zmq-endpoint).",
            "counter",
            "",
        ),
        _ => ("", "counter", ""),
    }
}

impl BridgeMetrics {
    fn update(
        &self,
        name: &'static str,
        engine: &str,
        rank: Option<DpRank>,
        extra: &str,
        f: impl FnOnce(&mut f64),
    ) {
        let mut families = self.families.lock().expect("metrics lock");
        let family = families.entry(name).or_insert_with(|| {
            let (help, kind, extra) = help(name);
            Family {
                help,
                kind,
                extra,
                series: BTreeMap::new(),
            }
        });
        let key = (
            engine.to_string(),
            rank.map(|r| r.to_string()).unwrap_or_default(),
            extra.to_string(),
        );
        f(family.series.entry(key).or_default());
    }

    /// Adds `n` to a counter.
    pub fn add(&self, name: &'static str, engine: &str, rank: Option<DpRank>, extra: &str, n: u64) {
        self.update(name, engine, rank, extra, |v| *v += n as f64);
    }

    pub fn inc(&self, name: &'static str, engine: &str, rank: Option<DpRank>, extra: &str) {
        self.add(name, engine, rank, extra, 1);
    }

    pub fn add_f64(&self, name: &'static str, engine: &str, rank: Option<DpRank>, v: f64) {
        self.update(name, engine, rank, "", |x| *x += v);
    }

    pub fn set(&self, name: &'static str, engine: &str, rank: Option<DpRank>, v: f64) {
        self.update(name, engine, rank, "", |x| *x = v);
    }

    /// The current value (0 when never touched), for tests and `/status`.
    pub fn get(&self, name: &'static str, engine: &str, rank: Option<DpRank>, extra: &str) -> f64 {
        let families = self.families.lock().expect("metrics lock");
        let key = (
            engine.to_string(),
            rank.map(|r| r.to_string()).unwrap_or_default(),
            extra.to_string(),
        );
        families
            .get(name)
            .and_then(|f| f.series.get(&key))
            .copied()
            .unwrap_or(0.0)
    }

    /// The Prometheus text of every family.
    pub fn render(&self) -> String {
        let families = self.families.lock().expect("metrics lock");
        let mut out = String::new();
        for (name, family) in families.iter() {
            // OpenMetrics (the registry's format, which these lines join): a counter family is
            // named without its samples' `_total`; a counter without it is typed unknown.
            let (family_name, kind) = match (family.kind, name.strip_suffix("_total")) {
                ("counter", Some(stem)) => (stem, "counter"),
                ("counter", None) => (*name, "unknown"),
                (kind, _) => (*name, kind),
            };
            let _ = writeln!(
                out,
                "# HELP {family_name} {}\n# TYPE {family_name} {kind}",
                family.help.strip_suffix('.').unwrap_or(family.help)
            );
            for ((engine, rank, extra), value) in &family.series {
                let mut labels = format!("engine=\"{}\"", escape(engine));
                if !rank.is_empty() {
                    let _ = write!(labels, ",rank=\"{rank}\"");
                }
                if !family.extra.is_empty() {
                    let _ = write!(labels, ",{}=\"{}\"", family.extra, escape(extra));
                }
                let _ = writeln!(out, "{name}{{{labels}}} {value}");
            }
        }
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_engine_rank_and_reason_labels() {
        let m = BridgeMetrics::default();
        m.inc(names::DECODE_ERRORS, "e\"1", Some(1), "truncated");
        m.add(names::BATCHES, "e1", Some(0), "", 3);
        m.set(names::REGISTERED, "e1", None, 1.0);
        let text = m.render();
        assert!(text.contains("kvroute_bridge_decode_errors_total{engine=\"e\\\"1\",rank=\"1\",reason=\"truncated\"} 1"), "{text}");
        assert!(
            text.contains("kvroute_bridge_batches_total{engine=\"e1\",rank=\"0\"} 3"),
            "{text}"
        );
        assert!(
            text.contains(
                "# TYPE kvroute_bridge_registered gauge\nkvroute_bridge_registered{engine=\"e1\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kvroute_bridge_batches counter\n"),
            "{text}"
        );
        m.add(names::PUBLISH_SECONDS, "e1", None, "", 1);
        assert!(
            m.render()
                .contains("# TYPE kvroute_bridge_publish_seconds_sum unknown\n"),
            "{text}"
        );
        assert_eq!(m.get(names::BATCHES, "e1", Some(0), ""), 3.0);
    }
}
