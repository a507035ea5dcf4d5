//! Startup errors of the plugin registry and configuration; each names what is wrong.

use std::fmt;

use kvroute_common::messages::WorkerRole;

use super::parameters::ProviderError;
use super::source::SelectionSource;

/// Which kind of plugin a type name belongs to (each kind is its own name space).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PluginKind {
    WorkerSelection,
    RequestClassifier,
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::WorkerSelection => "worker-selection policy",
            Self::RequestClassifier => "request classifier",
        })
    }
}

/// A registration the registry refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("{kind} type {type_name:?} is already registered")]
    Duplicate { kind: PluginKind, type_name: String },
    #[error("invalid {kind} type name {type_name:?}: use [a-z0-9_-], not empty")]
    InvalidTypeName { kind: PluginKind, type_name: String },
}

/// A plugin configuration that cannot start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid policy YAML: {message}")]
    Yaml { message: String },
    #[error("{field} {message}")]
    InvalidSetting {
        field: &'static str,
        message: String,
    },
    #[error(
        "request_classifier.type {type_name:?} is not a registered request classifier type (registered: {})",
        known.join(", ")
    )]
    UnknownClassifierType {
        type_name: String,
        known: Vec<String>,
    },
    #[error("request_classifier.parameters of type {type_name:?} are invalid: {source}")]
    InvalidClassifierParameters {
        type_name: String,
        source: ProviderError,
    },
    /// The file configures a classifier, and the program runs worker selection only.
    #[error(
        "request_classifier is configured, but {program} cannot run a request classifier (admission, deferral and lifecycle events belong to the router service); remove `request_classifier` from the file for {program}"
    )]
    ClassifierUnsupported { program: String },
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
