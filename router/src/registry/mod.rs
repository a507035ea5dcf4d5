//! The plugin registry: type names → providers, for worker-selection policies and request
//! classifiers (two name spaces). A provider parses and validates an instance's parameters
//! once, at startup, and returns a factory that the host calls once per (role, partition) to
//! build a [`WorkerSelectionPolicy`] or a [`RequestClassifier`](crate::classify::RequestClassifier);
//! never per request. [`RouterPluginRegistry::resolve_plugins`] turns the policy file and the
//! flags into the [`RouterPlugins`] bundle.

mod config;
mod error;
mod parameters;
mod plugins;
mod resolve;
mod source;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use kvroute_common::messages::WorkerRole;

pub use config::{
    ClassifierConfig, DisaggregationConfig, PolicyFileError, PolicyInstance, RouterPluginsConfig,
    WorkerSelectionConfig,
};
pub use error::{ConfigError, PluginKind, RegistryError};
pub use parameters::{PolicyParameters, ProviderError};
pub use plugins::{ResolvedClassifier, RouterPlugins};
pub use resolve::{Override, PolicyOverrides, ResolvedPolicies, RoleSelection};
pub use source::SelectionSource;

use crate::classify::RequestClassifierProvider;
use crate::pipeline::WorkerSelectionPolicy;

/// The type (and reserved selection name) of the built-in cost model: what a role without a
/// configured selection uses. The built-ins themselves live in `crate::policies`, which
/// depends on this module and not the other way round.
pub const DEFAULT_TYPE: &str = "default";

/// What a factory is building for.
#[derive(Debug, Clone, Copy)]
pub struct PolicyBuildContext<'a> {
    /// The configured instance name (or `default`).
    pub instance: &'a str,
    pub role: WorkerRole,
    /// The routing partition, e.g. the model name: distinct state per partition.
    pub partition: &'a str,
}

/// Builds one policy per (role, partition); captures the validated parameters.
pub type PolicyFactory = Arc<
    dyn Fn(&PolicyBuildContext<'_>) -> Result<WorkerSelectionPolicy, ProviderError> + Send + Sync,
>;

/// Validates an instance's parameters and returns its factory.
pub type PolicyProvider =
    Arc<dyn Fn(&PolicyParameters) -> Result<PolicyFactory, ProviderError> + Send + Sync>;

/// Registered plugin types: worker-selection policies and request classifiers, each its own
/// name space. Start from [`RouterPluginRegistry::with_builtins`], then let each catalog
/// register its own types.
#[derive(Clone, Default)]
pub struct RouterPluginRegistry {
    providers: BTreeMap<String, PolicyProvider>,
    classifiers: BTreeMap<String, RequestClassifierProvider>,
}

impl RouterPluginRegistry {
    /// An empty registry (not even `default` or `pass-through`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a worker-selection policy type; a name registered twice is refused rather than
    /// overridden.
    pub fn register_worker_selection(
        &mut self,
        type_name: &str,
        provider: PolicyProvider,
    ) -> Result<(), RegistryError> {
        insert(
            &mut self.providers,
            PluginKind::WorkerSelection,
            type_name,
            provider,
        )
    }

    /// Adds a request classifier type, under the same rules as worker-selection types.
    pub fn register_request_classifier(
        &mut self,
        type_name: &str,
        provider: RequestClassifierProvider,
    ) -> Result<(), RegistryError> {
        insert(
            &mut self.classifiers,
            PluginKind::RequestClassifier,
            type_name,
            provider,
        )
    }

    /// Registered worker-selection policy type names, sorted.
    pub fn types(&self) -> impl Iterator<Item = &str> {
        self.providers.keys().map(String::as_str)
    }

    /// Registered request classifier type names, sorted.
    pub fn request_classifier_types(&self) -> impl Iterator<Item = &str> {
        self.classifiers.keys().map(String::as_str)
    }

    pub(crate) fn provider(&self, type_name: &str) -> Option<&PolicyProvider> {
        self.providers.get(type_name)
    }

    pub(crate) fn classifier_provider(
        &self,
        type_name: &str,
    ) -> Option<&RequestClassifierProvider> {
        self.classifiers.get(type_name)
    }
}

/// A type name is `[a-z0-9_-]+`, and registered once per kind.
fn insert<P>(
    providers: &mut BTreeMap<String, P>,
    kind: PluginKind,
    type_name: &str,
    provider: P,
) -> Result<(), RegistryError> {
    let valid = !type_name.is_empty()
        && type_name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !valid {
        return Err(RegistryError::InvalidTypeName {
            kind,
            type_name: type_name.to_owned(),
        });
    }
    if providers.contains_key(type_name) {
        return Err(RegistryError::Duplicate {
            kind,
            type_name: type_name.to_owned(),
        });
    }
    providers.insert(type_name.to_owned(), provider);
    Ok(())
}

impl fmt::Debug for RouterPluginRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouterPluginRegistry")
            .field(
                "worker_selection",
                &self.providers.keys().collect::<Vec<_>>(),
            )
            .field(
                "request_classifier",
                &self.classifiers.keys().collect::<Vec<_>>(),
            )
            .finish()
    }
}
