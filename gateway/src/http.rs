//! The HTTP routes: OpenAI endpoints and the selection API under `/v1` (behind the API keys
//! when configured, bodies read up to `--max-body-bytes`), `/health` `/healthz` `/readyz`
//! `/metrics` (open). Every error is OpenAI-shaped JSON.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use serde_json::json;

use crate::app::App;
use crate::error::ApiError;
use crate::openai::Api;
use crate::{proxy, select_api};

/// The gateway's routes.
pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/select", post(select))
        .route("/v1/select_and_reserve", post(select_and_reserve))
        .route(
            "/v1/reservations/{id}/prefill_complete",
            post(prefill_complete),
        )
        .route("/v1/reservations/{id}", delete(release))
        .route_layer(middleware::from_fn_with_state(app.clone(), authenticate));
    Router::new()
        .merge(api)
        .route("/health", get(readyz))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), check_head))
        .with_state(app)
}

/// The routes of a connection past `--max-connections` (every other connection busy): health
/// and metrics answer, anything else is a 503 (the connection closes after one request).
pub fn health_router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(readyz))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(too_many_connections)
        .with_state(app)
}

async fn too_many_connections(State(app): State<Arc<App>>) -> Response {
    ApiError::unavailable(
        "too_many_connections",
        "the gateway has as many connections as it takes (--max-connections), all busy; retry shortly",
        app.settings.retry_after_secs,
    )
    .into_response()
}

/// Header lines accepted (beyond: 431).
const MAX_HEADERS: usize = 100;

/// A request line and headers within `--max-header-bytes` and [`MAX_HEADERS`] lines, else a
/// 431 in OpenAI's JSON (the HTTP layer refuses far larger heads itself, without a body).
async fn check_head(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let limit = app.settings.max_header_bytes;
    let line = request.method().as_str().len()
        + request
            .uri()
            .path_and_query()
            .map_or(1, |p| p.as_str().len())
        + 11; // " " + " HTTP/1.1\r\n"
    let headers: usize = request
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    let count = request.headers().len();
    if line + headers <= limit && count <= MAX_HEADERS {
        return next.run(request).await;
    }
    let endpoint = endpoint_label(request.uri().path());
    app.metrics.requests.inc([endpoint, "unknown", "431"]);
    ApiError {
        status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        code: "request_header_fields_too_large",
        ..ApiError::invalid(format!(
            "the request line and headers take {} bytes in {count} lines; this gateway takes at \
             most {limit} bytes (--max-header-bytes) in {MAX_HEADERS} lines",
            line + headers
        ))
    }
    .into_response()
}

/// `Authorization: Bearer <key>` with one of the configured keys (compared in constant time).
async fn authenticate(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let Some(keys) = &app.api_keys else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let refused = match given {
        None => Some("You didn't provide an API key: send `Authorization: Bearer <key>`."),
        Some(given) => {
            let mut ok = false;
            for key in keys {
                ok |= constant_time_eq(key.as_bytes(), given.as_bytes());
            }
            (!ok).then_some("Incorrect API key provided.")
        }
    };
    match refused {
        None => next.run(request).await,
        Some(message) => {
            let endpoint = endpoint_label(request.uri().path());
            app.metrics.requests.inc([endpoint, "unknown", "401"]);
            ApiError::unauthorized(message).into_response()
        }
    }
}

/// The `endpoint` label of a path.
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => Api::Completions.label(),
        "/v1/chat/completions" => Api::Chat.label(),
        "/v1/models" => "models",
        "/v1/select" => "select",
        "/v1/select_and_reserve" => "select_and_reserve",
        p if p.starts_with("/v1/reservations/") => "reservations",
        _ => "other",
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A JSON endpoint's content type: absent (taken as JSON, as the engines do) or JSON
/// (`application/json`, `application/<x>+json`, any parameters); anything else is a 415.
fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let essence = value
        .to_str()
        .ok()
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase());
    let json = essence.as_deref().is_some_and(|e| {
        e == "application/json" || (e.starts_with("application/") && e.ends_with("+json"))
    });
    if json {
        return Ok(());
    }
    Err(ApiError::unsupported_media_type(format!(
        "the body must be JSON: send `Content-Type: application/json`, not {:?}",
        String::from_utf8_lossy(value.as_bytes())
    )))
}

/// The body of a JSON endpoint, up to the limit (413 beyond, 415 if not JSON, OpenAI-shaped).
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    check_json_content_type(headers)?;
    let limit = app.settings.max_body_bytes;
    let too_large = || {
        ApiError::too_large(format!(
            "the request body is larger than this gateway's limit of {limit} bytes"
        ))
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let timeout = app.settings.body_read_timeout;
    let Ok(read) = tokio::time::timeout(timeout, to_bytes(body, limit)).await else {
        return Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            code: "request_timeout",
            ..ApiError::invalid(format!(
                "the request body did not arrive within {} ms (--body-read-timeout-ms)",
                timeout.as_millis()
            ))
        });
    };
    read.map_err(|e| {
        let text = kvroute_common::error_chain::describe(&e);
        if text.contains("length limit") {
            too_large()
        } else {
            ApiError::invalid(format!("reading the request body: {text}"))
        }
    })
}

async fn openai(app: Arc<App>, api: Api, headers: HeaderMap, body: Body) -> Response {
    match read_body(&app, &headers, body).await {
        Ok(bytes) => proxy::handle(app, api, headers, bytes).await,
        Err(e) => {
            app.metrics
                .requests
                .inc([api.label(), "unknown", &e.status.as_u16().to_string()]);
            e.into_response()
        }
    }
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    openai(app, Api::Completions, headers, body).await
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    openai(app, Api::Chat, headers, body).await
}

async fn select_common(app: Arc<App>, headers: HeaderMap, body: Body, reserve: bool) -> Response {
    match read_body(&app, &headers, body).await {
        Ok(bytes) => select_api::select(app, headers, bytes, reserve).await,
        Err(e) => e.into_response(),
    }
}

async fn select(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    select_common(app, headers, body, false).await
}

async fn select_and_reserve(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    select_common(app, headers, body, true).await
}

async fn prefill_complete(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    select_api::prefill_complete(&app, &id)
}

async fn release(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    select_api::release(&app, &id)
}

/// `GET /v1/models`: the models registered workers with an HTTP API serve, as OpenAI lists
/// them (`kvroute.tokenizer` says whether this gateway tokenizes it), each followed by the
/// `--lora-adapter`s of it, with `parent` naming the base model as vLLM lists adapters.
async fn models(State(app): State<Arc<App>>) -> Response {
    let mut data = Vec::new();
    for (name, workers) in app.directory.models() {
        let tokenizer = app.models.get(&name).is_some();
        data.push(json!({
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "kvroute",
            "kvroute": {"workers": workers, "tokenizer": tokenizer},
        }));
        let mut adapters: Vec<&String> = app
            .adapter_bases
            .iter()
            .filter(|(_, base)| **base == name)
            .map(|(adapter, _)| adapter)
            .collect();
        adapters.sort();
        for adapter in adapters {
            data.push(json!({
                "id": adapter,
                "object": "model",
                "created": 0,
                "owned_by": "kvroute",
                "parent": name,
                "kvroute": {"workers": workers, "tokenizer": tokenizer},
            }));
        }
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready: connected to NATS and the worker cards read (503 naming what is missing).
async fn readyz(State(app): State<Arc<App>>) -> Response {
    match app.ready() {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], {
        let mut text = app.metrics.render();
        app.models.render_metrics(&mut text);
        text
    })
        .into_response()
}

async fn not_found(request: Request) -> Response {
    ApiError::not_found(format!(
        "no such endpoint: {} {}",
        request.method(),
        request.uri().path()
    ))
    .into_response()
}

async fn method_not_allowed(request: Request) -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: "method_not_allowed",
        ..ApiError::invalid(format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ))
    }
    .into_response()
}
