//! The worker-selection YAML: which configured instance serves each role, and the instances.
//!
//! ```yaml
//! worker_selection:
//!   aggregated: kv-tuned        # an instance name, a registered type, or `default`
//!   decode: least-busy
//!   instances:
//!     - name: kv-tuned
//!       type: default
//!       parameters: { overlap_score_credit: 0.5 }
//! ```

use kvroute_common::messages::WorkerRole;
use serde::Deserialize;

use super::error::ConfigError;
use super::parameters::PolicyParameters;

/// The policy file; only `worker_selection` is understood, anything else is refused.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    worker_selection: WorkerSelectionConfig,
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
    /// Parses a policy file (a document with a top-level `worker_selection:` key); an empty
    /// document is refused, not read as "no configuration".
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let file: Option<PolicyFile> =
            serde_norway::from_str(text).map_err(|e| ConfigError::Yaml {
                message: e.to_string(),
            })?;
        match file {
            Some(file) => Ok(file.worker_selection),
            None => Err(ConfigError::Yaml {
                message: "the file is empty; expected a `worker_selection` mapping".into(),
            }),
        }
    }

    /// Reads and parses the policy file at `path`.
    pub fn from_file(path: &std::path::Path) -> Result<Self, PolicyFileError> {
        let text = std::fs::read_to_string(path).map_err(PolicyFileError::Read)?;
        Ok(Self::from_yaml(&text)?)
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
            let err = WorkerSelectionConfig::from_yaml(empty)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("empty; expected a `worker_selection` mapping"),
                "{empty:?}: {err}"
            );
        }
        let err = WorkerSelectionConfig::from_yaml("{}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("worker_selection"), "{err}");
        assert_eq!(
            WorkerSelectionConfig::from_yaml("worker_selection: {}\n").unwrap(),
            Default::default()
        );
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let err = WorkerSelectionConfig::from_yaml("worker_selection:\n  agregated: a\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("agregated"), "{err}");
        let err = WorkerSelectionConfig::from_yaml("request_classifier: {}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("request_classifier"), "{err}");
    }
}
