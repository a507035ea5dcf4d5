//! The policy file (`--policy-config`): which configured instance serves each role, the
//! instances, and the request classifier. Either section may be omitted, not both.
//!
//! ```yaml
//! worker_selection:
//!   aggregated: kv-tuned        # an instance name, a registered type, or `default`
//!   decode: least-busy
//!   instances:
//!     - name: kv-tuned
//!       type: default
//!       parameters: { overlap_score_credit: 0.5 }
//! request_classifier:           # absent: pass-through admission
//!   type: max-in-flight
//!   parameters: { per_worker: 8 }
//! ```

use kvroute_common::messages::{Disaggregation, WorkerRole};
use serde::Deserialize;

use super::error::ConfigError;
use super::parameters::PolicyParameters;

/// The whole policy file; unknown keys are refused.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterPluginsConfig {
    /// Absent: every role uses the built-in policy (unless a flag selects one).
    #[serde(default)]
    pub worker_selection: WorkerSelectionConfig,
    /// Absent: pass-through admission.
    #[serde(default)]
    pub request_classifier: Option<ClassifierConfig>,
    /// How requests of models with prefill and decode workers are served.
    #[serde(default)]
    pub disaggregation: DisaggregationConfig,
}

/// `disaggregation:`, for requests of role `aggregated` whose model has prefill and decode
/// workers:
///
/// ```yaml
/// disaggregation:
///   mode: conditional          # never | always (default) | conditional
///   min_uncached_tokens: 512   # conditional: disaggregate a prompt with at least this many
///   min_uncached_fraction: 0.5 #   tokens, and this share of it, not cached on the prefill worker
///   busy_prefill_tokens: 8192  # ... or whatever it is, when that worker has this much prefill
/// ```
///
/// A request that is not disaggregated is served end to end by one worker: an aggregated one
/// when the model has any and the mode is `never`, else the prefill worker chosen for it (a
/// decode worker only ever gets a request with transfer parameters).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationConfig {
    #[serde(default)]
    pub mode: Disaggregation,
    #[serde(default = "DisaggregationConfig::default_min_uncached_tokens")]
    pub min_uncached_tokens: u64,
    #[serde(default = "DisaggregationConfig::default_min_uncached_fraction")]
    pub min_uncached_fraction: f64,
    /// Absent: the prefill worker's load does not decide.
    #[serde(default)]
    pub busy_prefill_tokens: Option<u64>,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            mode: Disaggregation::default(),
            min_uncached_tokens: Self::default_min_uncached_tokens(),
            min_uncached_fraction: Self::default_min_uncached_fraction(),
            busy_prefill_tokens: None,
        }
    }
}

impl DisaggregationConfig {
    fn default_min_uncached_tokens() -> u64 {
        512
    }

    fn default_min_uncached_fraction() -> f64 {
        0.5
    }

    /// Refuses a setting that cannot work, naming it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = self.min_uncached_fraction;
        if !(0.0..=1.0).contains(&f) {
            return Err(ConfigError::InvalidSetting {
                field: "disaggregation.min_uncached_fraction",
                message: format!("must be in [0, 1], got {f}"),
            });
        }
        if self.busy_prefill_tokens == Some(0) {
            return Err(ConfigError::InvalidSetting {
                field: "disaggregation.busy_prefill_tokens",
                message: "must be at least 1 (omit it to leave the prefill load out)".into(),
            });
        }
        Ok(())
    }

    /// Whether a request in `mode` whose prompt of `prompt_tokens` has `uncached_tokens` to
    /// prefill on its chosen prefill worker, which has `prefill_load` prefill tokens in
    /// flight, gets a decode hop.
    pub fn disaggregates(
        &self,
        mode: Disaggregation,
        prompt_tokens: u64,
        uncached_tokens: u64,
        prefill_load: u64,
    ) -> bool {
        match mode {
            Disaggregation::Never => false,
            Disaggregation::Always => true,
            Disaggregation::Conditional => {
                let long = uncached_tokens >= self.min_uncached_tokens
                    && uncached_tokens as f64 >= self.min_uncached_fraction * prompt_tokens as f64;
                let busy = self.busy_prefill_tokens.is_some_and(|b| prefill_load >= b);
                long || busy
            }
        }
    }
}

/// `request_classifier:`, one classifier for every (decode or aggregated) partition.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifierConfig {
    /// A registered request classifier type.
    #[serde(rename = "type")]
    pub type_name: String,
    #[serde(default)]
    pub parameters: PolicyParameters,
}

impl RouterPluginsConfig {
    /// Parses a policy file; an empty document is refused, not read as "no configuration".
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let file: Option<Self> = serde_norway::from_str(text).map_err(|e| ConfigError::Yaml {
            message: e.to_string(),
        })?;
        file.ok_or_else(|| ConfigError::Yaml {
            message: "the file is empty; expected a `worker_selection` mapping, a \
                      `request_classifier` mapping or both"
                .into(),
        })
    }

    /// Reads and parses the policy file at `path`.
    pub fn from_file(path: &std::path::Path) -> Result<Self, PolicyFileError> {
        let text = std::fs::read_to_string(path).map_err(PolicyFileError::Read)?;
        Ok(Self::from_yaml(&text)?)
    }

    /// The worker selection alone, for a program that cannot run a classifier's lifecycle (the
    /// offline tools, named by `program` in the message): a configured `request_classifier`
    /// is refused rather than ignored.
    pub fn without_classifier(self, program: &str) -> Result<WorkerSelectionConfig, ConfigError> {
        match self.request_classifier {
            Some(_) => Err(ConfigError::ClassifierUnsupported {
                program: program.to_owned(),
            }),
            None => Ok(self.worker_selection),
        }
    }
}

/// A policy file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyFileError {
    #[error("cannot be read: {}", kvroute_common::config::io_reason(.0))]
    Read(std::io::Error),
    #[error(transparent)]
    Content(#[from] ConfigError),
}

/// Per-role selections and the configured instances. An omitted role uses the built-in policy;
/// one role never falls back to another role's selection.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSelectionConfig {
    #[serde(default)]
    pub aggregated: Option<String>,
    #[serde(default)]
    pub prefill: Option<String>,
    #[serde(default)]
    pub decode: Option<String>,
    #[serde(default)]
    pub encode: Option<String>,
    #[serde(default)]
    pub instances: Vec<PolicyInstance>,
}

/// One configured policy: a unique name, a registered type and that type's parameters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyInstance {
    pub name: String,
    #[serde(rename = "type")]
    pub type_name: String,
    #[serde(default)]
    pub parameters: PolicyParameters,
}

impl WorkerSelectionConfig {
    /// Parses a policy file for worker selection only: as [`RouterPluginsConfig::from_yaml`],
    /// and a `request_classifier` is refused ([`ConfigError::ClassifierUnsupported`]).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        RouterPluginsConfig::from_yaml(text)?.without_classifier("worker selection alone")
    }

    /// The YAML selection for `role`, if any.
    pub fn selection(&self, role: WorkerRole) -> Option<&str> {
        match role {
            WorkerRole::Aggregated => self.aggregated.as_deref(),
            WorkerRole::Prefill => self.prefill.as_deref(),
            WorkerRole::Decode => self.decode.as_deref(),
            WorkerRole::Encode => self.encode.as_deref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disaggregation_parses_validates_and_decides() {
        let config = RouterPluginsConfig::from_yaml(
            "disaggregation:\n  mode: conditional\n  min_uncached_tokens: 100\n  min_uncached_fraction: 0.25\n  busy_prefill_tokens: 1000\n",
        )
        .unwrap()
        .disaggregation;
        config.validate().unwrap();
        let conditional = Disaggregation::Conditional;
        // Long and mostly uncached: a pair.
        assert!(config.disaggregates(conditional, 400, 400, 0));
        // Too short, or mostly cached: one worker, unless that worker is busy.
        assert!(!config.disaggregates(conditional, 400, 99, 0));
        assert!(!config.disaggregates(conditional, 1_000, 200, 0));
        assert!(config.disaggregates(conditional, 1_000, 200, 1_000));
        assert!(config.disaggregates(Disaggregation::Always, 1, 0, 0));
        assert!(!config.disaggregates(Disaggregation::Never, 10_000, 10_000, 10_000));
        assert_eq!(
            RouterPluginsConfig::default().disaggregation.mode,
            Disaggregation::Always
        );
        let bad = RouterPluginsConfig::from_yaml("disaggregation:\n  min_uncached_fraction: 2\n")
            .unwrap()
            .disaggregation
            .validate()
            .unwrap_err();
        assert!(
            bad.to_string()
                .contains("disaggregation.min_uncached_fraction"),
            "{bad}"
        );
        assert!(RouterPluginsConfig::from_yaml("disaggregation:\n  mode: sometimes\n").is_err());
    }

    #[test]
    fn the_seed_shape_parses() {
        let config = WorkerSelectionConfig::from_yaml(
            "worker_selection:\n  aggregated: a\n  decode: b\n  instances:\n    - name: a\n      type: least-busy\n      parameters:\n        metric: active_requests\n    - name: b\n      type: random\n",
        )
        .unwrap();
        assert_eq!(config.selection(WorkerRole::Aggregated), Some("a"));
        assert_eq!(config.selection(WorkerRole::Prefill), None);
        assert_eq!(config.instances.len(), 2);
        assert!(config.instances[1].parameters.is_empty());
    }

    #[test]
    fn an_empty_file_is_refused() {
        for empty in ["", "\n", "# only a comment\n", "~\n"] {
            let err = RouterPluginsConfig::from_yaml(empty)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("empty; expected a `worker_selection` mapping"),
                "{empty:?}: {err}"
            );
        }
        assert_eq!(
            WorkerSelectionConfig::from_yaml("worker_selection: {}\n").unwrap(),
            Default::default()
        );
        assert_eq!(
            RouterPluginsConfig::from_yaml("{}\n").unwrap(),
            Default::default(),
            "an explicit empty mapping selects the built-ins"
        );
    }

    #[test]
    fn a_file_may_hold_only_a_classifier() {
        let config = RouterPluginsConfig::from_yaml(
            "request_classifier:\n  type: max-in-flight\n  parameters: {per_worker: 4}\n",
        )
        .unwrap();
        assert_eq!(config.worker_selection, WorkerSelectionConfig::default());
        let classifier = config.request_classifier.clone().unwrap();
        assert_eq!(classifier.type_name, "max-in-flight");
        assert!(!classifier.parameters.is_empty());
        let bare =
            RouterPluginsConfig::from_yaml("request_classifier: {type: pass-through}\n").unwrap();
        assert!(bare.request_classifier.unwrap().parameters.is_empty());
        // Programs that select workers only refuse it instead of ignoring it.
        let err = config.without_classifier("kvroute-sim").unwrap_err();
        assert_eq!(
            err,
            ConfigError::ClassifierUnsupported {
                program: "kvroute-sim".into()
            }
        );
        assert!(
            err.to_string()
                .starts_with("request_classifier is configured, but kvroute-sim cannot run"),
            "{err}"
        );
        let err = WorkerSelectionConfig::from_yaml(
            "worker_selection: {}\nrequest_classifier: {type: pass-through}\n",
        )
        .unwrap_err();
        assert!(matches!(err, ConfigError::ClassifierUnsupported { .. }));
    }

    #[test]
    fn a_classifier_without_type_or_with_unknown_keys_is_refused_naming_them() {
        let err = RouterPluginsConfig::from_yaml("request_classifier: {}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("request_classifier") && err.contains("type"),
            "{err}"
        );
        let err = RouterPluginsConfig::from_yaml(
            "request_classifier:\n  type: pass-through\n  params: {}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("params"), "{err}");
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let err = WorkerSelectionConfig::from_yaml("worker_selection:\n  agregated: a\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("agregated"), "{err}");
        let err = RouterPluginsConfig::from_yaml("request_clasifier: {type: pass-through}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("request_clasifier"), "{err}");
    }
}
