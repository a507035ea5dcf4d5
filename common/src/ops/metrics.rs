//! Lock-free counters, gauges and histograms rendered in the Prometheus text format.
//! Deliberately small: kvroute needs a handful of series per process, not a metrics framework.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counters keyed by one label value (e.g. a reason or an error code).
#[derive(Debug, Default)]
pub struct CounterVec(Mutex<BTreeMap<String, u64>>);

impl CounterVec {
    pub fn inc(&self, label: &str) {
        self.add(label, 1);
    }
    pub fn add(&self, label: &str, n: u64) {
        let mut map = self.0.lock().expect("counter vec lock");
        match map.get_mut(label) {
            Some(v) => *v += n,
            None => {
                map.insert(label.to_owned(), n);
            }
        }
    }
    pub fn get(&self, label: &str) -> u64 {
        self.0
            .lock()
            .expect("counter vec lock")
            .get(label)
            .copied()
            .unwrap_or(0)
    }
    pub fn total(&self) -> u64 {
        self.0.lock().expect("counter vec lock").values().sum()
    }
    fn snapshot(&self) -> Vec<(String, u64)> {
        let map = self.0.lock().expect("counter vec lock");
        map.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// A histogram with fixed upper bounds (seconds, for latencies).
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in nanoseconds (or the value × 1e9), so it stays an integer.
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// Latency buckets from 10 µs to 10 s.
    pub fn latency() -> Self {
        Self::with_bounds(vec![
            0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ])
    }

    /// Waiting-time buckets from 1 ms to 5 min (queues).
    pub fn waits() -> Self {
        Self::with_bounds(vec![
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            120.0, 300.0,
        ])
    }

    pub fn with_bounds(bounds: Vec<f64>) -> Self {
        let buckets = bounds.iter().map(|_| AtomicU64::new(0)).collect();
        Self {
            bounds,
            buckets,
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos
            .fetch_add((value.max(0.0) * 1e9) as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Series keyed by several label values, in the order of the family's label names.
#[derive(Debug)]
pub struct Family<T> {
    labels: &'static [&'static str],
    make: fn() -> T,
    series: Mutex<BTreeMap<Vec<String>, Arc<T>>>,
}

impl<T> Family<T> {
    fn new(labels: &'static [&'static str], make: fn() -> T) -> Self {
        Self {
            labels,
            make,
            series: Mutex::new(BTreeMap::new()),
        }
    }

    /// The series of these label values (created on first use); `values` has one value per
    /// label name.
    pub fn with(&self, values: &[&str]) -> Arc<T> {
        debug_assert_eq!(values.len(), self.labels.len());
        let mut series = self.series.lock().expect("metric family lock");
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        series
            .entry(key)
            .or_insert_with(|| Arc::new((self.make)()))
            .clone()
    }

    /// Drops every series (e.g. before re-setting the gauges of what exists now).
    pub fn clear(&self) {
        self.series.lock().expect("metric family lock").clear();
    }

    fn snapshot(&self) -> Vec<(String, Arc<T>)> {
        let series = self.series.lock().expect("metric family lock");
        series
            .iter()
            .map(|(values, m)| {
                let pairs: Vec<String> = self
                    .labels
                    .iter()
                    .zip(values)
                    .map(|(name, value)| {
                        let value = value.replace('\\', "\\\\").replace('"', "\\\"");
                        format!("{name}=\"{value}\"")
                    })
                    .collect();
                (pairs.join(","), m.clone())
            })
            .collect()
    }
}

enum Metric {
    Counter(Arc<Counter>),
    Gauge(Arc<Gauge>),
    CounterVec(&'static str, Arc<CounterVec>),
    Histogram(Arc<Histogram>),
    Counters(Arc<Family<Counter>>),
    Gauges(Arc<Family<Gauge>>),
    Histograms(Arc<Family<Histogram>>),
}

/// The metrics of one process, in registration order.
#[derive(Default)]
pub struct Registry {
    metrics: Mutex<Vec<(&'static str, &'static str, Metric)>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl Registry {
    fn add(&self, name: &'static str, help: &'static str, m: Metric) {
        self.metrics
            .lock()
            .expect("registry lock")
            .push((name, help, m));
    }
    pub fn counter(&self, name: &'static str, help: &'static str) -> Arc<Counter> {
        let c = Arc::new(Counter::default());
        self.add(name, help, Metric::Counter(c.clone()));
        c
    }
    pub fn gauge(&self, name: &'static str, help: &'static str) -> Arc<Gauge> {
        let g = Arc::new(Gauge::default());
        self.add(name, help, Metric::Gauge(g.clone()));
        g
    }
    pub fn counter_vec(
        &self,
        name: &'static str,
        help: &'static str,
        label: &'static str,
    ) -> Arc<CounterVec> {
        let c = Arc::new(CounterVec::default());
        self.add(name, help, Metric::CounterVec(label, c.clone()));
        c
    }
    pub fn histogram(&self, name: &'static str, help: &'static str) -> Arc<Histogram> {
        let h = Arc::new(Histogram::latency());
        self.add(name, help, Metric::Histogram(h.clone()));
        h
    }

    /// Counters with several labels.
    pub fn counter_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Counter>> {
        let f = Arc::new(Family::new(labels, Counter::default));
        self.add(name, help, Metric::Counters(f.clone()));
        f
    }

    /// Gauges with several labels.
    pub fn gauge_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Gauge>> {
        let f = Arc::new(Family::new(labels, Gauge::default));
        self.add(name, help, Metric::Gauges(f.clone()));
        f
    }

    /// Histograms with several labels and the bounds of [`Histogram::waits`] (1 ms to 5 min).
    pub fn wait_histogram_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Histogram>> {
        let f = Arc::new(Family::new(labels, Histogram::waits));
        self.add(name, help, Metric::Histograms(f.clone()));
        f
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, help, metric) in self.metrics.lock().expect("registry lock").iter() {
            let kind = match metric {
                Metric::Counter(_) | Metric::CounterVec(..) | Metric::Counters(_) => "counter",
                Metric::Gauge(_) | Metric::Gauges(_) => "gauge",
                Metric::Histogram(_) | Metric::Histograms(_) => "histogram",
            };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            match metric {
                Metric::Counter(c) => {
                    let _ = writeln!(out, "{name} {}", c.get());
                }
                Metric::Gauge(g) => {
                    let _ = writeln!(out, "{name} {}", g.get());
                }
                Metric::CounterVec(label, c) => {
                    for (value, n) in c.snapshot() {
                        let value = value.replace('\\', "\\\\").replace('"', "\\\"");
                        let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {n}");
                    }
                }
                Metric::Histogram(h) => render_histogram(&mut out, name, "", h),
                Metric::Counters(f) => {
                    for (labels, c) in f.snapshot() {
                        let _ = writeln!(out, "{name}{{{labels}}} {}", c.get());
                    }
                }
                Metric::Gauges(f) => {
                    for (labels, g) in f.snapshot() {
                        let _ = writeln!(out, "{name}{{{labels}}} {}", g.get());
                    }
                }
                Metric::Histograms(f) => {
                    for (labels, h) in f.snapshot() {
                        render_histogram(&mut out, name, &labels, &h);
                    }
                }
            }
        }
        out
    }
}

/// One histogram's lines; `labels` are the series' own (`a="x",b="y"`), or empty.
fn render_histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let (with, alone) = if labels.is_empty() {
        (String::new(), String::new())
    } else {
        (format!("{labels},"), format!("{{{labels}}}"))
    };
    let mut cumulative = 0;
    for (bound, bucket) in h.bounds.iter().zip(&h.buckets) {
        cumulative += bucket.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{with}le=\"{bound}\"}} {cumulative}");
    }
    let count = h.count();
    let _ = writeln!(out, "{name}_bucket{{{with}le=\"+Inf\"}} {count}");
    let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
    let _ = writeln!(out, "{name}_sum{alone} {sum}\n{name}_count{alone} {count}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let r = Registry::default();
        r.counter("kv_events_total", "Events applied.").add(3);
        r.gauge("lag", "Messages behind.").set(-2);
        let reasons = r.counter_vec("bad_total", "Bad messages.", "reason");
        reasons.inc("malformed");
        reasons.inc("malformed");
        let h = r.histogram("latency_seconds", "Latency.");
        h.observe(0.0002);
        h.observe(20.0);
        let text = r.render();
        assert!(
            text.contains("# TYPE kv_events_total counter\nkv_events_total 3\n"),
            "{text}"
        );
        assert!(text.contains("lag -2\n"));
        assert!(text.contains("bad_total{reason=\"malformed\"} 2\n"));
        assert!(text.contains("latency_seconds_bucket{le=\"0.00025\"} 1\n"));
        assert!(text.contains("latency_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("latency_seconds_count 2\n"));
    }

    #[test]
    fn renders_families_with_several_labels() {
        let r = Registry::default();
        let depth = r.gauge_family("depth", "Depth.", &["model", "class"]);
        depth.with(&["m\"1", "0"]).set(4);
        let done = r.counter_family("done_total", "Done.", &["model"]);
        done.with(&["m"]).add(2);
        done.with(&["m"]).inc();
        let waits = r.wait_histogram_family("wait_seconds", "Waits.", &["model"]);
        waits.with(&["m"]).observe(0.3);
        let text = r.render();
        assert!(
            text.contains("depth{model=\"m\\\"1\",class=\"0\"} 4\n"),
            "{text}"
        );
        assert!(text.contains("done_total{model=\"m\"} 3\n"), "{text}");
        assert!(
            text.contains("wait_seconds_bucket{model=\"m\",le=\"0.25\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("wait_seconds_bucket{model=\"m\",le=\"0.5\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("wait_seconds_count{model=\"m\"} 1\n"),
            "{text}"
        );
        depth.clear();
        assert!(!r.render().contains("depth{"));
    }
}
