//! Pickers shared by the built-in policies: lowest cost with a deterministic tie-break, lowest
//! cost with a seeded random tie-break, and softmax sampling over range-normalized costs.

use std::cmp::Ordering;

use rand::{Rng, RngCore};

use crate::pipeline::{ComponentError, ScoredCandidate, WorkerInputs, WorkerPicker};
use crate::request::RequestContext;

/// Orders rows by cost, then (with `by_cached_blocks`) fewest cached blocks, then worker rank.
fn rank_order(
    rows: &[ScoredCandidate<'_>],
    a: usize,
    b: usize,
    by_cached_blocks: bool,
) -> Ordering {
    let cached = |i: usize| rows[i].cache().map_or(0, |c| c.cached_blocks);
    rows[a]
        .cost()
        .total_cmp(&rows[b].cost())
        .then_with(|| {
            if by_cached_blocks {
                cached(a).cmp(&cached(b))
            } else {
                Ordering::Equal
            }
        })
        .then_with(|| rows[a].worker().cmp(&rows[b].worker()))
}

/// The lowest-cost row; ties go to the fewest cached blocks (optional), then the lowest rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct LowestCostPicker {
    /// Break ties by cached-block count (needs `CACHE`).
    pub by_cached_blocks: bool,
}

impl LowestCostPicker {
    pub(crate) fn lowest(&self, rows: &[ScoredCandidate<'_>]) -> usize {
        (0..rows.len())
            .min_by(|a, b| rank_order(rows, *a, *b, self.by_cached_blocks))
            .unwrap_or(0)
    }
}

impl WorkerPicker for LowestCostPicker {
    fn required_inputs(&self) -> WorkerInputs {
        if self.by_cached_blocks {
            WorkerInputs::CACHE
        } else {
            WorkerInputs::NONE
        }
    }

    fn pick(
        &mut self,
        _context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        _rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        Ok(self.lowest(rows))
    }
}

/// Temperature 0: the lowest cost; rows within `tie_tolerance` of it (relative) are ties,
/// and a tie goes to a uniformly random row (the seeded generator), so router replicas that
/// cannot yet see each other's latest decisions do not all pick the same worker. Above 0:
/// samples a row with probability ∝ `exp(-normalized_cost / temperature)`, where costs are
/// scaled to [0, 1] by their range. A request's temperature override replaces the configured
/// temperature.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoftmaxPicker {
    pub temperature: f64,
    /// Relative: rows costing at most `min + tie_tolerance · |min|` tie with the lowest.
    pub tie_tolerance: f64,
}

/// A uniformly random row among those costing at most `min + tolerance · |min|`, drawn in rank
/// order so a seed gives the same pick whatever the row order.
fn random_lowest(rows: &[ScoredCandidate<'_>], tolerance: f64, rng: &mut dyn RngCore) -> usize {
    let min = rows
        .iter()
        .map(ScoredCandidate::cost)
        .fold(f64::INFINITY, f64::min);
    let limit = min + tolerance * min.abs();
    let mut tied: Vec<usize> = (0..rows.len())
        .filter(|i| rows[*i].cost() <= limit)
        .collect();
    tied.sort_by_key(|i| rows[*i].worker());
    match tied.len() {
        0 => 0,
        1 => tied[0],
        n => tied[rng.random_range(0..n)],
    }
}

/// The sampling probabilities of `costs` at `temperature` (> 0), in input order.
pub fn softmax_probabilities(costs: &[f64], temperature: f64) -> Vec<f64> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    if costs.is_empty() || range <= 0.0 || !range.is_finite() {
        return vec![1.0 / costs.len().max(1) as f64; costs.len()];
    }
    // The best row has logit 0, the largest of all, so exp never overflows.
    let weights: Vec<f64> = costs
        .iter()
        .map(|c| (-((c - min) / range) / temperature).exp())
        .collect();
    let sum: f64 = weights.iter().sum();
    weights.into_iter().map(|w| w / sum).collect()
}

impl WorkerPicker for SoftmaxPicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE
    }

    fn pick(
        &mut self,
        context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        let temperature = context.temperature_override().unwrap_or(self.temperature);
        if rows.len() <= 1 {
            return Ok(0);
        }
        if temperature <= 0.0 {
            return Ok(random_lowest(rows, self.tie_tolerance, rng));
        }
        // Sample over rows in rank order, so a seed gives the same pick whatever the row order.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|i| rows[*i].worker());
        let costs: Vec<f64> = order.iter().map(|i| rows[*i].cost()).collect();
        let probabilities = softmax_probabilities(&costs, temperature);
        let mut draw: f64 = rng.random();
        for (position, p) in probabilities.iter().enumerate() {
            if draw < *p {
                return Ok(order[position]);
            }
            draw -= p;
        }
        Ok(order[order.len() - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_favours_low_costs_and_flattens_with_temperature() {
        let p = softmax_probabilities(&[0.0, 5.0, 10.0], 0.5);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[0] > p[1] && p[1] > p[2]);
        let hot = softmax_probabilities(&[0.0, 5.0, 10.0], 100.0);
        assert!(hot[0] - hot[2] < 0.01);
        assert_eq!(softmax_probabilities(&[3.0, 3.0], 1.0), [0.5, 0.5]);
        let p = softmax_probabilities(&[0.0, 1.0], 1.0);
        assert!((p[0] - 1.0 / (1.0 + (-1.0f64).exp())).abs() < 1e-12);
    }
}
