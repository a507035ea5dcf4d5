//! The gateway's Prometheus metrics (README lists them): requests by endpoint, model and status;
//! time to first token, inter-token latency and end-to-end latency per model; tokenization and
//! selection time; upstream retries and failures; streams in flight; reservations.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds (100 µs .. 2 min).
const BOUNDS: [f64; 20] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];

#[derive(Debug, Clone, Default)]
struct Hist {
    buckets: [u64; BOUNDS.len()],
    count: u64,
    sum: f64,
}

impl Hist {
    fn observe(&mut self, secs: f64) {
        if let Some(i) = BOUNDS.iter().position(|b| secs <= *b) {
            self.buckets[i] += 1;
        }
        self.count += 1;
        self.sum += secs;
    }
}

/// Histograms keyed by one label value.
#[derive(Debug, Default)]
pub struct HistogramVec(Mutex<BTreeMap<String, Hist>>);

impl HistogramVec {
    pub fn observe(&self, label: &str, d: Duration) {
        let mut map = self.0.lock().expect("histogram lock");
        match map.get_mut(label) {
            Some(h) => h.observe(d.as_secs_f64()),
            None => {
                let mut h = Hist::default();
                h.observe(d.as_secs_f64());
                map.insert(label.to_owned(), h);
            }
        }
    }

    /// Observations so far under `label`.
    pub fn count(&self, label: &str) -> u64 {
        let map = self.0.lock().expect("histogram lock");
        map.get(label).map_or(0, |h| h.count)
    }

    fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (value, h) in self.0.lock().expect("histogram lock").iter() {
            let value = escape(value);
            let mut cumulative = 0;
            for (bound, n) in BOUNDS.iter().zip(h.buckets) {
                cumulative += n;
                let _ = writeln!(
                    out,
                    "{name}_bucket{{{label}=\"{value}\",le=\"{bound}\"}} {cumulative}"
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{{{label}=\"{value}\",le=\"+Inf\"}} {}\n\
                 {name}_sum{{{label}=\"{value}\"}} {}\n{name}_count{{{label}=\"{value}\"}} {}",
                h.count, h.sum, h.count
            );
        }
    }
}

/// Counters keyed by a tuple of label values.
#[derive(Debug, Default)]
pub struct CounterVec<const N: usize>(Mutex<BTreeMap<[String; N], u64>>);

impl<const N: usize> CounterVec<N> {
    pub fn inc(&self, labels: [&str; N]) {
        let key = labels.map(str::to_owned);
        *self.0.lock().expect("counter lock").entry(key).or_insert(0) += 1;
    }

    pub fn get(&self, labels: [&str; N]) -> u64 {
        let key = labels.map(str::to_owned);
        self.0
            .lock()
            .expect("counter lock")
            .get(&key)
            .copied()
            .unwrap_or(0)
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: [&str; N]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (values, n) in self.0.lock().expect("counter lock").iter() {
            let pairs: Vec<String> = labels
                .iter()
                .zip(values)
                .map(|(l, v)| format!("{l}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {n}", pairs.join(","));
        }
    }
}

pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Every metric of the process.
#[derive(Debug, Default)]
pub struct Metrics {
    /// (endpoint, model, status code).
    pub requests: CounterVec<3>,
    pub ttft: HistogramVec,
    pub itl: HistogramVec,
    pub e2e: HistogramVec,
    /// Per endpoint.
    pub tokenize: HistogramVec,
    /// Per model.
    pub select: HistogramVec,
    /// (reason): `connect`, `status_5xx`.
    pub retries: CounterVec<1>,
    /// (reason): why a forwarded request failed (`connect`, `send`, `status_5xx`, `timeout`,
    /// `worker_gone`, `mid_stream`, `idle_timeout`, `client_gone`).
    pub upstream_failures: CounterVec<1>,
    /// (protocol, result): disaggregated requests' attempts (`vllm`/`sglang`; `ok`,
    /// `prefill_failed`, `decode_failed`, `failed`).
    pub handoffs: CounterVec<2>,
    pub streams_in_flight: AtomicI64,
    pub in_flight: AtomicI64,
    pub reservations_held: AtomicI64,
    /// (outcome): `released`, `expired`, `released_elsewhere`.
    pub reservations_ended: CounterVec<1>,
    pub lifecycle_publish_errors: AtomicU64,
    /// Requests refused because the tokenize gate was full.
    pub tokenize_refused: AtomicU64,
    /// (model): answers whose engine counted other prompt tokens than the gateway (tokenizers
    /// that differ: routing then sees none of the engine's cache).
    pub prompt_token_mismatches: CounterVec<1>,
    /// A mismatch was logged at warn (once per process; later ones at debug).
    pub mismatch_warned: std::sync::atomic::AtomicBool,
    pub connections: ConnectionStats,
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.requests.render(
            &mut out,
            "kvroute_gateway_requests_total",
            "Requests answered, by endpoint, model and HTTP status.",
            ["endpoint", "model", "status"],
        );
        self.ttft.render(
            &mut out,
            "kvroute_gateway_ttft_seconds",
            "Arrival at the gateway to the engine's first response byte of a streamed request (its first token).",
            "model",
        );
        self.itl.render(
            &mut out,
            "kvroute_gateway_inter_token_seconds",
            "Time between consecutive streamed chunks (tokens) of a response.",
            "model",
        );
        self.e2e.render(
            &mut out,
            "kvroute_gateway_request_seconds",
            "Arrival at the gateway to the end of the response.",
            "model",
        );
        self.tokenize.render(
            &mut out,
            "kvroute_gateway_tokenize_seconds",
            "Rendering the chat template and tokenizing a prompt.",
            "endpoint",
        );
        self.select.render(
            &mut out,
            "kvroute_gateway_select_seconds",
            "Selecting a worker (kvroute routers over NATS, retries included).",
            "model",
        );
        self.retries.render(
            &mut out,
            "kvroute_gateway_upstream_retries_total",
            "Requests sent to a second worker after the first failed before its first byte.",
            ["reason"],
        );
        self.upstream_failures.render(
            &mut out,
            "kvroute_gateway_upstream_failures_total",
            "Forwarded requests that failed, by reason.",
            ["reason"],
        );
        self.handoffs.render(
            &mut out,
            "kvroute_gateway_disaggregated_attempts_total",
            "Attempts at a disaggregated request (prefill on one worker, decode on another), by hand-off protocol and result.",
            ["protocol", "result"],
        );
        self.prompt_token_mismatches.render(
            &mut out,
            "kvroute_gateway_prompt_token_mismatches_total",
            "Answers whose engine reported other usage.prompt_tokens than the gateway tokenized: the engine tokenizes differently (check the model folder given to --model), so routing cannot see its cache.",
            ["model"],
        );
        self.reservations_ended.render(
            &mut out,
            "kvroute_gateway_reservations_ended_total",
            "Reservations ended, by how.",
            ["outcome"],
        );
        for (name, help, value) in [
            (
                "kvroute_gateway_streams_in_flight",
                "Streamed responses being relayed.",
                self.streams_in_flight.load(Ordering::Relaxed),
            ),
            (
                "kvroute_gateway_requests_in_flight",
                "Forwarded requests not yet finished.",
                self.in_flight.load(Ordering::Relaxed),
            ),
            (
                "kvroute_gateway_reservations",
                "Reservations this replica holds.",
                self.reservations_held.load(Ordering::Relaxed),
            ),
            (
                "kvroute_gateway_connections",
                "Client connections open.",
                self.connections.open.load(Ordering::Relaxed) as i64,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        for (name, help, value) in [
            (
                "kvroute_gateway_lifecycle_publish_errors_total",
                "Lifecycle events that could not be published.",
                &self.lifecycle_publish_errors,
            ),
            (
                "kvroute_gateway_tokenize_refused_total",
                "Requests refused (503 tokenizer_busy) because every tokenizing turn and queue place was taken.",
                &self.tokenize_refused,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        let name = "kvroute_gateway_connections_closed_total";
        let _ = writeln!(
            out,
            "# HELP {name} Client connections the gateway closed to protect itself, by reason.\n# TYPE {name} counter"
        );
        for (reason, value) in [
            ("evicted", &self.connections.evicted),
            ("refused", &self.connections.refused),
            ("timeout", &self.connections.timed_out),
        ] {
            let _ = writeln!(
                out,
                "{name}{{reason=\"{reason}\"}} {}",
                value.load(Ordering::Relaxed)
            );
        }
        out
    }
}

/// Connection counts for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    pub open: AtomicUsize,
    /// Idle connections closed to make room for a new one.
    pub evicted: AtomicU64,
    /// Connections closed at once (every connection busy and the health reserve full).
    pub refused: AtomicU64,
    /// Connections closed for a head, an idle period or a blocked write past its timeout.
    pub timed_out: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labelled_series() {
        let m = Metrics::default();
        m.requests.inc(["chat", "m\"x", "200"]);
        m.requests.inc(["chat", "m\"x", "200"]);
        m.ttft.observe("m", Duration::from_millis(3));
        m.retries.inc(["connect"]);
        let text = m.render();
        assert!(
            text.contains(
                "kvroute_gateway_requests_total{endpoint=\"chat\",model=\"m\\\"x\",status=\"200\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains("kvroute_gateway_ttft_seconds_bucket{model=\"m\",le=\"0.0025\"} 0"));
        assert!(text.contains("kvroute_gateway_ttft_seconds_bucket{model=\"m\",le=\"0.005\"} 1"));
        assert!(text.contains("kvroute_gateway_ttft_seconds_count{model=\"m\"} 1"));
        assert!(text.contains("kvroute_gateway_upstream_retries_total{reason=\"connect\"} 1"));
        assert!(text.contains("kvroute_gateway_streams_in_flight 0"));
        assert_eq!(m.requests.get(["chat", "m\"x", "200"]), 2);
    }
}
