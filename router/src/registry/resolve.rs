//! Startup resolution: validate every configured instance, then choose one per role by
//! precedence — role flag > all-roles selection (`--worker-selection-policy`) > YAML >
//! built-in. Errors name where the selection came from.

use std::collections::BTreeMap;
use std::fmt;

use kvroute_common::messages::WorkerRole;

use super::DEFAULT_TYPE;
use super::config::WorkerSelectionConfig;
use super::error::ConfigError;
use super::parameters::{PolicyParameters, ProviderError};
use super::source::SelectionSource;
use super::{PolicyBuildContext, PolicyFactory, RouterPluginRegistry};
use crate::pipeline::WorkerSelectionPolicy;

/// One selection given outside the YAML: the name, and where it came from, as errors name it
/// (`--decode-policy`, or `KVROUTE_DECODE_POLICY` when the value came from the environment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    pub name: String,
    pub origin: String,
}

impl Override {
    pub fn new(name: impl Into<String>, origin: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            origin: origin.into(),
        }
    }
}

/// Selections given outside the YAML. The binary reads flags and the environment; library code
/// never does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyOverrides {
    /// `--prefill-policy` (or `KVROUTE_PREFILL_POLICY`).
    pub prefill: Option<Override>,
    /// `--decode-policy` (or `KVROUTE_DECODE_POLICY`).
    pub decode: Option<Override>,
    /// `--worker-selection-policy` (or `KVROUTE_WORKER_SELECTION_POLICY`): every role.
    pub all_roles: Option<Override>,
}

/// The policy chosen for one role.
#[derive(Clone)]
pub struct RoleSelection {
    /// The instance name (`default` for the built-in policy, or a bare type name).
    pub instance: String,
    pub source: SelectionSource,
    /// Exactly where the selection came from: the flag or environment variable, the YAML key
    /// (`worker_selection.decode`), or `built-in`.
    pub origin: String,
    factory: PolicyFactory,
}

impl fmt::Debug for RoleSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoleSelection")
            .field("instance", &self.instance)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// One validated factory per role, ready to build policies per partition, plus every policy a
/// request may ask for by name (`SelectRequest.policy`): the configured instances and each
/// registered type that accepts empty parameters (the others, with why they need
/// parameters, so a request naming one is told).
#[derive(Clone)]
pub struct ResolvedPolicies {
    roles: BTreeMap<WorkerRole, RoleSelection>,
    named: BTreeMap<String, PolicyFactory>,
    needs_parameters: BTreeMap<String, ProviderError>,
}

impl fmt::Debug for ResolvedPolicies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedPolicies")
            .field("roles", &self.roles)
            .field("named", &self.named.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl ResolvedPolicies {
    pub fn selection(&self, role: WorkerRole) -> &RoleSelection {
        &self.roles[&role]
    }

    /// Builds the policy named `name` (a configured instance or a registered type) for `role`
    /// and `partition`, for requests that ask for it; `None` if no such policy exists, and
    /// [`ConfigError::NeedsParameters`] for a registered type that cannot run without them.
    pub fn build_named(
        &self,
        name: &str,
        role: WorkerRole,
        partition: &str,
    ) -> Option<Result<WorkerSelectionPolicy, ConfigError>> {
        let Some(factory) = self.named.get(name) else {
            return self.needs_parameters.get(name).map(|source| {
                Err(ConfigError::NeedsParameters {
                    name: name.to_owned(),
                    source: source.clone(),
                })
            });
        };
        let context = PolicyBuildContext {
            instance: name,
            role,
            partition,
        };
        Some(
            factory(&context)
                .map(|policy| policy.named(name.to_owned()))
                .map_err(|source| ConfigError::Build {
                    instance: name.to_owned(),
                    role,
                    partition: partition.to_owned(),
                    source,
                }),
        )
    }

    /// Builds the policy for `role` and `partition`; call once per pair and keep the result.
    pub fn build(
        &self,
        role: WorkerRole,
        partition: &str,
    ) -> Result<WorkerSelectionPolicy, ConfigError> {
        let selection = self.selection(role);
        let context = PolicyBuildContext {
            instance: &selection.instance,
            role,
            partition,
        };
        (selection.factory)(&context)
            .map(|policy| policy.named(selection.instance.clone()))
            .map_err(|source| ConfigError::Build {
                instance: selection.instance.clone(),
                role,
                partition: partition.to_owned(),
                source,
            })
    }
}

impl RouterPluginRegistry {
    /// Validates `config` (every instance, used or not) and resolves each role's selection.
    pub fn resolve(
        &self,
        config: &WorkerSelectionConfig,
        overrides: &PolicyOverrides,
    ) -> Result<ResolvedPolicies, ConfigError> {
        let mut instances: BTreeMap<&str, PolicyFactory> = BTreeMap::new();
        for instance in &config.instances {
            if instance.name == DEFAULT_TYPE || instance.name.is_empty() {
                return Err(ConfigError::ReservedInstanceName {
                    name: instance.name.clone(),
                });
            }
            if instances.contains_key(instance.name.as_str()) {
                return Err(ConfigError::DuplicateInstance {
                    name: instance.name.clone(),
                });
            }
            let provider =
                self.provider(&instance.type_name)
                    .ok_or_else(|| ConfigError::UnknownType {
                        instance: instance.name.clone(),
                        type_name: instance.type_name.clone(),
                        known: self.types().map(str::to_owned).collect(),
                    })?;
            let factory = provider(&instance.parameters).map_err(|source| {
                ConfigError::InvalidParameters {
                    instance: instance.name.clone(),
                    type_name: instance.type_name.clone(),
                    source,
                }
            })?;
            instances.insert(&instance.name, factory);
        }

        let mut roles = BTreeMap::new();
        for role in WorkerRole::ALL {
            let role_flag = match role {
                WorkerRole::Prefill => overrides.prefill.as_ref(),
                WorkerRole::Decode => overrides.decode.as_ref(),
                _ => None,
            };
            let yaml = config
                .selection(role)
                .map(|name| Override::new(name, format!("worker_selection.{role}")));
            let chosen = [
                (role_flag.cloned(), SelectionSource::RoleFlag),
                (overrides.all_roles.clone(), SelectionSource::Env),
                (yaml, SelectionSource::Yaml),
            ]
            .into_iter()
            .find_map(|(selection, source)| selection.map(|s| (s, source)));
            let (name, origin, source) = match &chosen {
                Some((s, source)) => (s.name.as_str(), s.origin.as_str(), *source),
                None => (DEFAULT_TYPE, "built-in", SelectionSource::BuiltIn),
            };

            let factory = match instances.get(name) {
                Some(factory) => factory.clone(),
                None => self.bare_type(role, name, origin, source)?,
            };
            roles.insert(
                role,
                RoleSelection {
                    instance: name.to_owned(),
                    source,
                    origin: origin.to_owned(),
                    factory,
                },
            );
        }
        let mut named: BTreeMap<String, PolicyFactory> = BTreeMap::new();
        let mut needs_parameters = BTreeMap::new();
        for t in self.types() {
            if let Some(provider) = self.provider(t) {
                match provider(&PolicyParameters::default()) {
                    Ok(factory) => {
                        named.insert(t.to_owned(), factory);
                    }
                    Err(e) => {
                        needs_parameters.insert(t.to_owned(), e);
                    }
                }
            }
        }
        for (name, factory) in instances {
            named.insert(name.to_owned(), factory);
        }
        Ok(ResolvedPolicies {
            roles,
            named,
            needs_parameters,
        })
    }

    /// A selection naming a registered type directly (`default` included): the type with
    /// empty parameters.
    fn bare_type(
        &self,
        role: WorkerRole,
        name: &str,
        origin: &str,
        source: SelectionSource,
    ) -> Result<PolicyFactory, ConfigError> {
        let provider = self
            .provider(name)
            .ok_or_else(|| ConfigError::UnknownSelection {
                role,
                name: name.to_owned(),
                origin: origin.to_owned(),
                kind: source,
                known: self.types().map(str::to_owned).collect(),
            })?;
        provider(&PolicyParameters::default()).map_err(|reason| {
            ConfigError::SelectionNeedsParameters {
                role,
                name: name.to_owned(),
                origin: origin.to_owned(),
                kind: source,
                reason,
            }
        })
    }
}
