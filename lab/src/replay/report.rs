//! The report of a replay run: per routing mode, cache hits against the oracles, latency
//! distributions, throughput, load spread, errors and, for a trace with sessions, session
//! stickiness. Built by [`ModeRecorder`], written as JSON by the replay tool.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_common::WorkerId;
use serde::{Deserialize, Serialize};

use super::oracle::{OracleHitRates, ratio};
use super::sessions::{ServedTurn, SessionKeys, SessionOracle, SessionRecorder, SessionReport};
use super::stats::{Summary, coefficient_of_variation};

/// A whole run: the setup, the oracles (the same for every mode) and one entry per mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// The trace file (as given).
    pub trace: String,
    /// Requests replayed from it.
    pub requests: u64,
    pub workers: u32,
    pub block_size: u32,
    pub blocks_per_worker: u64,
    /// Simulated seconds per real second.
    pub speedup: f64,
    pub oracle: OracleHitRates,
    /// TTFT if every request ran alone on an idle worker with the finite oracle's cached
    /// prefix (simulated ms; known when the workers' engine model is: `kvroute-sim`, or
    /// kvroute-mocker workers whose cards carry it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_floor_ms: Option<Summary>,
    /// The finite oracle on the turns after a session's first (a trace with sessions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_oracle: Option<SessionOracle>,
    /// What the modes' `selection_latency_us` measured.
    #[serde(default)]
    pub selection_measured: SelectionMeasured,
    pub modes: Vec<ModeReport>,
}

/// What a report's selection latency is the time of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionMeasured {
    /// `kvroute-replay`: the client's round trip through NATS to a router and back (the
    /// router's own decision is part of it; its `kvroute_router_selection_seconds` has it alone).
    #[default]
    NatsRoundTrip,
    /// `kvroute-sim`: the decision alone, in process (no network).
    InProcess,
    /// `kvroute-replay --selector gateway`: the gateway selects; the client does not see it
    /// apart (its time is in the TTFT).
    InGateway,
}

impl SelectionMeasured {
    /// The table's note on the column.
    pub fn describe(self) -> &'static str {
        match self {
            Self::NatsRoundTrip => "the client's round trip through NATS to a router and back",
            Self::InProcess => "the decision alone, in process (no network)",
            Self::InGateway => "not measured apart: the gateway selects, within the TTFT",
        }
    }
}

impl RunReport {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serializes")
    }

    /// Whether every mode stayed within `max_fraction` failed requests (selection failures and
    /// worker failures: every request that did not complete, [`ModeReport::errors`]).
    pub fn check_errors(&self, max_fraction: f64) -> Result<(), TooManyErrors> {
        let failed: Vec<String> = self
            .modes
            .iter()
            .filter(|m| {
                let requests = m.completed + m.errors;
                requests > 0 && m.errors as f64 > max_fraction * requests as f64
            })
            .map(|m| {
                let kinds: Vec<String> = m
                    .errors_by_kind
                    .iter()
                    .map(|(kind, n)| format!("{kind} {n}"))
                    .collect();
                format!(
                    "mode {}: {} of {} requests failed ({})",
                    m.mode,
                    m.errors,
                    m.completed + m.errors,
                    kinds.join(", ")
                )
            })
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(TooManyErrors {
                max_fraction,
                modes: failed,
            })
        }
    }
}

/// A run in which some mode failed more than `--max-error-fraction` of its requests.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the run failed: {}, above --max-error-fraction {max_fraction}", modes.join("; "))]
pub struct TooManyErrors {
    pub max_fraction: f64,
    /// One line per failed mode: how many of its requests failed, by kind.
    pub modes: Vec<String>,
}

/// How one routing mode did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModeReport {
    /// The mode's name (e.g. `round_robin`, `kv_aware`).
    pub mode: String,
    pub completed: u64,
    pub errors: u64,
    /// Requests never sent: the run was stopped (SIGTERM / Ctrl-C) before their arrival. They
    /// are neither completed nor errors.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub not_sent: u64,
    /// Errors by kind.
    pub errors_by_kind: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub output_tokens: u64,
    /// `cached_prompt_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// The three fields above are the engines' own prefix-cache counters over the mode (the
    /// prefill and aggregated workers': where prompts are computed), not the answers' usage
    /// (`kvroute-replay --selector gateway`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub hits_from_engines: bool,
    pub ttft_ms: Summary,
    /// Time to first token as the client sees it: the selection's wait in simulated time (the
    /// real wait × the speedup — a router's admission queue counts here) plus the worker's
    /// `ttft_ms`.
    #[serde(default)]
    pub client_ttft_ms: Summary,
    pub e2e_latency_ms: Summary,
    /// Time the router took to answer a selection (real time, not simulated), retries
    /// included.
    pub selection_latency_us: Summary,
    /// Selection attempts beyond the first (a router did not answer in time, or was not
    /// ready), over the completed requests.
    #[serde(default)]
    pub selection_retries: u64,
    /// Simulated seconds from the first arrival to the last completion.
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Coefficient of variation of requests per worker.
    pub load_cv_requests: f64,
    /// Coefficient of variation of prompt tokens actually computed (uncached) per worker.
    pub load_cv_prefill_tokens: f64,
    /// Session stickiness and the later turns' hit rate (a trace with sessions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<SessionReport>,
    /// Inter-token latency: every gap between two consecutive tokens of a completed request's
    /// stream, from its first token to its last, in simulated ms (`kvroute-sim`, and
    /// `kvroute-replay --selector gateway`, which reads the streams).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_ms: Option<Summary>,
    /// LoRA adapters the workers loaded into a slot over the mode (`kvroute-sim` with
    /// `--max-loras`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter_loads: Option<u64>,
    /// How a fleet with prefill and decode workers served the requests (`kvroute-sim`, and
    /// `kvroute-replay --selector gateway` from the gateway's answer headers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disaggregation: Option<DisaggregationReport>,
}

/// A disaggregated fleet's requests: paired (prefill on a prefill worker, KV transfer, decode
/// on a decode worker) or served end to end by their prefill worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisaggregationReport {
    /// The rule's mode: `never`, `always` or `conditional`.
    pub mode: String,
    pub prefill_workers: u32,
    pub decode_workers: u32,
    /// Completed requests that had a decode hop.
    pub paired: u64,
    /// Completed requests served by their prefill worker alone (the rule said no, or no
    /// decode worker could take them).
    pub unpaired: u64,
    /// Paired requests' KV transfer, simulated ms (`kvroute-sim`; a client does not see it:
    /// count 0).
    pub transfer_ms: Summary,
    /// Paired requests: from arrival to the prefill worker's end (its one token), simulated ms
    /// (`kvroute-sim`; count 0 from a client).
    pub prefill_ms: Summary,
    /// Coefficient of variation of requests decoded per decode worker.
    pub load_cv_decode_requests: f64,
}

/// One completed request, as the replay tool saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestSample {
    /// The request's index in the plan.
    pub request: usize,
    pub worker_id: WorkerId,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// Simulated time to first token.
    pub ttft: Duration,
    /// Simulated end-to-end latency.
    pub latency: Duration,
    /// Real time the selection took, when the mode asked a router.
    pub selection_latency: Option<Duration>,
    /// The selection's wait in simulated time (zero where selection takes no simulated time).
    pub selection_wait: Duration,
}

/// Collects one mode's samples and errors, then [`ModeRecorder::finish`]es into a report.
#[derive(Debug, Clone)]
pub struct ModeRecorder {
    mode: String,
    ttft_ms: Vec<f64>,
    client_ttft_ms: Vec<f64>,
    e2e_ms: Vec<f64>,
    selection_us: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    output_tokens: u64,
    /// Per worker: (requests, uncached prompt tokens). Seeded with every worker so an idle
    /// one counts in the spread.
    per_worker: BTreeMap<WorkerId, (u64, u64)>,
    errors: BTreeMap<String, u64>,
    not_sent: u64,
    selection_retries: u64,
    sessions: Option<SessionRecorder>,
    /// Inter-token gaps, simulated ms (drivers that see the stream).
    itl_ms: Vec<f64>,
}

impl ModeRecorder {
    pub fn new(mode: impl Into<String>, workers: impl IntoIterator<Item = WorkerId>) -> Self {
        Self {
            mode: mode.into(),
            ttft_ms: Vec::new(),
            client_ttft_ms: Vec::new(),
            e2e_ms: Vec::new(),
            selection_us: Vec::new(),
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens: 0,
            per_worker: workers.into_iter().map(|w| (w, (0, 0))).collect(),
            errors: BTreeMap::new(),
            not_sent: 0,
            selection_retries: 0,
            sessions: None,
            itl_ms: Vec::new(),
        }
    }

    /// Also reports session figures, when the plan has sessions (`keys`); `sent`: whether the
    /// requests carried them.
    pub fn with_sessions(mut self, keys: Option<SessionKeys>, sent: bool) -> Self {
        self.sessions = keys.map(|k| SessionRecorder::new(k, sent));
        self
    }

    pub fn record(&mut self, s: RequestSample) {
        self.ttft_ms.push(s.ttft.as_secs_f64() * 1e3);
        self.client_ttft_ms
            .push((s.ttft + s.selection_wait).as_secs_f64() * 1e3);
        self.e2e_ms.push(s.latency.as_secs_f64() * 1e3);
        if let Some(sel) = s.selection_latency {
            self.selection_us.push(sel.as_secs_f64() * 1e6);
        }
        self.prompt_tokens += s.prompt_tokens;
        self.cached_tokens += s.cached_tokens;
        self.output_tokens += s.output_tokens;
        let w = self.per_worker.entry(s.worker_id).or_default();
        w.0 += 1;
        w.1 += s.prompt_tokens.saturating_sub(s.cached_tokens);
        if let Some(sessions) = &mut self.sessions {
            sessions.record(ServedTurn {
                request: s.request,
                worker_id: s.worker_id,
                prompt_tokens: s.prompt_tokens,
                cached_tokens: s.cached_tokens,
            });
        }
    }

    /// Adds a completed request's inter-token gaps (simulated ms).
    pub fn record_itl(&mut self, gaps_ms: &[f64]) {
        self.itl_ms.extend_from_slice(gaps_ms);
    }

    /// Counts selection attempts beyond the first.
    pub fn record_selection_retries(&mut self, retries: u32) {
        self.selection_retries += u64::from(retries);
    }

    /// Counts a request that failed (selection error, rejected by the worker, timed out...).
    pub fn record_error(&mut self, kind: &str) {
        *self.errors.entry(kind.to_owned()).or_default() += 1;
    }

    /// Counts a request the run was stopped before sending.
    pub fn record_not_sent(&mut self) {
        self.not_sent += 1;
    }

    /// `duration`: simulated time from the first arrival to the last completion.
    pub fn finish(self, duration: Duration) -> ModeReport {
        let secs = duration.as_secs_f64();
        let per_s = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let requests: Vec<f64> = self.per_worker.values().map(|w| w.0 as f64).collect();
        let prefill: Vec<f64> = self.per_worker.values().map(|w| w.1 as f64).collect();
        let completed = self.ttft_ms.len() as u64;
        ModeReport {
            mode: self.mode,
            completed,
            errors: self.errors.values().sum(),
            errors_by_kind: self.errors,
            not_sent: self.not_sent,
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: self.cached_tokens,
            output_tokens: self.output_tokens,
            hit_rate: ratio(self.cached_tokens, self.prompt_tokens),
            hits_from_engines: false,
            ttft_ms: Summary::of(&self.ttft_ms),
            client_ttft_ms: Summary::of(&self.client_ttft_ms),
            e2e_latency_ms: Summary::of(&self.e2e_ms),
            selection_latency_us: Summary::of(&self.selection_us),
            selection_retries: self.selection_retries,
            duration_s: secs,
            requests_per_s: per_s(completed),
            output_tokens_per_s: per_s(self.output_tokens),
            load_cv_requests: coefficient_of_variation(&requests),
            load_cv_prefill_tokens: coefficient_of_variation(&prefill),
            sessions: self.sessions.map(SessionRecorder::finish),
            itl_ms: (!self.itl_ms.is_empty()).then(|| Summary::of(&self.itl_ms)),
            adapter_loads: None,
            disaggregation: None,
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(worker_id: WorkerId, cached_tokens: u64, ttft_ms: u64) -> RequestSample {
        RequestSample {
            request: 0,
            worker_id,
            prompt_tokens: 100,
            cached_tokens,
            output_tokens: 10,
            ttft: Duration::from_millis(ttft_ms),
            latency: Duration::from_millis(ttft_ms + 100),
            selection_latency: Some(Duration::from_micros(250)),
            selection_wait: Duration::ZERO,
        }
    }

    #[test]
    fn a_mode_report_adds_up_and_serializes() {
        let mut r = ModeRecorder::new("kv_aware", [1, 2, 3]);
        r.record(sample(1, 50, 10));
        r.record(sample(1, 0, 30));
        r.record(sample(2, 100, 20));
        r.record_error("all_overloaded");
        let m = r.finish(Duration::from_secs(2));
        assert_eq!((m.completed, m.errors), (3, 1));
        assert!((m.hit_rate - 0.5).abs() < 1e-12);
        assert_eq!(m.ttft_ms.p50, 20.0);
        assert_eq!(m.e2e_latency_ms.max, 130.0);
        assert_eq!(m.selection_latency_us.p99, 250.0);
        assert_eq!((m.requests_per_s, m.output_tokens_per_s), (1.5, 15.0));
        // Requests per worker 2, 1, 0: idle worker 3 counts.
        assert!(m.load_cv_requests > 0.8);

        let report = RunReport {
            trace: "t.jsonl".into(),
            requests: 4,
            workers: 3,
            block_size: 64,
            blocks_per_worker: 1024,
            speedup: 10.0,
            oracle: OracleHitRates {
                block_size: 64,
                capacity_blocks: 3072,
                total_blocks: 6,
                infinite_hit_blocks: 3,
                finite_hit_blocks: 3,
                infinite: 0.5,
                finite: 0.5,
            },
            ttft_floor_ms: None,
            session_oracle: None,
            selection_measured: SelectionMeasured::NatsRoundTrip,
            modes: vec![m],
        };
        let json = report.to_json();
        assert!(json.contains("\"hit_rate\": 0.5"), "{json}");
        let back: RunReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back, report);
    }

    fn report_of(modes: Vec<ModeReport>) -> RunReport {
        RunReport {
            trace: "t.jsonl".into(),
            requests: 0,
            workers: 1,
            block_size: 64,
            blocks_per_worker: 1024,
            speedup: 1.0,
            oracle: OracleHitRates {
                block_size: 64,
                capacity_blocks: 1024,
                total_blocks: 0,
                infinite_hit_blocks: 0,
                finite_hit_blocks: 0,
                infinite: 0.0,
                finite: 0.0,
            },
            ttft_floor_ms: None,
            session_oracle: None,
            selection_measured: SelectionMeasured::NatsRoundTrip,
            modes,
        }
    }

    fn mode(name: &str, completed: u64, errors: &[(&str, u64)]) -> ModeReport {
        let mut r = ModeRecorder::new(name, [1]);
        for _ in 0..completed {
            r.record(sample(1, 0, 10));
        }
        for (kind, n) in errors {
            for _ in 0..*n {
                r.record_error(kind);
            }
        }
        r.finish(Duration::from_secs(1))
    }

    #[test]
    fn a_run_fails_when_a_mode_fails_more_than_the_threshold() {
        let all_failed = report_of(vec![mode("kv", 0, &[("select_no_router", 20)])]);
        let err = all_failed.check_errors(0.01).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the run failed: mode kv: 20 of 20 requests failed (select_no_router 20), above --max-error-fraction 0.01"
        );
        // Selection and worker failures both count; one mode is enough.
        let mixed = report_of(vec![
            mode("kv", 100, &[]),
            mode(
                "random",
                97,
                &[("select_all_overloaded", 1), ("worker_timeout", 2)],
            ),
        ]);
        let err = mixed.check_errors(0.02).unwrap_err();
        assert_eq!(err.modes.len(), 1, "{err}");
        assert!(err.modes[0].starts_with("mode random: 3 of 100"), "{err}");
        assert!(
            mixed.check_errors(0.03).is_ok(),
            "at the threshold is within it"
        );
        assert!(all_failed.check_errors(1.0).is_ok());
        assert!(
            report_of(vec![mode("kv", 5, &[])])
                .check_errors(0.0)
                .is_ok()
        );
    }
}
