//! The results: plain tables on stdout, and the same figures as JSON (`--json`).

use std::process::Command;

use serde_json::{Value, json};

use crate::Args;
use crate::latency::Row;
use crate::stack::{Stack, Target};
use crate::stats::{Samples, fmt_us, minus};
use crate::throughput::Window;

/// The gateway's target: added p99 beyond tokenization at the longest prompt, in µs.
const ADDED_P99_TARGET_US: f64 = 1000.0;
/// The gateway's target: its streamed throughput over the bare proxy's.
const THROUGHPUT_RATIO_TARGET: f64 = 0.70;

/// Everything measured, as it comes.
#[derive(Debug)]
pub struct Report {
    setup: Value,
    targets: Vec<Target>,
    accounts: Vec<String>,
    rows: Vec<(Row, Option<Samples>)>,
    windows: Vec<Window>,
}

fn shell(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .current_dir(kvroute_tests::workspace_root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_default()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn pair(a: Option<f64>, b: Option<f64>) -> String {
    format!("{} / {}", fmt_us(a), fmt_us(b))
}

fn samples_json(s: &Samples) -> Value {
    json!({"n": s.len(), "p50_us": s.p50(), "p99_us": s.p99(), "mean_us": s.mean_us()})
}

impl Report {
    pub fn new(args: &Args, stack: &Stack, pin: bool, nproc: usize) -> Self {
        let setup = json!({
            "date_utc": shell("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]),
            "commit": shell("git", &["rev-parse", "--short", "HEAD"]),
            "nproc": nproc,
            "gateway_bin": args.gateway_bin.as_ref().map(|d| d.display().to_string()),
            "cpu_model": cpu_model(),
            "loadavg_start": loadavg(),
            "pinned": pin,
            "model": stack.model,
            "model_dir": args.model_dir.as_ref().map(|d| d.display().to_string()),
            "prompts": if args.model_dir.is_some() { "text" } else { "token ids" },
            "workers": args.workers,
            "output_tokens": args.output_tokens,
            "latency_rounds": args.latency_rounds,
            "streams": args.streams,
            "throughput_prompt_tokens": args.throughput_prompt_tokens,
            "throughput_secs": args.throughput_secs,
            "rounds": args.rounds,
            "router_args": args.router_args,
            "gateway_args": args.gateway_args,
            "nginx": stack.nginx.is_some(),
        });
        println!(
            "kvroute-gateway-bench: {} · {} × {} · load {} · commit {} · {} · prompts as {} (model {}) · {} workers · {} output tokens",
            setup["date_utc"].as_str().unwrap_or(""),
            setup["nproc"],
            setup["cpu_model"].as_str().unwrap_or(""),
            setup["loadavg_start"].as_str().unwrap_or(""),
            setup["commit"].as_str().unwrap_or(""),
            if pin {
                "latency unpinned; throughput: proxy under test on CPU 1, everything else on CPU 0"
            } else {
                "not pinned"
            },
            setup["prompts"].as_str().unwrap_or(""),
            stack.model,
            args.workers,
            args.output_tokens,
        );
        Self {
            setup,
            targets: stack.targets(),
            accounts: stack.accounts.names().map(str::to_owned).collect(),
            rows: Vec::new(),
            windows: Vec::new(),
        }
    }

    pub fn latency(&mut self, row: Row, tokenize: Option<Samples>) {
        self.rows.push((row, tokenize));
    }

    pub fn window(&mut self, w: Window) {
        self.windows.push(w);
    }

    /// Added p99 of the gateway over the engine directly, less the tokenization's p99.
    fn beyond_tokenization(row: &Row, tokenize: Option<&Samples>) -> Option<f64> {
        let added = minus(
            row.timings(Target::Gateway)?.total.p99(),
            row.timings(Target::Direct)?.total.p99(),
        )?;
        Some(added - tokenize.and_then(Samples::p99).unwrap_or(0.0))
    }

    pub fn print_latency(&self) {
        println!(
            "\n## Latency, one request at a time, interleaved (µs, p50 / p99 of the time to the last byte; a round is one request to each target)\n"
        );
        let mut head = "| prompt tokens | API | answer | rounds |".to_owned();
        for t in &self.targets {
            head.push_str(&format!(" {} |", t.label()));
        }
        head.push_str(
            " gateway − direct | gateway − bare | proxy CPU µs per request (bare · nginx · gateway) | core busy 0 / 1 |",
        );
        println!("{head}");
        println!("|{}", "---|".repeat(8 + self.targets.len()));
        for (row, _) in &self.rows {
            let mut line = format!(
                "| {:.0} | {} | {} | {} |",
                row.prompt_tokens,
                row.spec.api.label(),
                if row.spec.stream { "streamed" } else { "whole" },
                row.rounds
            );
            for t in &self.targets {
                let s = row.timings(*t).map(|x| x.total.clone()).unwrap_or_default();
                line.push_str(&format!(" {} |", pair(s.p50(), s.p99())));
            }
            let p = |t: Target, q: fn(&Samples) -> Option<f64>| {
                row.timings(t).and_then(|x| q(&x.total))
            };
            line.push_str(&format!(
                " {} | {} |",
                pair(
                    minus(
                        p(Target::Gateway, Samples::p50),
                        p(Target::Direct, Samples::p50)
                    ),
                    minus(
                        p(Target::Gateway, Samples::p99),
                        p(Target::Direct, Samples::p99)
                    )
                ),
                pair(
                    minus(
                        p(Target::Gateway, Samples::p50),
                        p(Target::Bare, Samples::p50)
                    ),
                    minus(
                        p(Target::Gateway, Samples::p99),
                        p(Target::Bare, Samples::p99)
                    )
                ),
            ));
            let cpu: Vec<String> = ["bare proxy", "nginx", "gateway"]
                .iter()
                .map(|a| fmt_us(row.cpu_us(a)))
                .collect();
            let busy: Vec<String> = row
                .busy
                .iter()
                .map(|b| format!("{:.0} %", b * 100.0))
                .collect();
            line.push_str(&format!(" {} | {} |", cpu.join(" · "), busy.join(" / ")));
            println!("{line}");
        }

        println!(
            "\n## The gateway's time, whole and streamed rows (µs; \"≈\": from the gateway's histogram buckets 100/250/500/1000/2500 µs)\n"
        );
        println!(
            "| prompt tokens | API | answer | added p50 / p99 | selection by the bench p50 / p99 | gateway select mean / ≈p50 / ≈p99 | tokenize by the bench p50 / p99 | gateway tokenize mean / ≈p99 | added p99 beyond tokenization | overlap blocks |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (row, tokenize) in &self.rows {
            let g = row
                .timings(Target::Gateway)
                .map(|x| x.total.clone())
                .unwrap_or_default();
            let d = row
                .timings(Target::Direct)
                .map(|x| x.total.clone())
                .unwrap_or_default();
            let sel = row.select.clone().unwrap_or_default();
            let h = &row.gw_select;
            let tk = &row.gw_tokenize;
            println!(
                "| {:.0} | {} | {} | {} | {} | {} / {} / {} | {} | {} / {} | {} | {} |",
                row.prompt_tokens,
                row.spec.api.label(),
                if row.spec.stream { "streamed" } else { "whole" },
                pair(minus(g.p50(), d.p50()), minus(g.p99(), d.p99())),
                pair(sel.p50(), sel.p99()),
                fmt_us(h.mean_us()),
                fmt_us(h.quantile_us(0.5)),
                fmt_us(h.quantile_us(0.99)),
                tokenize
                    .as_ref()
                    .map_or("none (token ids)".into(), |t| pair(t.p50(), t.p99())),
                fmt_us(tk.mean_us()),
                fmt_us(tk.quantile_us(0.99)),
                fmt_us(Self::beyond_tokenization(row, tokenize.as_ref())),
                row.overlap.map_or("–".into(), |(lo, hi)| if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}–{hi}")
                }),
            );
        }
        let largest = self.rows.iter().map(|(r, _)| r.spec.size).max();
        if let Some(size) = largest {
            for (row, tokenize) in self.rows.iter().filter(|(r, _)| r.spec.size == size) {
                if let Some(v) = Self::beyond_tokenization(row, tokenize.as_ref()) {
                    println!(
                        "\ntarget at {size} tokens, {} {}: added p99 beyond tokenization {v:.0} µs (< {ADDED_P99_TARGET_US:.0} µs): {}",
                        row.spec.api.label(),
                        if row.spec.stream { "streamed" } else { "whole" },
                        if v < ADDED_P99_TARGET_US {
                            "met"
                        } else {
                            "NOT met"
                        }
                    );
                }
            }
        }
    }

    /// Mean requests per second of `target` over its windows (and min, max).
    fn rate(&self, target: Target) -> Option<(f64, f64, f64)> {
        let r: Vec<f64> = self
            .windows
            .iter()
            .filter(|w| w.target == target)
            .map(Window::per_sec)
            .collect();
        if r.is_empty() {
            return None;
        }
        let mean = r.iter().sum::<f64>() / r.len() as f64;
        let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = r.iter().copied().fold(0.0, f64::max);
        Some((mean, lo, hi))
    }

    /// CPU µs per request of `account` over all of `target`'s windows.
    fn cpu_per_request(&self, target: Target, account: &str) -> Option<f64> {
        let (mut cpu, mut n) = (0.0, 0u64);
        for w in self.windows.iter().filter(|w| w.target == target) {
            cpu += w.cpu.get(account)?.as_secs_f64();
            n += w.requests;
        }
        (n > 0).then(|| cpu * 1e6 / n as f64)
    }

    pub fn print_throughput(&self, prompt_tokens: f64) {
        let streams = &self.setup["streams"];
        println!(
            "\n## Throughput: streamed completions ({prompt_tokens:.0}-token prompts, {} tokens each), {streams} in flight ({}-s windows after a 1-s warm-up)\n",
            self.setup["output_tokens"], self.setup["throughput_secs"]
        );
        let accounts: Vec<&str> = self.accounts.iter().map(String::as_str).collect();
        println!(
            "| round | target | req/s | latency p50 / p99 ms | errors | CPU µs per request: {} | all | core busy 0 / 1 |",
            accounts.join(" · ")
        );
        println!("|---|---|---|---|---|---|---|---|");
        for w in &self.windows {
            let per: Vec<String> = accounts.iter().map(|a| fmt_us(w.cpu_us(a))).collect();
            let all: f64 = accounts.iter().filter_map(|a| w.cpu_us(a)).sum();
            let busy: Vec<String> = w
                .busy
                .iter()
                .map(|b| format!("{:.0} %", b * 100.0))
                .collect();
            println!(
                "| {} | {} | {:.0} | {:.2} / {:.2} | {} | {} | {all:.0} | {} |",
                w.round + 1,
                w.target.label(),
                w.per_sec(),
                w.latency.p50().unwrap_or(0.0) / 1e3,
                w.latency.p99().unwrap_or(0.0) / 1e3,
                w.errors,
                per.join(" · "),
                busy.join(" / "),
            );
            if let Some(e) = &w.first_error {
                println!("  first error: {}", e.chars().take(400).collect::<String>());
            }
        }
        println!(
            "\n| target | req/s, mean (min–max) | ratio to the bare proxy | proxy CPU µs per request | requests per proxy CPU-second | ratio per proxy CPU | CPU µs per request, all processes |"
        );
        println!("|---|---|---|---|---|---|---|");
        let bare = self.rate(Target::Bare).map(|r| r.0);
        let bare_cpu = self.cpu_per_request(Target::Bare, "bare proxy");
        for t in self.targets.iter().filter(|t| **t != Target::Direct).rev() {
            let Some((mean, lo, hi)) = self.rate(*t) else {
                continue;
            };
            let proxy = t.proxy_account().and_then(|a| self.cpu_per_request(*t, a));
            let all: f64 = accounts
                .iter()
                .filter_map(|a| self.cpu_per_request(*t, a))
                .sum();
            println!(
                "| {} | {mean:.0} ({lo:.0}–{hi:.0}) | {} | {} | {} | {} | {all:.0} |",
                t.label(),
                bare.map_or("–".into(), |b| format!("{:.2}", mean / b)),
                fmt_us(proxy),
                proxy.map_or("–".into(), |p| format!("{:.0}", 1e6 / p)),
                match (proxy, bare_cpu) {
                    (Some(p), Some(b)) => format!("{:.2}", b / p),
                    _ => "–".into(),
                },
            );
        }
        if let (Some(g), Some(b)) = (self.rate(Target::Gateway), bare) {
            let ratio = g.0 / b;
            println!(
                "\ntarget: gateway / bare proxy {ratio:.2} (≥ {THROUGHPUT_RATIO_TARGET:.2}): {}",
                if ratio >= THROUGHPUT_RATIO_TARGET {
                    "met"
                } else {
                    "NOT met"
                }
            );
        }
    }

    pub fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|(row, tokenize)| {
                let targets: serde_json::Map<String, Value> = row
                    .targets
                    .iter()
                    .map(|t| {
                        (
                            t.target.key().to_owned(),
                            json!({"total": samples_json(&t.total), "first_byte": samples_json(&t.first)}),
                        )
                    })
                    .collect();
                json!({
                    "prompt_tokens_wanted": row.spec.size,
                    "prompt_tokens": row.prompt_tokens,
                    "rounds": row.rounds,
                    "api": row.spec.api.label(),
                    "stream": row.spec.stream,
                    "targets": targets,
                    "bench_select": row.select.as_ref().map(samples_json),
                    "bench_tokenize": tokenize.as_ref().map(samples_json),
                    "gateway_select_hist": {
                        "count": row.gw_select.count, "mean_us": row.gw_select.mean_us(),
                        "p50_us_approx": row.gw_select.quantile_us(0.5),
                        "p99_us_approx": row.gw_select.quantile_us(0.99),
                    },
                    "gateway_tokenize_hist": {
                        "count": row.gw_tokenize.count, "mean_us": row.gw_tokenize.mean_us(),
                        "p50_us_approx": row.gw_tokenize.quantile_us(0.5),
                        "p99_us_approx": row.gw_tokenize.quantile_us(0.99),
                    },
                    "added_p99_beyond_tokenization_us": Self::beyond_tokenization(row, tokenize.as_ref()),
                    "overlap_blocks": row.overlap.map(|(lo, hi)| json!([lo, hi])),
                    "cpu_us_per_round": row
                        .cpu
                        .keys()
                        .map(|k| (k.clone(), json!(row.cpu_us(k))))
                        .collect::<serde_json::Map<String, Value>>(),
                    "core_busy": row.busy,
                })
            })
            .collect();
        let windows: Vec<Value> = self
            .windows
            .iter()
            .map(|w| {
                let cpu: serde_json::Map<String, Value> = w
                    .cpu
                    .iter()
                    .map(|(k, d)| {
                        (
                            k.clone(),
                            json!({"cpu_ms": d.as_secs_f64() * 1e3, "us_per_request": w.cpu_us(k)}),
                        )
                    })
                    .collect();
                json!({
                    "round": w.round + 1, "target": w.target.key(), "requests": w.requests,
                    "errors": w.errors, "first_error": w.first_error,
                    "wall_s": w.wall.as_secs_f64(), "per_sec": w.per_sec(),
                    "latency": samples_json(&w.latency), "first_byte": samples_json(&w.first_byte),
                    "cpu": cpu, "core_busy": w.busy,
                })
            })
            .collect();
        let mut setup = self.setup.clone();
        setup["loadavg_end"] = json!(loadavg());
        json!({"setup": setup, "latency": rows, "throughput": windows})
    }
}
