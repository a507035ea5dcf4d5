//! Identifiers shared by every process, and the namespace that scopes a deployment.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A worker (one engine instance). Chosen by the worker; unique within a namespace.
pub type WorkerId = u64;

/// A data-parallel rank inside a worker (`0` for workers without data parallelism).
pub type DpRank = u32;

/// A request's id, chosen by the client (or by the router when absent).
pub type RequestId = uuid::Uuid;

/// A routing decision's id, chosen by the router replica that made it.
pub type DecisionId = uuid::Uuid;

/// A conversation / agent session, chosen by the client. Opaque to kvroute.
pub type SessionId = String;

/// The scope of one kvroute deployment: every subject, stream, bucket and etcd key contains it.
///
/// Allowed: 1 to 64 characters of `[A-Za-z0-9_-]`, so it is a valid NATS subject token,
/// JetStream stream / bucket name part and etcd path segment.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Namespace(String);

/// A namespace string that breaks the rule in [`Namespace`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid namespace {value:?}: use 1 to 64 characters of [A-Za-z0-9_-]")]
pub struct InvalidNamespace {
    pub value: String,
}

impl Namespace {
    pub const MAX_LEN: usize = 64;

    pub fn new(value: impl Into<String>) -> Result<Self, InvalidNamespace> {
        let value = value.into();
        if is_subject_token(&value, Self::MAX_LEN) {
            Ok(Self(value))
        } else {
            Err(InvalidNamespace { value })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Self("default".to_owned())
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Namespace {
    type Err = InvalidNamespace;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for Namespace {
    type Error = InvalidNamespace;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<Namespace> for String {
    fn from(ns: Namespace) -> Self {
        ns.0
    }
}

/// Whether `value` is 1 to `max_len` characters of `[A-Za-z0-9_-]`: a safe NATS subject
/// token (router and indexer replica ids appear in their direct subjects).
pub fn is_subject_token(value: &str, max_len: usize) -> bool {
    !value.is_empty()
        && value.len() <= max_len
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_tokens_are_plain_names() {
        assert!(is_subject_token("router-1a_b", 16));
        for bad in ["", "a.b", "a b", "a*", "a>", "ü", "toolongtoolongxx1"] {
            assert!(!is_subject_token(bad, 16), "{bad:?} should be refused");
        }
    }

    #[test]
    fn namespace_accepts_subject_safe_names_only() {
        assert!(Namespace::new("prod-eu_1").is_ok());
        for bad in ["", "a.b", "a b", "a*", "a>", "ü", &"x".repeat(65)] {
            assert!(Namespace::new(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
