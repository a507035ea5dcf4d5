//! Example plugins built outside the router crate. The worker-selection policy
//! `sticky-until-busy` keeps a session on its soft-affinity target until that worker runs more
//! than `busy_threshold` requests, then moves it to the least-loaded worker; the request
//! classifier `session-serial` admits at most `max_in_flight_per_session` requests of a session
//! at once and steers each to the worker its session last used. Register both with
//! [`register`]; see README.md for the walkthrough.

mod classifier;
mod components;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use kvroute_router::pipeline::{WorkerFilter, WorkerScorer, WorkerSelectionPolicy};
use kvroute_router::registry::{
    PolicyFactory, PolicyParameters, ProviderError, RegistryError, RouterPluginRegistry,
};
use serde::Deserialize;

pub use classifier::{
    CLASSIFIER_TYPE_NAME, SessionSerial, SessionSerialParameters, classifier_provider,
};
pub use components::{ActiveRequestsScorer, MaxActiveRequestsFilter, StickyUntilBusyPicker};

/// The type name used in `instances[].type`.
pub const TYPE_NAME: &str = "sticky-until-busy";

/// `parameters:` of a `sticky-until-busy` instance.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parameters {
    /// Leave the affinity target once it runs more than this many requests. Required.
    pub busy_threshold: u64,
    /// Never place on a rank running this many requests or more. Default: no cap.
    #[serde(default)]
    pub max_active_requests: Option<u64>,
}

/// Parses and validates the parameters once, at startup; the factory captures them.
pub fn provider(parameters: &PolicyParameters) -> Result<PolicyFactory, ProviderError> {
    let parameters: Parameters = parameters.deserialize()?;
    if let Some(cap) = parameters.max_active_requests
        && cap <= parameters.busy_threshold
    {
        return Err(ProviderError::new(format!(
            "max_active_requests ({cap}) must be above busy_threshold ({})",
            parameters.busy_threshold
        )));
    }
    Ok(Arc::new(move |_context| {
        let filters: Vec<Box<dyn WorkerFilter>> = parameters
            .max_active_requests
            .map(|limit| Box::new(MaxActiveRequestsFilter { limit }) as Box<dyn WorkerFilter>)
            .into_iter()
            .collect();
        let scorers: Vec<Box<dyn WorkerScorer>> = vec![Box::new(ActiveRequestsScorer)];
        let picker = StickyUntilBusyPicker {
            busy_threshold: parameters.busy_threshold as f64,
        };
        Ok(WorkerSelectionPolicy::new(scorers, Box::new(picker)).with_filters(filters))
    }))
}

/// Adds the worker-selection policy `sticky-until-busy` and the request classifier
/// `session-serial` to `registry`: the catalog's one registration function.
pub fn register(registry: &mut RouterPluginRegistry) -> Result<(), RegistryError> {
    registry.register_worker_selection(TYPE_NAME, Arc::new(provider))?;
    registry.register_request_classifier(CLASSIFIER_TYPE_NAME, Arc::new(classifier_provider))
}
