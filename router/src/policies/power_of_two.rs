//! `power-of-two`: draws two distinct eligible ranks at random and keeps the less loaded one
//! (ties: lower worker id). Load metric as in `least-busy`.

use std::sync::Arc;

use rand::RngCore;
use rand::seq::index::sample;

use super::load_metric::{LoadParameters, LoadScorer};
use crate::pipeline::{
    ComponentError, ScoredCandidate, WorkerInputs, WorkerPicker, WorkerSelectionPolicy,
};
use crate::registry::{PolicyFactory, PolicyParameters, ProviderError};
use crate::request::RequestContext;

/// Best of two random rows (rows taken in rank order, so a seed is reproducible).
#[derive(Debug, Clone, Copy, Default)]
pub struct PowerOfTwoPicker;

impl WorkerPicker for PowerOfTwoPicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    fn pick(
        &mut self,
        _context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        mut rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        if rows.len() == 1 {
            return Ok(0);
        }
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|i| rows[*i].worker());
        let drawn = sample(&mut rng, order.len(), 2);
        let (a, b) = (order[drawn.index(0)], order[drawn.index(1)]);
        let key = |i: usize| (rows[i].cost(), rows[i].worker());
        Ok(
            if key(a)
                .0
                .total_cmp(&key(b).0)
                .then(key(a).1.cmp(&key(b).1))
                .is_le()
            {
                a
            } else {
                b
            },
        )
    }
}

/// Parameters: `metric: active_requests | decode_blocks | prefill_tokens`.
pub fn provider(parameters: &PolicyParameters) -> Result<PolicyFactory, ProviderError> {
    let LoadParameters { metric } = parameters.deserialize()?;
    Ok(Arc::new(move |_context| {
        Ok(WorkerSelectionPolicy::new(
            vec![Box::new(LoadScorer { metric })],
            Box::new(PowerOfTwoPicker),
        ))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::tests::{build, pick_with_loads};

    #[test]
    fn never_picks_the_most_loaded_of_three_and_prefers_the_least() {
        let mut policy = build(provider, "");
        let loads = [(5, 0), (1, 0), (9, 0)];
        let mut counts = [0u32; 3];
        for seed in 0..3000 {
            counts[pick_with_loads(&mut policy, &loads, seed) as usize - 1] += 1;
        }
        assert_eq!(counts[2], 0, "the busiest wins no pair");
        // Worker 2 wins both pairs it is in (2/3), worker 1 the remaining pair (1/3).
        assert!((1850..2150).contains(&counts[1]), "{counts:?}");
        assert_eq!(pick_with_loads(&mut policy, &[(4, 0)], 1), 1);
    }
}
