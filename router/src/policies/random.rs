//! `random`: a uniformly random eligible rank, drawn from the rng passed in.

use std::sync::Arc;

use rand::{Rng, RngCore};
use serde::Deserialize;

use crate::pipeline::{
    ComponentError, ScoredCandidate, WorkerInputs, WorkerPicker, WorkerSelectionPolicy,
};
use crate::registry::{PolicyFactory, PolicyParameters, ProviderError};
use crate::request::RequestContext;

/// Uniform over rows taken in rank order (a seed picks the same rank whatever the row order).
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomPicker;

impl WorkerPicker for RandomPicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    fn pick(
        &mut self,
        _context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|i| rows[*i].worker());
        Ok(order[rng.random_range(0..order.len())])
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParameters {}

/// No parameters.
pub fn provider(parameters: &PolicyParameters) -> Result<PolicyFactory, ProviderError> {
    let NoParameters {} = parameters.deserialize()?;
    Ok(Arc::new(|_context| {
        Ok(WorkerSelectionPolicy::new(
            Vec::new(),
            Box::new(RandomPicker),
        ))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::tests::{build, pick_among};

    #[test]
    fn spreads_uniformly_and_is_reproducible_per_seed() {
        let mut policy = build(provider, "");
        let mut counts = [0u32; 4];
        for seed in 0..4000 {
            counts[pick_among(&mut policy, &[1, 2, 3, 4], seed) as usize - 1] += 1;
        }
        assert!(counts.iter().all(|c| (850..1150).contains(c)), "{counts:?}");
        assert_eq!(
            pick_among(&mut policy, &[1, 2, 3, 4], 7),
            pick_among(&mut policy, &[4, 3, 2, 1], 7)
        );
    }
}
