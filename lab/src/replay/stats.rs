//! Small statistics helpers for replay reports: percentiles, distribution summaries and the
//! coefficient of variation of per-worker load.

use serde::{Deserialize, Serialize};

/// The `q`-quantile (`0.0..=1.0`) of sorted values, interpolating linearly between ranks
/// (numpy's default). `None` for no values.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let pos = q.clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let frac = pos - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// A distribution in one unit (named by the field that holds it, e.g. `ttft_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Summary {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Summarizes `values` (any order; non-finite values are ignored). All zero when empty.
    pub fn of(values: &[f64]) -> Self {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return Self::default();
        }
        sorted.sort_by(f64::total_cmp);
        let at = |q| percentile(&sorted, q).expect("non-empty");
        Self {
            count: sorted.len() as u64,
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: sorted[sorted.len() - 1],
        }
    }
}

/// Population standard deviation over mean: 0 for perfectly even load, and 0 when there is no
/// load at all (or no values).
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(50.5));
        assert!((percentile(&v, 0.99).unwrap() - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.9), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn summary_sorts_and_ignores_non_finite_values() {
        let s = Summary::of(&[3.0, f64::NAN, 1.0, 2.0, f64::INFINITY]);
        assert_eq!(s.count, 3);
        assert_eq!((s.mean, s.p50, s.max), (2.0, 2.0, 3.0));
        assert_eq!(Summary::of(&[]), Summary::default());
    }

    #[test]
    fn cv_of_even_and_uneven_load() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), 0.0);
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), 0.0);
        assert_eq!(coefficient_of_variation(&[]), 0.0);
        // mean 2, population std 2.
        assert!((coefficient_of_variation(&[0.0, 4.0]) - 1.0).abs() < 1e-12);
    }
}
