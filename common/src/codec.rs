//! The wire encoding: MessagePack maps with named fields, a schema version, and size limits.
//! "Human readable" mode: ids (UUIDs) travel as their canonical strings.
//!
//! Readers ignore unknown fields and default missing optional ones; every failure is a typed
//! [`DecodeError`], never a panic, so a bad message is counted and skipped by its receiver.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::messages::SchemaVersion;

/// The size limit of a message unless its type sets another (NATS's default max payload).
pub const DEFAULT_MAX_BYTES: usize = 1024 * 1024;

/// A top-level message: it has a name (for errors and metrics), a size limit and a version.
pub trait WireMessage: Serialize + DeserializeOwned {
    const NAME: &'static str;
    const MAX_BYTES: usize = DEFAULT_MAX_BYTES;
    /// The newest schema version of this message that this build reads.
    const SUPPORTED_VERSION: SchemaVersion = SchemaVersion::CURRENT;
    fn schema_version(&self) -> SchemaVersion;
}

/// Why bytes could not become a message. The variants are stable reasons for metrics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{message}: empty payload")]
    Empty { message: &'static str },
    #[error("{message}: {size} bytes exceeds the limit of {limit}")]
    TooLarge {
        message: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("{message}: malformed: {detail}")]
    Malformed {
        message: &'static str,
        detail: String,
    },
    #[error("{message}: schema version {version} is newer than {supported}")]
    UnsupportedVersion {
        message: &'static str,
        version: u16,
        supported: u16,
    },
}

impl DecodeError {
    /// Every [`DecodeError::reason`].
    pub const REASONS: [&'static str; 4] =
        ["empty", "too_large", "malformed", "unsupported_version"];

    /// A short, stable label (`empty`, `too_large`, `malformed`, `unsupported_version`).
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::Empty { .. } => "empty",
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::Malformed { .. } => "malformed",
            DecodeError::UnsupportedVersion { .. } => "unsupported_version",
        }
    }
}

/// Why a message could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("{message}: {size} bytes exceeds the limit of {limit}")]
    TooLarge {
        message: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("{message}: {detail}")]
    Serialize {
        message: &'static str,
        detail: String,
    },
}

/// Encodes `msg` as a MessagePack map with named fields.
pub fn encode<T: WireMessage>(msg: &T) -> Result<bytes::Bytes, EncodeError> {
    let mut buf = Vec::with_capacity(256);
    let mut ser = rmp_serde::Serializer::new(&mut buf)
        .with_struct_map()
        .with_human_readable();
    msg.serialize(&mut ser)
        .map_err(|e| EncodeError::Serialize {
            message: T::NAME,
            detail: e.to_string(),
        })?;
    if buf.len() > T::MAX_BYTES {
        return Err(EncodeError::TooLarge {
            message: T::NAME,
            size: buf.len(),
            limit: T::MAX_BYTES,
        });
    }
    Ok(buf.into())
}

/// Decodes a message, enforcing the size limit and the schema version.
pub fn decode<T: WireMessage>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty { message: T::NAME });
    }
    if bytes.len() > T::MAX_BYTES {
        return Err(DecodeError::TooLarge {
            message: T::NAME,
            size: bytes.len(),
            limit: T::MAX_BYTES,
        });
    }
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes).with_human_readable();
    let msg = T::deserialize(&mut de).map_err(|e| DecodeError::Malformed {
        message: T::NAME,
        detail: e.to_string(),
    })?;
    let version = msg.schema_version();
    if version > T::SUPPORTED_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            message: T::NAME,
            version: version.0,
            supported: T::SUPPORTED_VERSION.0,
        });
    }
    Ok(msg)
}
