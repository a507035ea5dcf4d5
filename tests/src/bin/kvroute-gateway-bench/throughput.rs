//! Phase 2, throughput: `streams` client tasks each send streamed completions back to back to
//! one target (so that many are in flight), for a warm-up and then a measured window; counts
//! the requests that ended inside the window, their latency, and the CPU every process and
//! core used meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::client::{Expect, call, http_client};
use crate::stack::Target;
use crate::stats::Samples;

/// One measured window at one target.
#[derive(Debug, Clone)]
pub struct Window {
    pub target: Target,
    pub round: usize,
    pub requests: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub wall: Duration,
    pub latency: Samples,
    pub first_byte: Samples,
    /// CPU by account over the window.
    pub cpu: BTreeMap<String, Duration>,
    /// Each core's busy share over the window.
    pub busy: Vec<f64>,
}

impl Window {
    pub fn per_sec(&self) -> f64 {
        self.requests as f64 / self.wall.as_secs_f64()
    }

    /// CPU microseconds per request of account `name`.
    pub fn cpu_us(&self, name: &str) -> Option<f64> {
        let d = self.cpu.get(name)?;
        (self.requests > 0).then(|| d.as_secs_f64() * 1e6 / self.requests as f64)
    }
}

/// What one window needs.
#[derive(Debug, Clone)]
pub struct Load {
    pub url: String,
    pub bodies: Arc<Vec<Bytes>>,
    pub events: usize,
    pub streams: usize,
    pub warmup: Duration,
    pub measure: Duration,
}

#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    done: AtomicU64,
    errors: AtomicU64,
    first_error: std::sync::Mutex<Option<String>>,
}

/// Runs one window; `accounts` is read at its start and end.
pub async fn window(
    target: Target,
    round: usize,
    load: &Load,
    accounts: &crate::accounts::Accounts,
) -> anyhow::Result<Window> {
    let http = http_client()?;
    let shared = Arc::new(Shared::default());
    let mut tasks = Vec::with_capacity(load.streams);
    for t in 0..load.streams {
        let (http, shared, bodies, url) = (
            http.clone(),
            shared.clone(),
            load.bodies.clone(),
            load.url.clone(),
        );
        let expect = Expect::Stream {
            events: load.events,
        };
        tasks.push(tokio::spawn(async move {
            let mut ends: Vec<(Instant, Duration, Duration)> = Vec::new();
            let mut k = t;
            while !shared.stop.load(Ordering::Relaxed) {
                let body = bodies[k % bodies.len()].clone();
                k += load_stride(bodies.len());
                match call(&http, &url, body, expect).await {
                    Ok(c) => {
                        ends.push((Instant::now(), c.total, c.first));
                        shared.done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        shared.errors.fetch_add(1, Ordering::Relaxed);
                        {
                            let mut first = shared.first_error.lock().expect("error slot");
                            first.get_or_insert_with(|| format!("{e:#}"));
                        }
                        // Do not spin on a broken target.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            ends
        }));
    }
    tokio::time::sleep(load.warmup).await;
    let (d0, e0) = (
        shared.done.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed),
    );
    let c0 = accounts.read();
    let t0 = Instant::now();
    tokio::time::sleep(load.measure).await;
    let (d1, e1) = (
        shared.done.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed),
    );
    let c1 = accounts.read();
    let t1 = Instant::now();
    shared.stop.store(true, Ordering::Relaxed);
    let mut latency = Vec::new();
    let mut first_byte = Vec::new();
    for task in tasks {
        for (end, total, first) in task.await? {
            if end >= t0 && end <= t1 {
                latency.push(total);
                first_byte.push(first);
            }
        }
    }
    let first_error = shared.first_error.lock().expect("error slot").clone();
    counted(target.label(), d1 - d0, first_error.as_deref())?;
    Ok(Window {
        target,
        round,
        requests: d1 - d0,
        errors: e1 - e0,
        first_error,
        wall: t1 - t0,
        latency: Samples::new(latency),
        first_byte: Samples::new(first_byte),
        cpu: c1.since(&c0),
        busy: c1.busy_since(&c0),
    })
}

/// A window that counted no request measures nothing: its rate (0) and per-request CPU (none)
/// must not enter a mean or a ratio as if they were figures.
fn counted(target: &str, requests: u64, first_error: Option<&str>) -> anyhow::Result<()> {
    anyhow::ensure!(
        requests > 0,
        "{target}: the measured window counted no request (first error: {}); refusing a figure of nothing",
        first_error.unwrap_or("none")
    );
    Ok(())
}

/// Each task walks the prompts with a stride prime to their count, so tasks do not send the
/// same prompt in lockstep.
fn load_stride(n: usize) -> usize {
    if n <= 1 {
        return 1;
    }
    (1..n)
        .rev()
        .find(|s| gcd(*s, n) == 1 && *s > n / 2)
        .unwrap_or(1)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::counted;

    #[test]
    fn a_window_that_counted_nothing_is_refused() {
        let e = counted("bare proxy", 0, Some("connection refused")).unwrap_err();
        assert!(e.to_string().contains("bare proxy"), "{e}");
        assert!(e.to_string().contains("connection refused"), "{e}");
        assert!(counted("nginx", 1, None).is_ok());
    }
}
