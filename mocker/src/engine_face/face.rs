//! What one impersonated worker's handlers share, and how they refuse a request in the
//! engine's own error shape.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::FaceSettings;
use super::config::EngineKind;
use super::rank::Rank;

/// A refused request; [`WorkerFace::refuse`] renders it in the engine's error shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }
}

/// What the handlers of one worker share.
#[derive(Debug)]
pub(crate) struct WorkerFace {
    pub settings: FaceSettings,
    pub ranks: Vec<Arc<Rank>>,
    pub healthy: AtomicBool,
}

impl WorkerFace {
    /// An error in the engine's shape: vLLM `{"error": {...}}`, SGLang a flat `ErrorResponse`.
    pub fn error(&self, status: StatusCode, message: impl Into<String>) -> Response {
        let kind = match status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::BAD_REQUEST => "BadRequestError",
            _ => "InternalServerError",
        };
        let message = message.into();
        let code = status.as_u16();
        let body = match self.settings.engine_api {
            EngineKind::Vllm => json!({
                "error": {"message": message, "type": kind, "param": null, "code": code}
            }),
            EngineKind::Sglang => json!({
                "object": "error", "message": message, "type": kind, "param": null, "code": code
            }),
        };
        (status, axum::Json(body)).into_response()
    }

    pub fn refuse(&self, e: ApiError) -> Response {
        self.error(e.status, e.message)
    }

    /// A request naming another model gets the engines' 404.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.settings.model => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The model `{m}` does not exist."),
            }),
            _ => Ok(()),
        }
    }

    /// The rank a prompt goes to: the one pinned (vLLM's `X-data-parallel-rank` header,
    /// SGLang's `routed_dp_rank`), else the one with the fewest requests in flight.
    pub fn pick_rank(
        &self,
        headers: &HeaderMap,
        pinned: Option<u32>,
    ) -> Result<&Arc<Rank>, ApiError> {
        let header = headers
            .get("x-data-parallel-rank")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u32>().ok());
        match pinned.or(header) {
            Some(r) => self.ranks.get(r as usize).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "data parallel rank {r} does not exist (dp size {})",
                    self.ranks.len()
                ))
            }),
            None => Ok(self
                .ranks
                .iter()
                .min_by_key(|r| r.in_flight())
                .expect("a worker has at least one rank")),
        }
    }
}
