//! The policy registry: type names → providers. A provider parses and validates an instance's
//! parameters once, at startup, and returns a factory that the service calls once per
//! (role, partition) to build a [`WorkerSelectionPolicy`].

mod config;
mod error;
mod parameters;
mod resolve;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use kvroute_common::messages::WorkerRole;

pub use config::{PolicyFileError, PolicyInstance, WorkerSelectionConfig};
pub use error::{ConfigError, RegistryError};
pub use parameters::{PolicyParameters, ProviderError};
pub use resolve::{Override, PolicyOverrides, ResolvedPolicies, RoleSelection, SelectionSource};

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

/// Registered policy types. Start from [`PolicyRegistry::with_builtins`], then let each policy
/// catalog register its own types.
#[derive(Clone, Default)]
pub struct PolicyRegistry {
    providers: BTreeMap<String, PolicyProvider>,
}

impl PolicyRegistry {
    /// An empty registry (not even `default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a type; a name registered twice is refused rather than overridden.
    pub fn register(
        &mut self,
        type_name: &str,
        provider: PolicyProvider,
    ) -> Result<(), RegistryError> {
        let valid = !type_name.is_empty()
            && type_name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !valid {
            return Err(RegistryError::InvalidTypeName {
                type_name: type_name.to_owned(),
            });
        }
        if self.providers.contains_key(type_name) {
            return Err(RegistryError::Duplicate {
                type_name: type_name.to_owned(),
            });
        }
        self.providers.insert(type_name.to_owned(), provider);
        Ok(())
    }

    /// Registered type names, sorted.
    pub fn types(&self) -> impl Iterator<Item = &str> {
        self.providers.keys().map(String::as_str)
    }

    pub(crate) fn provider(&self, type_name: &str) -> Option<&PolicyProvider> {
        self.providers.get(type_name)
    }
}

impl fmt::Debug for PolicyRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyRegistry")
            .field("types", &self.providers.keys().collect::<Vec<_>>())
            .finish()
    }
}
