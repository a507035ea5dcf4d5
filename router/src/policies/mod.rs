//! The built-in worker-selection policies, one per file, and their registration.

pub mod default;
pub mod device_aware;
pub mod least_busy;
pub mod load_metric;
pub mod pickers;
pub mod power_of_two;
pub mod random;
pub mod round_robin;

use std::sync::Arc;

pub use crate::registry::DEFAULT_TYPE;
use crate::registry::{RegistryError, RouterPluginRegistry};

impl RouterPluginRegistry {
    /// A registry holding the built-in types: the worker-selection policies (`default`,
    /// `least-busy`, `round-robin`, `random`, `power-of-two`, `device-aware-weighted`) and the
    /// request classifiers (`pass-through`, `max-in-flight`, from `crate::classify`).
    pub fn with_builtins() -> Self {
        let mut registry = Self::new();
        register_builtins(&mut registry).expect("built-in policy type names are valid and unique");
        crate::classify::register_builtins(&mut registry)
            .expect("built-in classifier type names are valid and unique");
        registry
    }
}

/// Registers `default`, `least-busy`, `round-robin`, `random`, `power-of-two` and
/// `device-aware-weighted`.
pub fn register_builtins(registry: &mut RouterPluginRegistry) -> Result<(), RegistryError> {
    registry.register_worker_selection(DEFAULT_TYPE, Arc::new(default::provider))?;
    registry.register_worker_selection("least-busy", Arc::new(least_busy::provider))?;
    registry.register_worker_selection("round-robin", Arc::new(round_robin::provider))?;
    registry.register_worker_selection("random", Arc::new(random::provider))?;
    registry.register_worker_selection("power-of-two", Arc::new(power_of_two::provider))?;
    registry.register_worker_selection(device_aware::TYPE, Arc::new(device_aware::provider))?;
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    //! Helpers for the built-in policies' tests.

    use kvroute_common::messages::{WorkerCard, WorkerRole};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use crate::pipeline::{LoadSignals, WorkerCandidate, WorkerSelectionPolicy};
    use crate::registry::{PolicyBuildContext, PolicyFactory, PolicyParameters, ProviderError};
    use crate::request::RequestContext;
    use crate::signals::ObservedLoad;
    use crate::testing::card;
    use crate::worker::WorkerRank;

    /// Builds a policy from a provider and YAML parameters.
    pub fn build(
        provider: fn(&PolicyParameters) -> Result<PolicyFactory, ProviderError>,
        yaml: &str,
    ) -> WorkerSelectionPolicy {
        let factory = provider(&PolicyParameters::from_yaml(yaml).unwrap()).unwrap();
        factory(&PolicyBuildContext {
            instance: "test",
            role: WorkerRole::Aggregated,
            partition: "m",
        })
        .unwrap()
    }

    fn pick(
        policy: &mut WorkerSelectionPolicy,
        cards: &[WorkerCard],
        loads: &[(u64, u64)],
        seed: u64,
    ) -> u64 {
        let rows = cards
            .iter()
            .zip(loads)
            .map(|(c, (requests, decode))| {
                let load = ObservedLoad {
                    active_requests: *requests,
                    active_decode_blocks: *decode,
                    ..ObservedLoad::default()
                };
                WorkerCandidate::new(WorkerRank::new(c.worker_id, 0), c)
                    .with_load(LoadSignals::project(Some(load), 1))
            })
            .collect();
        let mut rng = StdRng::seed_from_u64(seed);
        policy
            .run(&RequestContext::new(1, 16), rows, &mut rng)
            .unwrap()
            .row
            .worker()
            .worker_id
    }

    /// Workers `1..=n` with (active requests, decode blocks) each; returns the chosen id.
    pub fn pick_with_loads(
        policy: &mut WorkerSelectionPolicy,
        loads: &[(u64, u64)],
        seed: u64,
    ) -> u64 {
        let cards: Vec<WorkerCard> = (1..=loads.len() as u64).map(card).collect();
        pick(policy, &cards, loads, seed)
    }

    /// Workers with the given ids (in that row order), idle; returns the chosen id.
    pub fn pick_among(policy: &mut WorkerSelectionPolicy, ids: &[u64], seed: u64) -> u64 {
        let cards: Vec<WorkerCard> = ids.iter().map(|id| card(*id)).collect();
        pick(policy, &cards, &vec![(0, 0); ids.len()], seed)
    }
}
