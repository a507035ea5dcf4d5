//! A policy instance's `parameters:` mapping, kept as parsed YAML until its provider turns it
//! into a typed, validated struct (once, at startup).

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_norway::{Mapping, Value};

/// Why a provider refused its parameters (or a factory its partition).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ProviderError {
    pub message: String,
}

impl ProviderError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// The raw parameters of one configured instance; absent or `null` means an empty mapping.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyParameters(Value);

impl Default for PolicyParameters {
    fn default() -> Self {
        Self(Value::Mapping(Mapping::new()))
    }
}

impl PolicyParameters {
    /// Parses a YAML mapping (handy in tests and for embedders).
    pub fn from_yaml(text: &str) -> Result<Self, ProviderError> {
        serde_norway::from_str(text).map_err(|e| ProviderError::new(e.to_string()))
    }

    /// Deserializes into the provider's parameter struct. Use `#[serde(deny_unknown_fields)]`
    /// on it so misspelled fields stop startup instead of being ignored. Errors speak of
    /// parameters ("parameter `limit` is required"), not of serde's fields.
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, ProviderError> {
        // Through text, not `from_value`: only the text deserializer says which field a bad
        // value belongs to ("per_model: invalid value ..."). Runs once per instance, at startup.
        let text =
            serde_norway::to_string(&self.0).map_err(|e| ProviderError::new(e.to_string()))?;
        serde_norway::from_str(&text).map_err(|e| ProviderError::new(in_words(&e.to_string())))
    }

    /// Whether the mapping is empty (the instance was configured without parameters).
    pub fn is_empty(&self) -> bool {
        matches!(&self.0, Value::Mapping(m) if m.is_empty())
    }
}

/// serde's "missing field `x`" / "unknown field `x`" / "x: invalid value" as parameters,
/// without the position in the re-serialized text (it is not the user's file).
fn in_words(message: &str) -> String {
    let message = match message.rfind(" at line ") {
        Some(at) if message[at..].contains(" column ") => &message[..at],
        _ => message,
    };
    if let Some((path, rest)) = message.split_once(": ")
        && !path.is_empty()
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'[' | b']'))
    {
        return format!("parameter `{path}`: {}", in_words(rest));
    }
    if let Some(rest) = message.strip_prefix("missing field ") {
        let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
        let tail = if tail.is_empty() {
            String::new()
        } else {
            format!(" {tail}")
        };
        format!("parameter {name} is required{tail}")
    } else if let Some(rest) = message.strip_prefix("unknown field ") {
        format!("unknown parameter {rest}")
    } else {
        message.to_owned()
    }
}

impl<'de> Deserialize<'de> for PolicyParameters {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::Null => Ok(Self::default()),
            value @ Value::Mapping(_) => Ok(Self(value)),
            _ => Err(serde::de::Error::custom("parameters must be a mapping")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Params {
        limit: u32,
        #[serde(default)]
        scale: f64,
    }

    #[test]
    fn parameters_deserialize_strictly() {
        let p = PolicyParameters::from_yaml("limit: 3").unwrap();
        assert_eq!(
            p.deserialize::<Params>().unwrap(),
            Params {
                limit: 3,
                scale: 0.0
            }
        );
        let typo = PolicyParameters::from_yaml("limit: 3\nscael: 1").unwrap();
        let err = typo.deserialize::<Params>().unwrap_err();
        assert!(
            err.message.starts_with("unknown parameter `scael`"),
            "{err}"
        );
        let err = PolicyParameters::default()
            .deserialize::<Params>()
            .unwrap_err();
        assert_eq!(err.message, "parameter `limit` is required");
        let wrong = PolicyParameters::from_yaml("limit: -1").unwrap();
        let err = wrong.deserialize::<Params>().unwrap_err();
        assert_eq!(
            err.message,
            "parameter `limit`: invalid type: integer `-1`, expected u32"
        );
        assert!(PolicyParameters::from_yaml("[1, 2]").is_err());
        assert!(PolicyParameters::from_yaml("~").unwrap().is_empty());
    }
}
