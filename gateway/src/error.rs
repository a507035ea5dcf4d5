//! Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status, and `Retry-After` on 429 / 503.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvroute_common::client::SelectCallFailure;
use kvroute_common::messages::ErrorCode;
use serde::Serialize;

/// An answer that is an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    /// A stable machine-readable `code` (also the `reason` label of the metrics).
    pub code: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    /// Seconds for `Retry-After` (429 / 503 only).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            kind,
            code,
            message,
            param: None,
            retry_after: None,
        }
    }

    /// 400: the request is malformed or inconsistent.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            message.into(),
        )
    }

    /// 400 naming the offending field.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
            ..Self::invalid(message)
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            message.into(),
        )
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{model}` does not exist (no registered worker serves it)."),
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message.into(),
        )
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            message.into(),
        )
    }

    /// 415: the body is not JSON.
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            message.into(),
        )
    }

    /// 400 naming a request header that is invalid.
    pub fn invalid_header(name: &str, message: impl std::fmt::Display) -> Self {
        Self {
            code: "invalid_header",
            ..Self::invalid(format!("header {name}: {message}"))
        }
    }

    /// 503 with `Retry-After`: nothing can take the request now.
    pub fn unavailable(code: &'static str, message: impl Into<String>, retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                code,
                message.into(),
            )
        }
    }

    /// 429 with `Retry-After`.
    pub fn too_many(code: &'static str, message: impl Into<String>, retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                code,
                message.into(),
            )
        }
    }

    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_failed",
            message.into(),
        )
    }

    pub fn timeout(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            code,
            message.into(),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal",
            message.into(),
        )
    }

    /// A failed selection as the client should see it.
    pub fn from_select(failure: &SelectCallFailure, model: &str, retry_after: u64) -> Self {
        match failure {
            SelectCallFailure::Refused(e) => {
                let message = format!("no worker for this request: {}: {}", e.code, e.message);
                match e.code {
                    ErrorCode::BadRequest | ErrorCode::UnsupportedVersion => Self::invalid(message),
                    ErrorCode::TooLarge => Self::too_large(message),
                    ErrorCode::NoWorkers => Self::model_not_found(model),
                    ErrorCode::AllOverloaded => {
                        Self::unavailable("all_workers_overloaded", message, retry_after)
                    }
                    ErrorCode::QueueTimeout => {
                        Self::unavailable("queue_timeout", message, retry_after)
                    }
                    ErrorCode::QueueFull => Self::unavailable("queue_full", message, retry_after),
                    ErrorCode::AllFiltered | ErrorCode::PinnedUnavailable => {
                        Self::unavailable("no_eligible_worker", message, retry_after)
                    }
                    ErrorCode::PolicyError | ErrorCode::Unavailable => {
                        Self::unavailable("router_unavailable", message, retry_after)
                    }
                }
            }
            SelectCallFailure::NoRouter => Self::unavailable(
                "router_unavailable",
                "no kvroute router is answering selections",
                retry_after,
            ),
            SelectCallFailure::Timeout { attempts, waited } => Self::timeout(
                "select_timeout",
                format!("no router answered the selection ({attempts} attempts, {waited:?})"),
            ),
            SelectCallFailure::Transport(e) => Self::unavailable(
                "router_unavailable",
                format!("selecting a worker failed: {e}"),
                retry_after,
            ),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        serde_json::to_string(&ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        })
        .expect("an error body serializes")
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_common::messages::SelectError;

    fn refused(code: ErrorCode) -> SelectCallFailure {
        SelectCallFailure::Refused(SelectError {
            v: Default::default(),
            request_id: None,
            code,
            message: "m".into(),
            reasons: Default::default(),
        })
    }

    #[test]
    fn the_body_is_openai_shaped() {
        let e = ApiError::invalid_param("messages", "messages must not be empty");
        let v: serde_json::Value = serde_json::from_str(&e.body()).expect("json");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(v["error"]["message"], "messages must not be empty");
        assert_eq!(v["error"]["code"], "invalid_request");
    }

    #[test]
    fn selection_failures_map_to_statuses() {
        let status = |f: SelectCallFailure| ApiError::from_select(&f, "m", 2).status;
        assert_eq!(status(refused(ErrorCode::BadRequest)), 400);
        assert_eq!(status(refused(ErrorCode::NoWorkers)), 404);
        assert_eq!(status(refused(ErrorCode::AllOverloaded)), 503);
        assert_eq!(status(SelectCallFailure::NoRouter), 503);
        let timeout = SelectCallFailure::Timeout {
            attempts: 4,
            waited: std::time::Duration::from_secs(3),
        };
        assert_eq!(status(timeout), 504);
        let overloaded = ApiError::from_select(&refused(ErrorCode::AllOverloaded), "m", 2);
        let response = overloaded.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }
}
