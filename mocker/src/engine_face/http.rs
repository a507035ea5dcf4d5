//! One impersonated worker's HTTP API (axum): what both engines serve (`/health`,
//! `/v1/models`, the OpenAI completions), each engine's own endpoints, and the mocker's fault
//! hooks (`POST /kvroute/fail-health`, `/kvroute/recover-health`: `/health` answers 503
//! between them; nothing else changes).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use super::completions;
use super::config::EngineKind;
use super::info;
use super::metrics;
use super::rank::{Rank, unix_now};
use super::{FaceSettings, VLLM_VERSION};

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

/// The worker's routes.
pub(crate) fn router(face: Arc<WorkerFace>) -> Router {
    let common = Router::new()
        .route("/health", get(health))
        .route("/kvroute/fail-health", post(fail_health))
        .route("/kvroute/recover-health", post(recover_health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat));
    let engine = match face.settings.engine_api {
        EngineKind::Vllm => Router::new()
            .route("/metrics", get(vllm_metrics))
            .route("/version", get(vllm_version))
            .route("/reset_prefix_cache", post(clear_cache)),
        EngineKind::Sglang => Router::new()
            .route("/health_generate", get(health))
            .route("/metrics", get(sglang_metrics))
            .route("/get_server_info", get(server_info))
            .route("/server_info", get(server_info))
            .route("/v1/loads", get(loads))
            .route("/flush_cache", get(clear_cache).post(clear_cache)),
    };
    common.merge(engine).with_state(face)
}

async fn health(State(face): State<Arc<WorkerFace>>) -> StatusCode {
    if face.healthy.load(Ordering::Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn fail_health(State(face): State<Arc<WorkerFace>>) -> &'static str {
    face.healthy.store(false, Ordering::Relaxed);
    tracing::info!(
        worker = face.settings.index,
        "health now fails (POST /kvroute/recover-health to undo)"
    );
    "ok\n"
}

async fn recover_health(State(face): State<Arc<WorkerFace>>) -> &'static str {
    face.healthy.store(true, Ordering::Relaxed);
    tracing::info!(worker = face.settings.index, "health recovered");
    "ok\n"
}

/// Both engines' `ModelList` with the one served model.
async fn models(State(face): State<Arc<WorkerFace>>) -> Response {
    let s = &face.settings;
    let created = unix_now().as_secs();
    let max_model_len = s.engine.num_blocks * u64::from(s.engine.block_size);
    let card = match s.engine_api {
        EngineKind::Vllm => json!({
            "id": s.model, "object": "model", "created": created, "owned_by": "kvroute-mocker",
            "root": s.model, "parent": null, "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{}", uuid::Uuid::new_v4().simple()),
                "object": "model_permission", "created": created,
                "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
                "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
                "organization": "*", "group": null, "is_blocking": false,
            }],
        }),
        EngineKind::Sglang => json!({
            "id": s.model, "object": "model", "created": created, "owned_by": "kvroute-mocker",
            "root": s.model, "parent": null, "max_model_len": max_model_len,
        }),
    };
    axum::Json(json!({"object": "list", "data": [card]})).into_response()
}

async fn vllm_metrics(State(face): State<Arc<WorkerFace>>) -> Response {
    let snaps: Vec<_> = face.ranks.iter().map(|r| r.snapshot()).collect();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::vllm_metrics(&face.settings, &snaps),
    )
        .into_response()
}

async fn sglang_metrics(State(face): State<Arc<WorkerFace>>) -> Response {
    let snaps: Vec<_> = face.ranks.iter().map(|r| r.snapshot()).collect();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::sglang_metrics(&face.settings, &snaps),
    )
        .into_response()
}

async fn vllm_version() -> Response {
    axum::Json(json!({"version": VLLM_VERSION})).into_response()
}

async fn server_info(State(face): State<Arc<WorkerFace>>) -> Response {
    axum::Json(info::sglang_server_info(&face.settings)).into_response()
}

#[derive(Debug, Deserialize)]
struct LoadsQuery {
    dp_rank: Option<u32>,
}

async fn loads(State(face): State<Arc<WorkerFace>>, Query(q): Query<LoadsQuery>) -> Response {
    let snaps: Vec<_> = face
        .ranks
        .iter()
        .filter(|r| q.dp_rank.is_none_or(|want| r.rank == want))
        .map(|r| r.snapshot())
        .collect();
    axum::Json(info::sglang_loads(&face.settings, &snaps, unix_now())).into_response()
}

/// vLLM's `/reset_prefix_cache`, SGLang's `/flush_cache`: every rank empties its cache and
/// publishes `AllBlocksCleared` — only when no request is in flight, as the engines do.
async fn clear_cache(State(face): State<Arc<WorkerFace>>) -> Response {
    let busy: u64 = face.ranks.iter().map(|r| r.in_flight()).sum();
    if busy > 0 {
        return (
            StatusCode::BAD_REQUEST,
            format!("Cache not flushed: {busy} requests are running or waiting.\n"),
        )
            .into_response();
    }
    for rank in &face.ranks {
        if let Err(e) = rank.clear_cache() {
            return (
                StatusCode::BAD_REQUEST,
                format!("Cache not flushed: {e}.\n"),
            )
                .into_response();
        }
    }
    tracing::info!(worker = face.settings.index, "cache cleared");
    match face.settings.engine_api {
        EngineKind::Vllm => StatusCode::OK.into_response(),
        EngineKind::Sglang => (
            StatusCode::OK,
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
            .into_response(),
    }
}
