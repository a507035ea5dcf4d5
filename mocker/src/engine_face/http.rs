//! One impersonated worker's HTTP API (axum): what both engines serve (`/health`,
//! `/v1/models`, the OpenAI completions), each engine's own endpoints, and the mocker's fault
//! hooks (`POST /kvroute/fail-health`, `/kvroute/recover-health`: `/health` answers 503
//! between them; nothing else changes).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use super::VLLM_VERSION;
use super::completions;
use super::config::EngineKind;
use super::face::WorkerFace;
use super::info;
use super::metrics;
use super::rank::unix_now;

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
    // Adapters follow the base model, as vLLM lists its `--lora-modules` (root: the adapter's
    // path there; here its name).
    let mut data = vec![card];
    data.extend(s.lora_modules.iter().map(|adapter| {
        json!({
            "id": adapter, "object": "model", "created": created, "owned_by": "kvroute-mocker",
            "root": adapter, "parent": s.model, "max_model_len": max_model_len,
        })
    }));
    axum::Json(json!({"object": "list", "data": data})).into_response()
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
        metrics::sglang_metrics(&face.settings, &snaps, &face.transfers.counters),
    )
        .into_response()
}

async fn vllm_version() -> Response {
    axum::Json(json!({"version": VLLM_VERSION})).into_response()
}

async fn server_info(State(face): State<Arc<WorkerFace>>) -> Response {
    axum::Json(info::sglang_server_info(
        &face.settings,
        &info::Disaggregation::of(&face.transfers),
    ))
    .into_response()
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
    let disagg = info::Disaggregation::of(&face.transfers);
    axum::Json(info::sglang_loads(
        &face.settings,
        &snaps,
        &disagg,
        unix_now(),
    ))
    .into_response()
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
