//! `round-robin`: cycles through the eligible ranks in worker-rank order. The cursor (the last
//! rank served) lives in the picker, one per (role, partition); workers joining or leaving do
//! not reset it.

use std::sync::Arc;

use rand::RngCore;
use serde::Deserialize;

use crate::pipeline::{
    ComponentError, ScoredCandidate, WorkerInputs, WorkerPicker, WorkerSelectionPolicy,
};
use crate::registry::{PolicyFactory, PolicyParameters, ProviderError};
use crate::request::RequestContext;
use crate::worker::WorkerRank;

/// Picks the smallest rank after the last one served, wrapping around.
#[derive(Debug, Clone, Default)]
pub struct RoundRobinPicker {
    last: Option<WorkerRank>,
}

impl WorkerPicker for RoundRobinPicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    fn pick(
        &mut self,
        _context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        _rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        let first = || (0..rows.len()).min_by_key(|i| rows[*i].worker());
        let next = self.last.and_then(|last| {
            (0..rows.len())
                .filter(|i| rows[*i].worker() > last)
                .min_by_key(|i| rows[*i].worker())
        });
        let chosen = next
            .or_else(first)
            .ok_or_else(|| ComponentError::failed("no rows"))?;
        self.last = Some(rows[chosen].worker());
        Ok(chosen)
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
            Box::new(RoundRobinPicker::default()),
        ))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::tests::{build, pick_among};

    #[test]
    fn cycles_in_worker_order_and_survives_membership_changes() {
        let mut policy = build(provider, "");
        let picks: Vec<u64> = (0..5)
            .map(|_| pick_among(&mut policy, &[3, 1, 2], 0))
            .collect();
        assert_eq!(picks, [1, 2, 3, 1, 2]);
        // Worker 3 leaves: after 2 comes 1 again; worker 4 joins: it is next after 2.
        assert_eq!(pick_among(&mut policy, &[1, 2], 0), 1);
        assert_eq!(pick_among(&mut policy, &[4, 1, 2], 0), 2);
        assert_eq!(pick_among(&mut policy, &[4, 1, 2], 0), 4);
        assert!(provider(&PolicyParameters::from_yaml("start: 1").unwrap()).is_err());
    }
}
