//! `least-busy`: the rank with the least load (by default: active requests), ties to the
//! lowest worker id. Reads no cache signal, so the service can skip the index query.

use std::sync::Arc;

use super::load_metric::{LoadParameters, LoadScorer};
use super::pickers::LowestCostPicker;
use crate::pipeline::WorkerSelectionPolicy;
use crate::registry::{PolicyFactory, PolicyParameters, ProviderError};

/// Parameters: `metric: active_requests | decode_blocks | prefill_tokens`.
pub fn provider(parameters: &PolicyParameters) -> Result<PolicyFactory, ProviderError> {
    let LoadParameters { metric } = parameters.deserialize()?;
    Ok(Arc::new(move |_context| {
        Ok(WorkerSelectionPolicy::new(
            vec![Box::new(LoadScorer { metric })],
            Box::new(LowestCostPicker::default()),
        ))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::WorkerInputs;
    use crate::policies::tests::{build, pick_with_loads};

    #[test]
    fn picks_the_least_loaded_and_reads_no_cache() {
        let policy = build(provider, "");
        assert_eq!(policy.required_inputs(), WorkerInputs::LOAD);
        let mut policy = policy;
        assert_eq!(
            pick_with_loads(&mut policy, &[(3, 900), (1, 0), (2, 5)], 0),
            2
        );
        assert_eq!(
            pick_with_loads(&mut policy, &[(1, 0), (1, 0)], 0),
            1,
            "ties: lowest id"
        );
        let mut by_decode = build(provider, "metric: decode_blocks");
        assert_eq!(pick_with_loads(&mut by_decode, &[(0, 50), (9, 10)], 0), 2);
        assert!(provider(&PolicyParameters::from_yaml("metric: vibes").unwrap()).is_err());
    }
}
