//! The human summary of a [`RunReport`]: the setup and oracles, one row per mode, and the
//! errors by kind.

use std::fmt::Write as _;

use super::report::RunReport;

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// `part / whole` as a percentage, or `-` without a bound.
fn of_bound(part: f64, whole: f64) -> String {
    if whole > 0.0 {
        pct(part / whole)
    } else {
        "-".into()
    }
}

/// A speedup as people write it: `20×`, `1409×`, `2.5×`.
fn speedup(x: f64) -> String {
    if x >= 100.0 || x.fract() == 0.0 {
        format!("{x:.0}×")
    } else {
        format!("{x:.1}×")
    }
}

/// The columns of the mode rows: name and width (the whole row fits 120 columns).
const COLUMNS: [(&str, usize); 15] = [
    ("mode", 12),
    ("done", 6),
    ("errors", 6),
    ("hit", 6),
    ("/fin", 6),
    ("ttft p50", 8),
    ("p90", 7),
    ("p99", 7),
    ("e2e p50", 8),
    ("p99", 7),
    ("req/s", 6),
    ("tok/s", 6),
    ("cv", 5),
    ("sel p50", 7),
    ("p99", 7),
];

/// Renders the report as a fixed-width table (at most 120 columns), with a closing line on what
/// KV-aware routing gained when the run has `kv` and `round-robin`.
pub fn render_table(report: &RunReport) -> String {
    let mut out = String::new();
    let o = &report.oracle;
    let _ = writeln!(
        out,
        "trace {} — {} requests on {} workers × {} blocks of {} tokens, {} speed",
        std::path::Path::new(&report.trace)
            .file_name()
            .map_or(report.trace.as_str().into(), |n| n.to_string_lossy()),
        report.requests,
        report.workers,
        report.blocks_per_worker,
        report.block_size,
        speedup(report.speedup)
    );
    let _ = writeln!(
        out,
        "oracle hit rate (blocks): infinite {}, finite (one LRU of {} blocks) {}",
        pct(o.infinite),
        o.capacity_blocks,
        pct(o.finite)
    );
    if let Some(f) = &report.ttft_floor_ms {
        let _ = writeln!(
            out,
            "TTFT floor (each request alone on an idle worker, finite oracle's prefix cached): \
             p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms",
            f.p50, f.p90, f.p99
        );
    }
    out.push('\n');
    let row = |cells: &[String]| {
        let mut line = String::new();
        for (i, (cell, (_, w))) in cells.iter().zip(COLUMNS).enumerate() {
            if i == 0 {
                let _ = write!(line, "{cell:<w$}");
            } else {
                let _ = write!(line, " {cell:>w$}");
            }
        }
        line
    };
    let _ = writeln!(out, "{}", row(&COLUMNS.map(|(name, _)| name.to_owned())));
    for m in &report.modes {
        let ms = |x: f64| format!("{x:.0}");
        let cells = [
            m.mode.clone(),
            m.completed.to_string(),
            m.errors.to_string(),
            pct(m.hit_rate),
            of_bound(m.hit_rate, o.finite),
            ms(m.ttft_ms.p50),
            ms(m.ttft_ms.p90),
            ms(m.ttft_ms.p99),
            ms(m.e2e_latency_ms.p50),
            ms(m.e2e_latency_ms.p99),
            format!("{:.1}", m.requests_per_s),
            format!("{:.0}", m.output_tokens_per_s),
            format!("{:.2}", m.load_cv_requests),
            format!("{:.0}", m.selection_latency_us.p50),
            format!("{:.0}", m.selection_latency_us.p99),
        ];
        let _ = writeln!(out, "{}", row(&cells));
    }
    let _ = writeln!(
        out,
        "hit: prompt tokens found cached; /fin: of the finite oracle's; ttft, e2e: ms of simulated \
         time;\nreq/s, tok/s: requests and output tokens per simulated second; cv: spread of \
         requests over workers;\nsel: the selection in µs of wall clock, {}",
        report.selection_measured.describe()
    );
    if report.modes.iter().any(|m| m.hits_from_engines) {
        let _ = writeln!(
            out,
            "hit: read from the engines' own prefix-cache counters on the workers that compute \
             prompts (prefill and aggregated), over the mode"
        );
    }
    // The client's view of TTFT, when selections waited (a router's admission queue).
    if report
        .modes
        .iter()
        .any(|m| m.client_ttft_ms.p99 > m.ttft_ms.p99 + 1.0)
    {
        let _ = writeln!(
            out,
            "TTFT as clients saw it (selection wait × speedup + the worker's; ms, simulated):"
        );
        for m in &report.modes {
            let t = &m.client_ttft_ms;
            let _ = writeln!(
                out,
                "  {:<12} p50 {:.1}  p90 {:.1}  p99 {:.1}",
                m.mode, t.p50, t.p90, t.p99
            );
        }
    }
    render_adapters(&mut out, report);
    render_streams(&mut out, report);
    render_sessions(&mut out, report);
    for m in report.modes.iter().filter(|m| m.errors > 0) {
        let kinds: Vec<String> = m
            .errors_by_kind
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let _ = writeln!(out, "errors in {}: {}", m.mode, kinds.join(", "));
    }
    for m in report.modes.iter().filter(|m| m.not_sent > 0) {
        let _ = writeln!(
            out,
            "stopped in {}: {} of {} requests not sent",
            m.mode,
            m.not_sent,
            m.completed + m.errors + m.not_sent
        );
    }
    if let Some(line) = gain(report) {
        let _ = writeln!(out, "\n{line}");
    }
    out
}

/// What KV-aware routing gained over round-robin in this run: hit rate, TTFT p90, and kv's share
/// of the finite oracle; `None` without both modes.
fn gain(report: &RunReport) -> Option<String> {
    let mode = |name: &str| {
        report
            .modes
            .iter()
            .find(|m| m.mode == name && m.completed > 0)
    };
    let (kv, rr) = (mode("kv")?, mode("round-robin")?);
    let ttft = if rr.ttft_ms.p90 > 0.0 {
        format!("{:.2}×", kv.ttft_ms.p90 / rr.ttft_ms.p90)
    } else {
        "-".to_owned()
    };
    Some(format!(
        "KV-aware routing (kv) against round-robin: hit rate {} vs {}, TTFT p90 {:.0} vs {:.0} ms \
         ({ttft});\nkv reaches {} of the finite oracle's hit rate (one LRU cache as large as all \
         the workers' together)",
        pct(kv.hit_rate),
        pct(rr.hit_rate),
        kv.ttft_ms.p90,
        rr.ttft_ms.p90,
        of_bound(kv.hit_rate, report.oracle.finite)
    ))
}

/// LoRA adapter loads, when the workers model adapter slots (`kvroute-sim --max-loras`).
fn render_adapters(out: &mut String, report: &RunReport) {
    for m in &report.modes {
        if let Some(loads) = m.adapter_loads {
            let requests = (m.completed + m.errors).max(1);
            let _ = writeln!(
                out,
                "  {:<12} adapter loads {loads} ({:.1} per 1,000 requests)",
                m.mode,
                loads as f64 * 1000.0 / requests as f64
            );
        }
    }
}

/// Inter-token latency and, on a fleet with prefill and decode workers, how requests were
/// paired (`kvroute-sim`, and a replay through the gateway).
fn render_streams(out: &mut String, report: &RunReport) {
    if report.modes.iter().all(|m| m.itl_ms.is_none()) {
        return;
    }
    let _ = writeln!(
        out,
        "inter-token latency (ms, simulated), and disaggregation:"
    );
    for m in &report.modes {
        let mut line = format!("  {:<12}", m.mode);
        if let Some(t) = &m.itl_ms {
            let _ = write!(
                line,
                " itl mean {:.1}  p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.0}",
                t.mean, t.p50, t.p90, t.p99, t.max
            );
        }
        if let Some(d) = &m.disaggregation {
            let _ = write!(
                line,
                "\n    {} on {} prefill + {} decode: {} paired, {} by the prefill worker alone",
                d.mode, d.prefill_workers, d.decode_workers, d.paired, d.unpaired,
            );
            if d.transfer_ms.count > 0 {
                let _ = write!(
                    line,
                    "; paired: prefill done p50 {:.0} / p90 {:.0} ms, transfer p50 {:.1} / p99 {:.1} ms",
                    d.prefill_ms.p50, d.prefill_ms.p90, d.transfer_ms.p50, d.transfer_ms.p99,
                );
            }
            let _ = write!(line, ", decode cv {:.2}", d.load_cv_decode_requests);
        }
        let _ = writeln!(out, "{line}");
    }
}

/// The session rows, when the trace has sessions: stickiness (mean share of a session's turns
/// on its most-used worker), sessions on one worker, and the later turns' hit rate against
/// the finite oracle's on the same turns.
fn render_sessions(out: &mut String, report: &RunReport) {
    let rows: Vec<_> = report
        .modes
        .iter()
        .filter_map(|m| Some((m, m.sessions.as_ref()?)))
        .collect();
    let Some((_, first)) = rows.first() else {
        return;
    };
    let oracle = report.session_oracle.as_ref().and_then(|o| o.finite);
    let opt = |x: Option<f64>| x.map_or_else(|| "-".to_owned(), pct);
    let _ = writeln!(
        out,
        "\nsessions: {} of 2+ completed turns; later turns (after a session's first): finite \
         oracle {}",
        first.sessions,
        opt(oracle)
    );
    let _ = writeln!(
        out,
        "{:<12} {:>5} {:>7} {:>10} {:>9} {:>6}",
        "mode", "sent", "sticky", "one worker", "later hit", "/fin"
    );
    for (m, s) in rows {
        let of_oracle = match (s.later_hit_rate, oracle) {
            (Some(hit), Some(fin)) => of_bound(hit, fin),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "{:<12} {:>5} {:>7} {:>10} {:>9} {:>6}",
            m.mode,
            if s.sent { "yes" } else { "no" },
            opt(s.stickiness),
            opt(s.single_worker),
            opt(s.later_hit_rate),
            of_oracle
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::replay::oracle::OracleHitRates;
    use crate::replay::report::{ModeRecorder, ModeReport, RequestSample};
    use crate::replay::sessions::SessionOracle;

    /// A two-request run on two workers with these modes (and session figures).
    fn report(session_oracle: Option<SessionOracle>, modes: Vec<ModeReport>) -> RunReport {
        RunReport {
            trace: "t.jsonl".into(),
            requests: 2,
            workers: 2,
            block_size: 64,
            blocks_per_worker: 100,
            speedup: 10.0,
            ttft_floor_ms: None,
            session_oracle,
            selection_measured: Default::default(),
            oracle: OracleHitRates {
                block_size: 64,
                capacity_blocks: 200,
                total_blocks: 4,
                infinite_hit_blocks: 2,
                finite_hit_blocks: 1,
                infinite: 0.5,
                finite: 0.25,
            },
            modes,
        }
    }
    #[test]
    fn one_row_per_mode_and_errors_listed() {
        let mode = |name: &str, cached: u64, error: Option<&str>| {
            let mut r = ModeRecorder::new(name, [1, 2]);
            r.record(RequestSample {
                request: 0,
                worker_id: 1,
                prompt_tokens: 100,
                cached_tokens: cached,
                output_tokens: 5,
                ttft: Duration::from_millis(12),
                latency: Duration::from_millis(80),
                selection_latency: Some(Duration::from_micros(300)),
                selection_wait: Duration::ZERO,
            });
            if let Some(kind) = error {
                r.record_error(kind);
            }
            r.finish(Duration::from_secs(1))
        };
        let report = report(
            None,
            vec![
                mode("kv", 25, None),
                mode("round-robin", 0, Some("worker_timeout")),
            ],
        );
        let text = render_table(&report);
        let kv = text.lines().find(|l| l.starts_with("kv ")).unwrap();
        assert!(kv.contains("25.0%") && kv.contains("100.0%"), "{text}");
        assert!(kv.contains(" 12 ") && kv.contains("300"), "{text}");
        assert!(
            text.lines().all(|l| l.chars().count() <= 120),
            "wider than 120 columns:\n{text}"
        );
        assert!(text.contains(", 10× speed"), "{text}");
        assert!(
            text.contains(
                "KV-aware routing (kv) against round-robin: hit rate 25.0% vs 0.0%, TTFT p90 12 vs \
                 12 ms (1.00×);\nkv reaches 100.0% of the finite oracle's hit rate"
            ),
            "{text}"
        );
        assert!(
            text.contains("sel: the selection in µs of wall clock, the client's round trip"),
            "{text}"
        );
        assert!(
            text.contains("errors in round-robin: worker_timeout 1"),
            "{text}"
        );
        assert!(text.contains("infinite 50.0%"), "{text}");
        assert!(
            !text.contains("sessions:"),
            "no sessions in the trace: {text}"
        );
    }

    #[test]
    fn a_trace_with_sessions_gets_session_rows() {
        use kvroute_common::trace::TraceRequest;

        use crate::replay::sessions::SessionKeys;
        let row = |turn: u32| TraceRequest {
            input_length: 100,
            session_id: Some("a".into()),
            turn: Some(turn),
            ..TraceRequest::default()
        };
        let keys = SessionKeys::of(&[row(1), row(2)]);
        let mode = |name: &str, workers: [u64; 2], sent: bool| {
            let mut r = ModeRecorder::new(name, [1, 2]).with_sessions(keys.clone(), sent);
            for (request, worker_id) in workers.into_iter().enumerate() {
                r.record(RequestSample {
                    request,
                    worker_id,
                    prompt_tokens: 100,
                    cached_tokens: 45 * request as u64,
                    output_tokens: 5,
                    ttft: Duration::from_millis(12),
                    latency: Duration::from_millis(80),
                    selection_latency: None,
                    selection_wait: Duration::ZERO,
                });
            }
            r.finish(Duration::from_secs(1))
        };
        let report = report(
            Some(SessionOracle {
                later_turn_blocks: 10,
                finite_hit_blocks: 5,
                finite: Some(0.5),
            }),
            vec![mode("kv", [1, 1], true), mode("random", [1, 2], false)],
        );
        let text = render_table(&report);
        assert!(text.contains("finite oracle 50.0%"), "{text}");
        let line = |name: &str| {
            text.lines()
                .rev()
                .find(|l| l.starts_with(name))
                .unwrap()
                .split_whitespace()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            line("kv"),
            ["kv", "yes", "100.0%", "100.0%", "45.0%", "90.0%"]
        );
        assert_eq!(
            line("random"),
            ["random", "no", "50.0%", "0.0%", "45.0%", "90.0%"]
        );
    }
}
