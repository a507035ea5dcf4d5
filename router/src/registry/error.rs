//! Startup errors of the policy registry and configuration; each names what is wrong.

use kvroute_common::messages::WorkerRole;

use super::parameters::ProviderError;
use super::resolve::SelectionSource;

/// A registration the registry refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("worker-selection policy type {type_name:?} is already registered")]
    Duplicate { type_name: String },
    #[error("invalid worker-selection policy type name {type_name:?}: use [a-z0-9_-], not empty")]
    InvalidTypeName { type_name: String },
}

/// A worker-selection configuration that cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid worker-selection YAML: {message}")]
    Yaml { message: String },
    #[error("policy instance {instance:?} has unknown type {type_name:?} (registered: {})", known.join(", "))]
    UnknownType {
        instance: String,
        type_name: String,
        known: Vec<String>,
    },
    #[error("policy instance name {name:?} is configured more than once")]
    DuplicateInstance { name: String },
    #[error("policy instance name {name:?} is reserved (it selects the built-in policy)")]
    ReservedInstanceName { name: String },
    #[error("policy instance {instance:?} (type {type_name:?}) has invalid parameters: {source}")]
    InvalidParameters {
        instance: String,
        type_name: String,
        source: ProviderError,
    },
    #[error(
        "{role} selection {name:?} (from {origin}) names no configured instance or registered type (registered: {})",
        known.join(", ")
    )]
    UnknownSelection {
        role: WorkerRole,
        name: String,
        /// Where the selection came from: `--decode-policy`, `KVROUTE_DECODE_POLICY`,
        /// `worker_selection.decode`.
        origin: String,
        kind: SelectionSource,
        known: Vec<String>,
    },
    #[error(
        "{role} selection {name:?} (from {origin}) is a policy type that needs parameters: {reason}; configure an instance of it in the policy YAML and select the instance"
    )]
    SelectionNeedsParameters {
        role: WorkerRole,
        name: String,
        origin: String,
        kind: SelectionSource,
        reason: ProviderError,
    },
    /// A request named a registered type that cannot run without parameters.
    #[error(
        "policy {name:?} is a registered type that needs parameters: {source}; name a configured instance of it instead"
    )]
    NeedsParameters { name: String, source: ProviderError },
    #[error(
        "policy instance {instance:?} refused to build for role {role}, partition {partition:?}: {source}"
    )]
    Build {
        instance: String,
        role: WorkerRole,
        partition: String,
        source: ProviderError,
    },
}

impl ConfigError {
    /// Whether the error is about the policy file (its instances, or a selection it makes),
    /// rather than about a selection given by a flag or variable.
    pub fn in_file(&self) -> bool {
        match self {
            Self::UnknownSelection { kind, .. } | Self::SelectionNeedsParameters { kind, .. } => {
                *kind == SelectionSource::Yaml
            }
            Self::Build { .. } | Self::NeedsParameters { .. } => false,
            _ => true,
        }
    }
}
