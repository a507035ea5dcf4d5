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
use super::transfer::Transfers;

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
    pub transfers: Transfers,
    pub metrics: Arc<crate::fleet::FleetMetrics>,
}

impl WorkerFace {
    /// This worker, for planning request `request_id`'s disaggregation.
    pub fn disagg_me<'a>(&self, request_id: &'a str) -> super::disagg::Me<'a> {
        super::disagg::Me {
            engine: self.settings.engine_api,
            role: self.transfers.role,
            request_id,
            block_size: self.settings.engine.block_size,
            room_wait_ms: self.transfers.room_wait.as_millis() as u64,
        }
    }

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

    /// A failed disaggregated request's error, streamed (an SSE error chunk, then `[DONE]`,
    /// as both engines end a stream that fails) or whole. SGLang's whole error names the
    /// status as its type (`str(status_code)` of its `HTTPException`).
    pub fn failure(&self, e: ApiError, streamed: bool) -> Response {
        let code = e.status.as_u16();
        let kind = match (self.settings.engine_api, e.status) {
            (_, StatusCode::BAD_REQUEST) => "BadRequestError".to_owned(),
            (EngineKind::Vllm, _) => "InternalServerError".to_owned(),
            (EngineKind::Sglang, s) if streamed => s
                .canonical_reason()
                .unwrap_or("error")
                .to_uppercase()
                .replace(' ', "_"),
            (EngineKind::Sglang, _) => code.to_string(),
        };
        let error = match self.settings.engine_api {
            EngineKind::Vllm => {
                json!({"message": e.message, "type": kind, "param": null, "code": code})
            }
            EngineKind::Sglang => json!({
                "object": "error", "message": e.message, "type": kind, "param": null, "code": code
            }),
        };
        if streamed {
            let body = format!(
                "data: {}\n\n{}",
                json!({ "error": error }),
                super::shapes::DONE
            );
            return (
                [(
                    axum::http::header::CONTENT_TYPE,
                    "text/event-stream; charset=utf-8",
                )],
                body,
            )
                .into_response();
        }
        let body = match self.settings.engine_api {
            EngineKind::Vllm => json!({ "error": error }),
            EngineKind::Sglang => error,
        };
        (e.status, axum::Json(body)).into_response()
    }

    /// The LoRA adapter a request's `model` names (`None`: the base model, or no `model`); a
    /// request naming another model gets the engines' 404.
    pub fn check_model<'m>(&self, model: Option<&'m str>) -> Result<Option<&'m str>, ApiError> {
        match model {
            Some(m) if self.settings.lora_modules.iter().any(|a| a == m) => Ok(Some(m)),
            Some(m) if m != self.settings.model => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The model `{m}` does not exist."),
            }),
            _ => Ok(None),
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
