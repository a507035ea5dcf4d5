//! The HTTP selection API (`gateway/openapi.yaml`), for gateways that forward requests
//! themselves: `POST /v1/select` (the worker for a prompt; the decision's load is released at
//! once, so the engine's own load reports count the request), `POST /v1/select_and_reserve`
//! (the worker, its load held until released or expired), `POST
//! /v1/reservations/{id}/prefill_complete` and `DELETE /v1/reservations/{id}`. For a model with
//! prefill and decode workers the answer can be a pair: the prefill worker, and in `decode` the
//! decode worker (with its HTTP URL, and a reservation of its own when reserving).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_common::messages::{Disaggregation, HopRules, SelectReply, SelectRequest, now_ms};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::app::App;
use crate::error::ApiError;
use crate::lifecycle::Placement;
use crate::openai::{Api, Parsed, Prompt};
use crate::request_id::RequestIds;
use crate::reservations::{Full, Reserved};

/// The fields that give the prompt (exactly one of them, `block_size` with `block_hashes`).
const PROMPT_FIELDS: [&str; 5] = [
    "token_ids",
    "block_hashes",
    "block_size",
    "text",
    "messages",
];

/// The body of `/v1/select` and `/v1/select_and_reserve`: the fields of kvroute's
/// `SelectRequest` (PROTOCOL.md) in JSON, the prompt as `token_ids`, `block_hashes` (with
/// `block_size`), `text` or `messages` (tokenized here with the model's tokenizer).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectBody {
    model: String,
    #[serde(default)]
    request_id: Option<Uuid>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    block_hashes: Option<Vec<u64>>,
    #[serde(default)]
    block_size: Option<u32>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    session: Option<kvroute_common::messages::SessionContext>,
    #[serde(default)]
    allowed_workers: Option<Vec<u64>>,
    #[serde(default)]
    pin: Option<kvroute_common::messages::Pin>,
    #[serde(default)]
    dp_rank_range: Option<kvroute_common::messages::DpRankRange>,
    #[serde(default)]
    tolerated_taints: Option<Vec<String>>,
    #[serde(default)]
    required_taints: Option<Vec<String>>,
    #[serde(default)]
    preferred_taints: Option<Vec<String>>,
    #[serde(default)]
    expected_output_tokens: Option<u32>,
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    policy: Option<String>,
    /// Whether a model with prefill and decode workers may split the request (default: the
    /// routers' policy).
    #[serde(default)]
    disaggregation: Option<Disaggregation>,
    /// The decode hop's pin, allow-list and rank range.
    #[serde(default)]
    decode: Option<HopRules>,
    /// Only workers whose cards carry an `http_url` (default true): `false` lets the routers
    /// choose any registered worker (one reached over NATS, say).
    #[serde(default)]
    http_only: Option<bool>,
}

/// Reads a selection body: valid JSON, the known fields with their types, exactly one prompt
/// field (and `block_size` with `block_hashes` only); every failure is a 400 [`ApiError`].
/// What needs the gateway's state (the model, tokenizing, the prompt limit) is checked later.
pub fn parse_body(body: &[u8]) -> Result<SelectBody, ApiError> {
    let raw: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not a JSON object: {e}")))?;
    // A prompt field is present or absent, never null (the others may be null).
    for field in PROMPT_FIELDS {
        if raw.get(field).is_some_and(Value::is_null) {
            return Err(ApiError::invalid(format!("`{field}` must not be null")));
        }
    }
    let b: SelectBody = serde_json::from_value(Value::Object(raw))
        .map_err(|e| ApiError::invalid(format!("the body is not a selection request: {e}")))?;
    let prompt = [
        b.token_ids.is_some(),
        b.block_hashes.is_some(),
        b.text.is_some(),
        b.messages.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if prompt != 1 {
        return Err(ApiError::invalid(
            "give the prompt as exactly one of token_ids, block_hashes, text or messages",
        ));
    }
    if b.block_hashes.is_some() != b.block_size.is_some() {
        return Err(ApiError::invalid_param(
            "block_size",
            "block_hashes need block_size (and block_size is only for block_hashes)",
        ));
    }
    Ok(b)
}

/// The answer: the router's `SelectReply` in JSON, the worker's HTTP URL when its card has one,
/// and for a reservation its id and expiry; for a pair, the decode hop's URL and reservation,
/// and an SGLang prefill server's bootstrap address.
#[derive(Debug, Serialize)]
struct SelectAnswer {
    #[serde(flatten)]
    reply: SelectReply,
    #[serde(skip_serializing_if = "Option::is_none")]
    http_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reservation_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_at_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_http_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_reservation_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bootstrap_host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bootstrap_port: Option<u16>,
}

/// `POST /v1/select` (`reserve` false) and `POST /v1/select_and_reserve`.
pub async fn select(app: Arc<App>, headers: HeaderMap, body: Bytes, reserve: bool) -> Response {
    let endpoint = if reserve {
        "select_and_reserve"
    } else {
        "select"
    };
    let (status, response) = match run_select(&app, &headers, &body, reserve).await {
        Ok(answer) => (StatusCode::OK, Json(answer).into_response()),
        Err(e) => (e.status, e.into_response()),
    };
    app.metrics
        .requests
        .inc([endpoint, "-", &status.as_u16().to_string()]);
    response
}

async fn run_select(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: &Bytes,
    reserve: bool,
) -> Result<SelectAnswer, ApiError> {
    let mut b = parse_body(body)?;
    // An adapter's selection is its base model's, under the adapter.
    if let (base, Some(adapter)) = app.resolve_model(&b.model) {
        b.model = base;
        b.lora_name.get_or_insert(adapter);
    }
    if !app.directory.all_models().contains(&b.model) {
        return Err(ApiError::model_not_found(&b.model));
    }
    let token_ids = match (&b.text, &b.messages) {
        (Some(text), _) => {
            Some(tokenize_text(app, &b.model, Api::Completions, json_text(text)).await?)
        }
        (_, Some(messages)) => {
            let mut body = Map::new();
            body.insert("model".into(), b.model.clone().into());
            body.insert("messages".into(), Value::Array(messages.clone()));
            if let Some(g) = b.add_generation_prompt {
                body.insert("add_generation_prompt".into(), g.into());
            }
            if let Some(t) = &b.tools {
                body.insert("tools".into(), t.clone());
            }
            Some(tokenize_text(app, &b.model, Api::Chat, Value::Object(body)).await?)
        }
        _ => b.token_ids.clone(),
    };
    if let Some(ids) = &token_ids {
        if ids.is_empty() {
            return Err(ApiError::invalid_param("token_ids", "the prompt is empty"));
        }
        let limit = app.prompt_limit(&b.model);
        if ids.len() > limit {
            return Err(ApiError::invalid(format!(
                "the prompt has {} tokens, more than the limit of {limit} for this model",
                ids.len(),
            )));
        }
    }
    let (allowed_workers, decode, disaggregation) = if b.http_only == Some(false) {
        (b.allowed_workers, b.decode, b.disaggregation)
    } else {
        http_workers(app, &b.model, b.allowed_workers, b.decode, b.disaggregation)?
    };
    let ids = RequestIds::from_headers(headers, b.request_id.unwrap_or_else(Uuid::new_v4));
    let request = SelectRequest {
        request_id: Some(b.request_id.unwrap_or(ids.kvroute)),
        model: b.model.clone(),
        token_ids,
        block_hashes: b.block_hashes,
        block_size: b.block_size,
        lora_name: b.lora_name,
        session: b.session,
        allowed_workers,
        pin: b.pin,
        dp_rank_range: b.dp_rank_range,
        tolerated_taints: b.tolerated_taints.unwrap_or_default(),
        required_taints: b.required_taints.unwrap_or_default(),
        preferred_taints: b.preferred_taints.unwrap_or_default(),
        expected_output_tokens: b.expected_output_tokens,
        priority: b.priority,
        temperature: b.temperature,
        policy: b.policy,
        disaggregation,
        decode,
        ..SelectRequest::default()
    };
    // Selection alone (tokenizing has its own histogram).
    let at = Instant::now();
    let selected = app.select.select(request).await;
    app.metrics.select.observe("-", at.elapsed());
    let reply = selected
        .map_err(|f| ApiError::from_select(&f, &b.model, app.settings.retry_after_secs))?
        .reply;
    let hops = hops(&reply);
    let prefill = app.directory.upstream(reply.worker_id);
    let decode = reply
        .decode
        .as_ref()
        .and_then(|d| app.directory.upstream(d.worker_id));
    let bootstrap = match (&prefill, &reply.decode) {
        (Some(p), Some(_)) if p.engine == "sglang" => Some((
            p.host().to_owned(),
            p.bootstrap_port
                .unwrap_or(crate::handoff::SGLANG_BOOTSTRAP_PORT),
        )),
        _ => None,
    };
    let mut answer = SelectAnswer {
        http_url: prefill.map(|u| u.base_url),
        reservation_id: None,
        expires_at_ms: None,
        decode_http_url: decode.map(|u| u.base_url),
        decode_reservation_id: None,
        bootstrap_port: bootstrap.as_ref().map(|b| b.1),
        bootstrap_host: bootstrap.map(|b| b.0),
        reply,
    };
    if !reserve {
        // Not held: the engines' own reports count the request once it arrives.
        for hop in &hops {
            app.lifecycle.finished(placement(hop), 0);
        }
        return Ok(answer);
    }
    let inserted = {
        let mut table = app.reservations.lock().expect("reservations lock");
        let now = now_ms();
        let mut result = Ok(0);
        for (i, hop) in hops.iter().enumerate() {
            result = table.insert(*hop, now);
            if result.is_err() {
                // Both hops or neither.
                for held in &hops[..i] {
                    table.release(held);
                }
                break;
            }
        }
        app.metrics
            .reservations_held
            .store(table.len() as i64, Ordering::Relaxed);
        result
    };
    match inserted {
        Ok(expires_at_ms) => {
            answer.reservation_id = Some(hops[0].id());
            answer.decode_reservation_id = hops.get(1).map(Reserved::id);
            answer.expires_at_ms = Some(expires_at_ms);
            Ok(answer)
        }
        Err(Full) => {
            for hop in &hops {
                app.lifecycle.finished(placement(hop), 0);
            }
            Err(ApiError::too_many(
                "too_many_reservations",
                "this gateway holds its maximum of reservations (--max-reservations); release some",
                app.settings.retry_after_secs,
            ))
        }
    }
}

/// What a selection charges: its worker, and a pair's decode worker.
fn hops(reply: &SelectReply) -> Vec<Reserved> {
    let mut hops = vec![Reserved {
        request_id: reply.request_id,
        worker_id: reply.worker_id,
        dp_rank: reply.dp_rank,
    }];
    if let Some(d) = &reply.decode {
        hops.push(Reserved {
            request_id: reply.request_id,
            worker_id: d.worker_id,
            dp_rank: d.dp_rank,
        });
    }
    hops
}

/// The request's allow-lists narrowed to the model's workers that have an HTTP URL (unchanged
/// when every worker has one); a 503 `no_http_worker` when none is left for the first hop. A
/// model without prefill and decode workers reachable over HTTP is not split.
type Narrowed = (Option<Vec<u64>>, Option<HopRules>, Option<Disaggregation>);

fn http_workers(
    app: &App,
    model: &str,
    allowed: Option<Vec<u64>>,
    decode: Option<HopRules>,
    disaggregation: Option<Disaggregation>,
) -> Result<Narrowed, ApiError> {
    let serving = app.directory.serving(model);
    let narrow = |list: Option<Vec<u64>>, http: &[u64]| -> Vec<u64> {
        match list {
            None => http.to_vec(),
            Some(list) => list.into_iter().filter(|w| http.contains(w)).collect(),
        }
    };
    let first_hop = serving.first_hop();
    let allowed = if serving.first_hop_without_http() == 0 {
        allowed
    } else {
        let narrowed = narrow(allowed, &first_hop);
        if narrowed.is_empty() {
            return Err(ApiError::unavailable(
                "no_http_worker",
                format!(
                    "no allowed worker of model `{model}` has an HTTP URL (send \"http_only\": \
                     false to choose among workers reached otherwise)"
                ),
                app.settings.retry_after_secs,
            ));
        }
        Some(narrowed)
    };
    if !serving.pairs() {
        return Ok((allowed, None, Some(Disaggregation::Never)));
    }
    let decode = match decode {
        Some(mut rules) if serving.decode.without_http > 0 => {
            rules.allowed_workers = Some(narrow(rules.allowed_workers, &serving.decode.http));
            Some(rules)
        }
        None if serving.decode.without_http > 0 => Some(HopRules {
            allowed_workers: Some(serving.decode.http.clone()),
            ..HopRules::default()
        }),
        rules => rules,
    };
    Ok((allowed, decode, disaggregation))
}

fn json_text(text: &str) -> Value {
    Value::String(text.to_owned())
}

/// Token ids of a text prompt or a chat, with the model's tokenizer.
async fn tokenize_text(
    app: &Arc<App>,
    model: &str,
    api: Api,
    input: Value,
) -> Result<Vec<u32>, ApiError> {
    let (prompts, messages, body) = match (api, input) {
        (Api::Completions, Value::String(t)) => (vec![Prompt::Text(t)], Vec::new(), Map::new()),
        (Api::Chat, Value::Object(body)) => {
            let messages = body
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            (Vec::new(), messages, body)
        }
        _ => return Err(ApiError::internal("tokenize_text: mismatched input")),
    };
    let parsed = Parsed {
        api,
        chat_options: body,
        model: model.to_owned(),
        prompts,
        messages,
        stream: false,
        include_usage: false,
        max_tokens: None,
        session: None,
        policy: None,
        edited: false,
    };
    crate::proxy::tokenize(app, &parsed, "select").await
}

/// `POST /v1/reservations/{id}/prefill_complete`.
pub fn prefill_complete(app: &App, id: &str) -> Response {
    let Some(reserved) = Reserved::parse(id) else {
        return ApiError::not_found(format!("no reservation {id:?}")).into_response();
    };
    let here = app
        .reservations
        .lock()
        .expect("reservations lock")
        .prefill_complete(&reserved);
    let placement = placement(&reserved);
    // Held elsewhere (another replica) or already marked: publishing again is harmless.
    app.lifecycle.prefill_done(placement);
    Json(serde_json::json!({"reservation_id": id, "prefill_complete": true, "held_here": here}))
        .into_response()
}

/// `DELETE /v1/reservations/{id}`: frees the load (idempotent).
pub fn release(app: &App, id: &str) -> Response {
    let Some(reserved) = Reserved::parse(id) else {
        return ApiError::not_found(format!("no reservation {id:?}")).into_response();
    };
    let held = {
        let mut table = app.reservations.lock().expect("reservations lock");
        let held = table.release(&reserved);
        app.metrics
            .reservations_held
            .store(table.len() as i64, Ordering::Relaxed);
        held
    };
    app.metrics.reservations_ended.inc([if held {
        "released"
    } else {
        "released_elsewhere"
    }]);
    app.lifecycle.finished(placement(&reserved), 0);
    Json(serde_json::json!({"reservation_id": id, "released": true, "held_here": held}))
        .into_response()
}

fn placement(r: &Reserved) -> Placement {
    Placement {
        request_id: r.request_id,
        worker_id: r.worker_id,
        dp_rank: r.dp_rank,
    }
}

/// Frees expired reservations until the process ends (checked every 100 ms, or sooner when
/// one is due).
pub async fn expire_loop(app: Arc<App>) {
    loop {
        let due = {
            let mut table = app.reservations.lock().expect("reservations lock");
            let due = table.expire(now_ms());
            app.metrics
                .reservations_held
                .store(table.len() as i64, Ordering::Relaxed);
            due
        };
        for r in due {
            app.metrics.reservations_ended.inc(["expired"]);
            tracing::info!(
                reservation = r.id(),
                worker = r.worker_id,
                "reservation expired; its load is freed"
            );
            app.lifecycle.finished(placement(&r), 0);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
