//! The metrics of one process, built on the `prometheus-client` crate and rendered in the
//! OpenMetrics text format. Thin wrappers keep the call sites' small API (`counter`,
//! `gauge_family`, `with(&[..])`) and the metric names kvroute has always exposed: a counter
//! registered as `x_total` is exposed as `x_total` (the crate adds the suffix itself).

use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{
    EncodeLabelValue, EncodeMetric, LabelValueEncoder, MetricEncoder,
};
use prometheus_client::metrics::counter::Counter as PromCounter;
use prometheus_client::metrics::family::Family as PromFamily;
use prometheus_client::metrics::gauge::Gauge as PromGauge;
use prometheus_client::metrics::histogram::Histogram as PromHistogram;
use prometheus_client::metrics::{MetricType, TypedMetric};

/// A monotonically increasing count.
#[derive(Debug, Default, Clone)]
pub struct Counter(PromCounter);

impl Counter {
    pub fn inc(&self) {
        self.0.inc();
    }
    pub fn add(&self, n: u64) {
        self.0.inc_by(n);
    }
    pub fn get(&self) -> u64 {
        self.0.get()
    }
}

/// A value that goes up and down.
#[derive(Debug, Default, Clone)]
pub struct Gauge(PromGauge<i64, AtomicI64>);

impl Gauge {
    pub fn set(&self, v: i64) {
        self.0.set(v);
    }
    pub fn get(&self) -> i64 {
        self.0.get()
    }
}

/// A histogram with fixed upper bounds (seconds, for latencies).
#[derive(Debug, Clone)]
pub struct Histogram(PromHistogram);

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
        Self(PromHistogram::new(bounds))
    }

    pub fn observe(&self, value: f64) {
        self.0.observe(value);
    }
}

macro_rules! delegate_metric {
    ($($t:ty => $kind:ident),*) => {$(
        impl TypedMetric for $t {
            const TYPE: MetricType = MetricType::$kind;
        }
        impl EncodeMetric for $t {
            fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
                self.0.encode(encoder)
            }
            fn metric_type(&self) -> MetricType {
                MetricType::$kind
            }
        }
    )*};
}
delegate_metric!(Counter => Counter, Gauge => Gauge, Histogram => Histogram);

/// A family registered so that its `# HELP` and `# TYPE` lines render before its first sample
/// (prometheus-client leaves an empty family out): scrapers and the tests can tell a family
/// that has not counted yet from a misspelt name.
#[derive(Debug)]
struct Declared<M>(M);

impl<M: EncodeMetric> EncodeMetric for Declared<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

/// A label value, escaped as the exposition format requires (`\`, `"`, newline): label
/// values such as model names come from outside.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LabelValue(String);

impl EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write as _;
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// One series' labels: names in the family's order, with their values.
type Labels = Vec<(&'static str, LabelValue)>;

/// Series keyed by several label values, in the order of the family's label names.
#[derive(Debug)]
pub struct Family<T> {
    labels: Vec<&'static str>,
    inner: PromFamily<Labels, T, fn() -> T>,
}

impl<T: Clone> Family<T> {
    fn new(labels: &[&'static str], make: fn() -> T) -> Self {
        Self {
            labels: labels.to_vec(),
            inner: PromFamily::new_with_constructor(make),
        }
    }

    fn key(&self, values: &[&str]) -> Labels {
        debug_assert_eq!(values.len(), self.labels.len());
        self.labels
            .iter()
            .zip(values)
            .map(|(name, value)| (*name, LabelValue((*value).to_owned())))
            .collect()
    }

    /// The series of these label values (created on first use); `values` has one value per
    /// label name.
    pub fn with(&self, values: &[&str]) -> T {
        self.inner.get_or_create_owned(&self.key(values))
    }

    /// Drops every series (e.g. before re-setting the gauges of what exists now).
    pub fn clear(&self) {
        self.inner.clear();
    }
}

/// A one-label counter family whose label takes only the values the code lists (a reason, an
/// outcome, an error code): the contract with dashboards and tests. The family is registered
/// with every value present at 0, and counting another value is a bug (a debug assertion);
/// the tests' metric readers refuse a value that is not listed, so a misspelt label cannot
/// read as 0.
#[derive(Debug, Clone, Copy)]
pub struct OneOf {
    /// The family's name as exposed (counters with their `_total`).
    pub family: &'static str,
    pub label: &'static str,
    /// Every value the code counts.
    pub values: fn() -> Vec<&'static str>,
}

impl OneOf {
    /// Whether the code counts `value` under this family.
    pub fn allows(&self, value: &str) -> bool {
        (self.values)().contains(&value)
    }
}

/// Counters keyed by one label value (e.g. a reason or an error code).
#[derive(Debug)]
pub struct CounterVec {
    family: Family<Counter>,
    /// The values the code may count, when the family is [`OneOf`].
    allowed: Option<Vec<&'static str>>,
}

impl CounterVec {
    pub fn inc(&self, label: &str) {
        self.add(label, 1);
    }
    pub fn add(&self, label: &str, n: u64) {
        debug_assert!(
            self.allowed.as_ref().is_none_or(|a| a.contains(&label)),
            "label value {label:?} is not one of {:?}: add it to the family's OneOf",
            self.allowed
        );
        self.family.with(&[label]).add(n);
    }
    pub fn get(&self, label: &str) -> u64 {
        self.family
            .inner
            .get(&self.family.key(&[label]))
            .map_or(0, |c| c.get())
    }
}

/// The metrics of one process, in registration order.
#[derive(Default)]
pub struct Registry {
    inner: Mutex<prometheus_client::registry::Registry>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

impl Registry {
    fn add<M>(&self, name: &'static str, help: &'static str, metric: M)
    where
        M: prometheus_client::registry::Metric,
    {
        // The crate appends `_total` to a counter's samples: register the name without it.
        let name = match metric.metric_type() {
            MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        let help = help.strip_suffix('.').unwrap_or(help);
        self.inner
            .lock()
            .expect("registry lock")
            .register(name, help, metric);
    }
    pub fn counter(&self, name: &'static str, help: &'static str) -> Arc<Counter> {
        let c = Counter::default();
        self.add(name, help, c.clone());
        Arc::new(c)
    }
    pub fn gauge(&self, name: &'static str, help: &'static str) -> Arc<Gauge> {
        let g = Gauge::default();
        self.add(name, help, g.clone());
        Arc::new(g)
    }
    pub fn counter_vec(
        &self,
        name: &'static str,
        help: &'static str,
        label: &'static str,
    ) -> Arc<CounterVec> {
        let f = Family::new(&[label], Counter::default);
        self.add(name, help, Declared(f.inner.clone()));
        Arc::new(CounterVec {
            family: f,
            allowed: None,
        })
    }

    /// A [`OneOf`] family: every listed value present at 0 from the start, no other counted.
    pub fn counter_one_of(&self, spec: OneOf, help: &'static str) -> Arc<CounterVec> {
        let f = Family::new(&[spec.label], Counter::default);
        self.add(spec.family, help, Declared(f.inner.clone()));
        let values = (spec.values)();
        for value in &values {
            f.with(&[value]);
        }
        Arc::new(CounterVec {
            family: f,
            allowed: Some(values),
        })
    }
    pub fn histogram(&self, name: &'static str, help: &'static str) -> Arc<Histogram> {
        let h = Histogram::latency();
        self.add(name, help, h.clone());
        Arc::new(h)
    }

    /// Counters with several labels.
    pub fn counter_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Counter>> {
        let f = Family::new(labels, Counter::default);
        self.add(name, help, Declared(f.inner.clone()));
        Arc::new(f)
    }

    /// Gauges with several labels.
    pub fn gauge_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Gauge>> {
        let f = Family::new(labels, Gauge::default);
        self.add(name, help, Declared(f.inner.clone()));
        Arc::new(f)
    }

    /// Histograms with several labels and the bounds of [`Histogram::waits`] (1 ms to 5 min).
    pub fn wait_histogram_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Histogram>> {
        let f = Family::new(labels, Histogram::waits);
        self.add(name, help, Declared(f.inner.clone()));
        Arc::new(f)
    }

    /// The OpenMetrics text exposition, `# EOF` line included (serve it with
    /// [`OPENMETRICS_CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(
            &mut out,
            &self.inner.lock().expect("registry lock"),
        )
        .expect("writing to a String cannot fail");
        out
    }
}

/// The content type of [`Registry::render`]'s text.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_as_registered() {
        let r = Registry::default();
        r.counter("kv_events_total", "Events applied.").add(3);
        r.gauge("lag", "Messages behind.").set(-2);
        let reasons = r.counter_vec("bad_total", "Bad messages.", "reason");
        reasons.inc("malformed");
        reasons.inc("malformed");
        assert_eq!(reasons.get("malformed"), 2);
        assert_eq!(reasons.get("other"), 0);
        let h = r.histogram("latency_seconds", "Latency.");
        h.observe(0.0002);
        h.observe(20.0);
        let text = r.render();
        assert!(
            text.contains("# TYPE kv_events counter\nkv_events_total 3\n"),
            "{text}"
        );
        assert!(text.contains("\nlag -2\n"), "{text}");
        assert!(
            text.contains("\nbad_total{reason=\"malformed\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("\nlatency_seconds_bucket{le=\"0.00025\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("\nlatency_seconds_bucket{le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("\nlatency_seconds_count 2\n"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(!text.contains("_total_total"), "{text}");
    }

    #[test]
    fn an_empty_family_is_declared() {
        let r = Registry::default();
        let _c = r.counter_vec("kv_fallbacks_total", "Fallbacks.", "reason");
        let _g = r.gauge_family("kv_depth", "Depth.", &["model"]);
        let text = r.render();
        assert!(text.contains("# TYPE kv_fallbacks counter\n"), "{text}");
        assert!(text.contains("# TYPE kv_depth gauge\n"), "{text}");
        assert!(!text.contains("kv_fallbacks_total{"), "{text}");
    }

    #[test]
    fn a_one_of_family_renders_its_values_at_zero_and_counts_only_them() {
        const SPEC: OneOf = OneOf {
            family: "kv_outcomes_total",
            label: "outcome",
            values: || vec!["ok", "failed"],
        };
        let r = Registry::default();
        let outcomes = r.counter_one_of(SPEC, "Outcomes.");
        outcomes.inc("ok");
        let text = r.render();
        assert!(
            text.contains("kv_outcomes_total{outcome=\"ok\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("kv_outcomes_total{outcome=\"failed\"} 0\n"),
            "{text}"
        );
        assert!(SPEC.allows("failed") && !SPEC.allows("fail"));
        if cfg!(debug_assertions) {
            let misspelt =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| outcomes.inc("fail")));
            assert!(misspelt.is_err(), "a value outside the list must not count");
        }
    }

    #[test]
    fn renders_families_with_several_labels_escaped() {
        let r = Registry::default();
        let depth = r.gauge_family("depth", "Depth.", &["model", "class"]);
        depth.with(&["m\"1\\\n", "0"]).set(4);
        let done = r.counter_family("done_total", "Done.", &["model"]);
        done.with(&["m"]).add(2);
        done.with(&["m"]).inc();
        let waits = r.wait_histogram_family("wait_seconds", "Waits.", &["model"]);
        waits.with(&["m"]).observe(0.3);
        let text = r.render();
        assert!(
            text.contains("\ndepth{model=\"m\\\"1\\\\\\n\",class=\"0\"} 4\n"),
            "{text}"
        );
        assert!(text.contains("\ndone_total{model=\"m\"} 3\n"), "{text}");
        assert!(
            text.contains("\nwait_seconds_bucket{le=\"0.25\",model=\"m\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("\nwait_seconds_bucket{le=\"0.5\",model=\"m\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("\nwait_seconds_count{model=\"m\"} 1\n"),
            "{text}"
        );
        depth.clear();
        assert!(!r.render().contains("depth{"));
    }
}
