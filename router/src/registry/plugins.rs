//! The resolved plugin bundle: the worker-selection policies of every role and the request
//! classifier, validated at startup and built by the host once per partition.

use std::fmt;

use super::RouterPluginRegistry;
use super::config::{DisaggregationConfig, RouterPluginsConfig};
use super::error::ConfigError;
use super::resolve::{PolicyOverrides, ResolvedPolicies};
use crate::classify::{RequestClassifier, RequestClassifierContext, RequestClassifierFactory};

/// Everything a host needs to build its plugins: [`ResolvedPolicies`] and, when configured, the
/// request classifier.
#[derive(Clone, Debug)]
pub struct RouterPlugins {
    pub policies: ResolvedPolicies,
    /// `None`: pass-through admission (no `request_classifier` in the file).
    pub classifier: Option<ResolvedClassifier>,
    pub disaggregation: DisaggregationConfig,
}

/// The configured request classifier: its type and its validated factory.
#[derive(Clone)]
pub struct ResolvedClassifier {
    type_name: String,
    factory: RequestClassifierFactory,
}

impl ResolvedClassifier {
    pub fn new(type_name: impl Into<String>, factory: RequestClassifierFactory) -> Self {
        Self {
            type_name: type_name.into(),
            factory,
        }
    }

    /// The registered type (`request_classifier.type`).
    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    pub fn factory(&self) -> &RequestClassifierFactory {
        &self.factory
    }

    /// A fresh classifier for one partition; call once per partition and keep it.
    pub fn build(&self, context: &RequestClassifierContext) -> Box<dyn RequestClassifier> {
        (self.factory)(context)
    }
}

impl fmt::Debug for ResolvedClassifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedClassifier")
            .field("type_name", &self.type_name)
            .finish_non_exhaustive()
    }
}

impl RouterPluginRegistry {
    /// Validates the whole policy file — every worker-selection instance (as
    /// [`resolve`](Self::resolve), with the same overrides) and the request classifier's type
    /// and parameters — and returns the bundle. No plugin is built here.
    pub fn resolve_plugins(
        &self,
        config: &RouterPluginsConfig,
        overrides: &PolicyOverrides,
    ) -> Result<RouterPlugins, ConfigError> {
        let policies = self.resolve(&config.worker_selection, overrides)?;
        config.disaggregation.validate()?;
        let classifier = match &config.request_classifier {
            None => None,
            Some(configured) => {
                let type_name = configured.type_name.as_str();
                let provider = self.classifier_provider(type_name).ok_or_else(|| {
                    ConfigError::UnknownClassifierType {
                        type_name: type_name.to_owned(),
                        known: self.request_classifier_types().map(str::to_owned).collect(),
                    }
                })?;
                let factory = provider(&configured.parameters).map_err(|source| {
                    ConfigError::InvalidClassifierParameters {
                        type_name: type_name.to_owned(),
                        source,
                    }
                })?;
                Some(ResolvedClassifier::new(type_name, factory))
            }
        };
        Ok(RouterPlugins {
            policies,
            classifier,
            disaggregation: config.disaggregation,
        })
    }
}
