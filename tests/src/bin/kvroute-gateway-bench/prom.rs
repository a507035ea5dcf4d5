//! The gateway's own timings from its `/metrics`: the histograms
//! `kvroute_gateway_tokenize_seconds` and `kvroute_gateway_select_seconds`, scraped before and
//! after a phase, so the difference covers exactly that phase's requests.

use std::collections::BTreeMap;

use kvroute_tests::http_get;

/// One histogram series: cumulative counts by upper bound, with count and sum.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hist {
    /// (upper bound in seconds, cumulative count), ascending; `+Inf` excluded.
    pub buckets: Vec<(f64, f64)>,
    pub count: f64,
    pub sum: f64,
}

impl Hist {
    /// What `self` gained since `before`.
    pub fn since(&self, before: &Hist) -> Hist {
        let old: BTreeMap<String, f64> = before
            .buckets
            .iter()
            .map(|(b, n)| (b.to_string(), *n))
            .collect();
        Hist {
            buckets: self
                .buckets
                .iter()
                .map(|(b, n)| (*b, n - old.get(&b.to_string()).copied().unwrap_or(0.0)))
                .collect(),
            count: self.count - before.count,
            sum: self.sum - before.sum,
        }
    }

    pub fn mean_us(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count * 1e6)
    }

    /// Quantile `q` in microseconds, interpolated linearly inside its bucket (as Prometheus'
    /// `histogram_quantile`): only as fine as the buckets (100, 250, 500, 1000, 2500 µs, …).
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let mut lower = (0.0, 0.0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= rank {
                let (lo, below) = lower;
                let inside = cumulative - below;
                let frac = if inside > 0.0 {
                    (rank - below) / inside
                } else {
                    1.0
                };
                return Some((lo + (bound - lo) * frac) * 1e6);
            }
            lower = (bound, cumulative);
        }
        // Above the largest finite bound.
        Some(lower.0 * 1e6)
    }
}

/// A scrape of `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    text: String,
}

impl Scrape {
    pub fn of(port: u16) -> Self {
        Self {
            text: http_get(port, "/metrics")
                .map(|(_, b)| b)
                .unwrap_or_default(),
        }
    }

    #[cfg(test)]
    fn from_text(text: &str) -> Self {
        Self { text: text.into() }
    }

    /// Histogram `family` restricted to the series whose labels include `label` (`k="v"`).
    pub fn hist(&self, family: &str, label: &str) -> Hist {
        let mut h = Hist::default();
        for line in self.text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name_labels, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match name_labels.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (name_labels, ""),
            };
            if !labels.split(',').any(|l| l == label) {
                continue;
            }
            match name.strip_prefix(family) {
                Some("_count") => h.count = value,
                Some("_sum") => h.sum = value,
                Some("_bucket") => {
                    let le = labels
                        .split(',')
                        .find_map(|l| l.strip_prefix("le=\""))
                        .map(|v| v.trim_end_matches('"'));
                    if let Some(bound) = le.and_then(|v| v.parse::<f64>().ok())
                        && bound.is_finite()
                    {
                        h.buckets.push((bound, value));
                    }
                }
                _ => {}
            }
        }
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_and_quantiles() {
        let text = |a: u32, b: u32, sum: f64| {
            format!(
                "# TYPE x histogram\nx_bucket{{model=\"m\",le=\"0.0001\"}} {a}\n\
                 x_bucket{{model=\"m\",le=\"0.001\"}} {b}\nx_bucket{{model=\"m\",le=\"+Inf\"}} {b}\n\
                 x_sum{{model=\"m\"}} {sum}\nx_count{{model=\"m\"}} {b}\n\
                 x_count{{model=\"n\"}} 99\n"
            )
        };
        let before = Scrape::from_text(&text(0, 0, 0.0)).hist("x", "model=\"m\"");
        let after = Scrape::from_text(&text(50, 100, 0.01)).hist("x", "model=\"m\"");
        let d = after.since(&before);
        assert_eq!(d.count, 100.0);
        assert_eq!(d.quantile_us(0.5).map(f64::round), Some(100.0));
        assert_eq!(d.quantile_us(0.75).map(f64::round), Some(550.0));
        assert_eq!(d.mean_us().map(f64::round), Some(100.0));
        assert_eq!(Hist::default().quantile_us(0.5), None);
    }
}
