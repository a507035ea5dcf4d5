//! Percentiles of measured durations.

use std::time::Duration;

/// Durations, sorted once for percentiles.
#[derive(Debug, Clone, Default)]
pub struct Samples(Vec<Duration>);

impl Samples {
    pub fn new(mut v: Vec<Duration>) -> Self {
        v.sort_unstable();
        Self(v)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The nearest-rank percentile `q` (0..=1), in microseconds; `None` when empty.
    pub fn us(&self, q: f64) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let rank = ((q * self.0.len() as f64).ceil() as usize).clamp(1, self.0.len());
        Some(self.0[rank - 1].as_secs_f64() * 1e6)
    }

    pub fn p50(&self) -> Option<f64> {
        self.us(0.50)
    }

    pub fn p99(&self) -> Option<f64> {
        self.us(0.99)
    }

    pub fn mean_us(&self) -> Option<f64> {
        (!self.0.is_empty()).then(|| {
            self.0.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e6 / self.0.len() as f64
        })
    }
}

/// `a − b` of two optional figures.
pub fn minus(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? - b?)
}

/// A figure for a table: whole microseconds, or `–`.
pub fn fmt_us(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.0}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let s = Samples::new((1..=100).rev().map(Duration::from_micros).collect());
        assert_eq!(s.p50(), Some(50.0));
        assert_eq!(s.p99(), Some(99.0));
        assert_eq!(s.us(1.0), Some(100.0));
        assert_eq!(Samples::default().p50(), None);
    }
}
