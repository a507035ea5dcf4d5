//! JetStream at startup: whether the server has it at all, and errors that keep the server's
//! cause and name the setting it refused.

use async_nats::jetstream;

use crate::config::ConfigError;
use crate::error_chain::describe;

/// JetStream allows at most this many replicas of a stream or bucket.
pub const MAX_REPLICAS: usize = 5;

/// A JetStream resource this process needs could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JetStreamError {
    /// The server (or the account) has no JetStream.
    #[error(
        "NATS at {url} has JetStream disabled: start nats-server with -js (or `jetstream {{}}` in its config){detail}"
    )]
    Disabled { url: String, detail: String },
    /// The server refused to create a stream or bucket with these settings.
    #[error("{setting}: NATS refused to create {what}: {cause}")]
    Refused {
        /// The settings, as flags (`--stream-replicas 3`).
        setting: String,
        /// `stream KVROUTE_x_EVENTS`, `bucket KVROUTE_x_SESSIONS`.
        what: String,
        cause: String,
    },
    /// Anything else.
    #[error("{what}: {cause}")]
    Failed { what: String, cause: String },
}

impl JetStreamError {
    pub fn failed(what: impl Into<String>, cause: &dyn std::error::Error) -> Self {
        Self::Failed {
            what: what.into(),
            cause: describe(cause),
        }
    }
}

/// Checks that the account has JetStream (a server started without `-js` answers no
/// JetStream request at all) and returns the context. Other errors of the check are logged
/// and left to the first real request.
pub async fn require_jetstream(
    client: &async_nats::Client,
    urls: &str,
) -> Result<jetstream::Context, JetStreamError> {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::AccountErrorKind;
    let js = jetstream::new(client.clone());
    match js.query_account().await {
        Ok(_) => Ok(js),
        Err(e) => match e.kind() {
            AccountErrorKind::JetStreamUnavailable => Err(JetStreamError::Disabled {
                url: urls.to_owned(),
                detail: String::new(),
            }),
            AccountErrorKind::JetStream(err)
                if err.error_code() == ErrorCode::JETSTREAM_NOT_ENABLED
                    || err.error_code() == ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT =>
            {
                Err(JetStreamError::Disabled {
                    url: urls.to_owned(),
                    detail: format!(" ({err})"),
                })
            }
            _ => {
                tracing::debug!(error = %e, "querying the JetStream account failed");
                Ok(js)
            }
        },
    }
}

/// Checks a replica count (`--field`): 1 to [`MAX_REPLICAS`].
pub fn validate_replicas(field: &'static str, replicas: usize) -> Result<(), ConfigError> {
    if (1..=MAX_REPLICAS).contains(&replicas) {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("must be between 1 and {MAX_REPLICAS} (JetStream's limit), got {replicas}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::exit::{Status, status_of};

    #[test]
    fn replicas_are_1_to_5() {
        assert!(validate_replicas("stream-replicas", 1).is_ok());
        assert!(validate_replicas("stream-replicas", 5).is_ok());
        let err = validate_replicas("session-bucket-replicas", 9).unwrap_err();
        assert_eq!(err.field, "session-bucket-replicas");
        assert!(err.to_string().contains("between 1 and 5"), "{err}");
        assert!(validate_replicas("stream-replicas", 0).is_err());
    }

    #[test]
    fn errors_name_the_fix_or_the_setting() {
        let e = JetStreamError::Disabled {
            url: "nats://127.0.0.1:4222".into(),
            detail: String::new(),
        };
        assert_eq!(
            e.to_string(),
            "NATS at nats://127.0.0.1:4222 has JetStream disabled: start nats-server with -js (or `jetstream {}` in its config)"
        );
        assert_eq!(status_of(&e.clone().into()), Status::Unavailable);
        let e = JetStreamError::Refused {
            setting: "--stream-replicas 3".into(),
            what: "stream KVROUTE_x_EVENTS".into(),
            cause: "insufficient resources".into(),
        };
        assert_eq!(
            e.to_string(),
            "--stream-replicas 3: NATS refused to create stream KVROUTE_x_EVENTS: insufficient resources"
        );
        assert_eq!(status_of(&e.clone().into()), Status::BadConfig);
    }
}
