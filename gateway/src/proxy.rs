//! The request path of `/v1/completions` and `/v1/chat/completions`: parse → tokenize → select
//! (kvroute routers over NATS) → forward to the chosen worker's HTTP API → relay the answer.
//!
//! A connect failure, a refused connection or a 5xx before the first byte is retried once on
//! another worker (the failed one excluded through `allowed_workers`, as a new kvroute request:
//! the first decision is released with `finished`). A failure after the first byte ends the
//! stream with an error event; so does a worker silent for `--upstream-idle-timeout-ms`. Every forwarded request has a decision, and its load is released
//! by the request's [`InFlight`] guard — at the end, on failure, or when the client leaves.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_common::WorkerId;
use kvroute_common::error_chain::describe;
use kvroute_common::messages::{Disaggregation, HopRules, SelectReply, SelectRequest, WorkerRole};
use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::app::App;
use crate::directory::{Serving, Upstream};
use crate::error::ApiError;
use crate::handoff;
use crate::lifecycle::Placement;
use crate::models::{INLINE_TOKENIZE_BYTES, precheck, prompt_bytes, prompt_tokens, too_long};
use crate::openai::{Api, Parsed, Prompt, forwarded_body};
use crate::relay::{BodyError, InFlight, Outcome, read_whole, relay};
use crate::request_id::{self, RequestIds};

/// Answer headers naming the placement.
pub const WORKER_HEADER: &str = "x-kvroute-worker-id";
pub const DECISION_HEADER: &str = "x-kvroute-decision-id";
pub const OVERLAP_HEADER: &str = "x-kvroute-overlap-blocks";
/// vLLM's data-parallel rank header (SGLang takes `routed_dp_rank` in the body).
const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// Workers tried per request: the first choice and one retry.
const ATTEMPTS: u32 = 2;

/// Serves one OpenAI request.
pub async fn handle(app: Arc<App>, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let ids = RequestIds::from_headers(&headers, Uuid::new_v4());
    let mut outcome = Outcome::new(api.label(), &ids);
    let mut response = match forward(&app, api, &headers, &body, &ids, started, &mut outcome).await
    {
        Ok(r) => r,
        Err(e) => {
            outcome.status = e.status.as_u16();
            outcome.error = Some(e.code);
            outcome.record(&app, started, None);
            e.into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(&ids.header) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(request_id::HEADER), v);
    }
    response
}

/// Why sending to a worker failed.
pub(crate) enum SendError {
    /// Nothing reached the worker, or it failed before answering: try another.
    Retryable {
        reason: &'static str,
        message: String,
    },
    /// No answer within `--response-timeout-ms`.
    Timeout,
}

/// What one request needs on every attempt.
pub(crate) struct Ctx<'a> {
    pub app: &'a Arc<App>,
    pub api: Api,
    pub parsed: &'a Parsed,
    pub raw: &'a Bytes,
    /// The prompt's token ids when `--forward-token-ids` sends them instead of the text.
    pub forwarded: Option<&'a [u32]>,
    pub ids: &'a RequestIds,
    pub started: Instant,
}

/// How one attempt ended.
pub(crate) enum Step {
    /// The client's answer (the engine's, or its refusal passed on).
    Done(Response),
    /// `worker` failed before the client saw anything: try without it (and without `also`,
    /// the other hop's worker when it may share the blame).
    Retry {
        worker: WorkerId,
        also: Option<WorkerId>,
        error: ApiError,
    },
    Fail(ApiError),
}

#[allow(clippy::too_many_arguments)]
async fn forward(
    app: &Arc<App>,
    api: Api,
    headers: &HeaderMap,
    raw: &Bytes,
    ids: &RequestIds,
    started: Instant,
    outcome: &mut Outcome,
) -> Result<Response, ApiError> {
    let mut parsed = Parsed::from_body(api, raw, headers)?;
    // An adapter's request is its base model's (the body still names the adapter).
    let (base, lora_name) = app.resolve_model(&parsed.model);
    parsed.model = base;
    let serving = app.directory.serving(&parsed.model);
    let first_hop = serving.first_hop();
    if first_hop.is_empty() {
        let without = serving.first_hop_without_http() + serving.prefill.without_http;
        return Err(no_worker(app, &parsed.model, without));
    }
    outcome.model = parsed.model.clone();
    let tokens = tokenize(app, &parsed, api.label()).await?;
    let limit = app.prompt_limit(&parsed.model);
    if tokens.len() > limit {
        return Err(too_long(api, tokens.len(), false, limit));
    }
    outcome.prompt_tokens = tokens.len();
    let forwarded = app.settings.forward_token_ids.then(|| tokens.clone());
    let (token_ids, block_hashes, block_size) =
        prompt_for_routers(app, &parsed.model, lora_name.as_deref(), tokens);
    let mut request = SelectRequest {
        model: parsed.model.clone(),
        role: WorkerRole::Aggregated,
        token_ids,
        block_hashes,
        block_size,
        lora_name,
        session: parsed.session.clone(),
        expected_output_tokens: parsed.max_tokens,
        policy: parsed.policy.clone(),
        disaggregation: disaggregation(&serving, &parsed),
        ..SelectRequest::default()
    };
    let ctx = Ctx {
        app,
        api,
        parsed: &parsed,
        raw,
        forwarded: forwarded.as_deref(),
        ids,
        started,
    };
    let mut excluded: Vec<WorkerId> = Vec::new();
    let mut last_error = None;
    for attempt in 0..ATTEMPTS {
        let without = |pool: &[WorkerId]| -> Vec<WorkerId> {
            pool.iter()
                .copied()
                .filter(|w| !excluded.contains(w))
                .collect()
        };
        let allowed = without(&first_hop);
        if allowed.is_empty() {
            break;
        }
        // Workers without an HTTP API may be registered for the model: only the others.
        request.allowed_workers =
            (serving.first_hop_without_http() > 0 || !excluded.is_empty()).then_some(allowed);
        if serving.pairs() && (serving.decode.without_http > 0 || !excluded.is_empty()) {
            let decode = without(&serving.decode.http);
            if decode.is_empty() && !serving.prefill.sglang {
                // Every decode worker failed this request: the prefill worker serves it (not
                // an SGLang one, which serves only beside a decode server: the routers then
                // find no decode worker and the answer is a 503).
                request.disaggregation = Some(Disaggregation::Never);
            }
            request.decode = Some(HopRules {
                allowed_workers: Some(decode),
                ..HopRules::default()
            });
        }
        request.request_id = Some(if attempt == 0 {
            ids.kvroute
        } else {
            ids.retry(attempt)
        });
        let reply = select(app, &request).await?;
        outcome.attempts = attempt + 1;
        outcome.worker = Some(reply.worker_id);
        outcome.decode_worker = reply.decode.as_ref().map(|d| d.worker_id);
        outcome.overlap_blocks = reply.overlap_blocks.values().copied().max().unwrap_or(0);
        let step = match &reply.decode {
            Some(hop) => handoff::run(&ctx, outcome, &reply, hop).await,
            None => one_worker(&ctx, outcome, &reply).await,
        };
        match step {
            Step::Done(response) => return Ok(response),
            Step::Fail(e) => return Err(e),
            Step::Retry {
                worker,
                also,
                error,
            } => {
                excluded.push(worker);
                excluded.extend(also);
                last_error = Some(error);
            }
        }
    }
    Err(last_error.unwrap_or_else(|| ApiError::bad_gateway("no worker could take the request")))
}

/// How the request may be served when the model has prefill and decode workers: as the
/// routers' policy says, but always split for SGLang prefill servers (they serve a request
/// only with a decode server beside them), and never for what one hand-off cannot carry (a
/// batch of prompts) or when no split is possible here (no prefill or decode worker with an
/// HTTP URL).
fn disaggregation(serving: &Serving, parsed: &Parsed) -> Option<Disaggregation> {
    if !serving.pairs() || parsed.prompts.len() > 1 {
        Some(Disaggregation::Never)
    } else if serving.prefill.sglang {
        Some(Disaggregation::Always)
    } else {
        None
    }
}

/// Sends the request to the one worker of its decision and answers with what it answers.
async fn one_worker(ctx: &Ctx<'_>, outcome: &Outcome, reply: &SelectReply) -> Step {
    let app = ctx.app;
    let placement = Placement {
        request_id: reply.request_id,
        worker_id: reply.worker_id,
        dp_rank: reply.dp_rank,
    };
    let guard = InFlight::new(app.clone(), placement, ctx.started, outcome.clone());
    let Some(upstream) = app.directory.upstream(reply.worker_id) else {
        // Chosen, then gone from etcd before we could send: as if it refused.
        return gone(guard, reply.worker_id);
    };
    if reply.role == WorkerRole::Prefill && upstream.engine == "sglang" {
        guard.abandon("no_decode_worker");
        return Step::Fail(ApiError::unavailable(
            "no_decode_worker",
            format!(
                "no decode worker of model `{}` could take the request, and its SGLang prefill \
                 worker {} serves requests only with one",
                ctx.parsed.model, reply.worker_id
            ),
            app.settings.retry_after_secs,
        ));
    }
    let body = match upstream_body(ctx, &upstream, reply.dp_rank, None) {
        Ok(body) => body,
        Err(e) => {
            guard.abandon("body");
            return Step::Fail(e);
        }
    };
    match send(app, ctx.api, &upstream, ctx.ids, reply.dp_rank, body).await {
        Ok(answer) if answer.status().is_server_error() => {
            let error = failed_answer(reply.worker_id, answer).await;
            retry(guard, reply.worker_id, "status_5xx", error, app)
        }
        Ok(answer) => Step::Done(respond(app, answer, guard, reply).await),
        Err(SendError::Timeout) => {
            guard.abandon("timeout");
            Step::Fail(no_answer(app, reply.worker_id))
        }
        Err(SendError::Retryable { reason, message }) => {
            let error = ApiError::bad_gateway(format!(
                "worker {} ({}) failed: {message}",
                reply.worker_id, upstream.base_url
            ));
            retry(guard, reply.worker_id, reason, error, app)
        }
    }
}

/// The chosen worker left etcd before the request reached it: as if it refused.
pub(crate) fn gone(guard: InFlight, worker: WorkerId) -> Step {
    guard.abandon("worker_gone");
    Step::Retry {
        worker,
        also: None,
        error: ApiError::bad_gateway(format!(
            "worker {worker} left before the request reached it"
        )),
    }
}

/// `worker` failed before the client saw anything: release, count, try another.
pub(crate) fn retry(
    guard: InFlight,
    worker: WorkerId,
    reason: &'static str,
    error: ApiError,
    app: &App,
) -> Step {
    guard.abandon(reason);
    app.metrics.retries.inc([reason]);
    Step::Retry {
        worker,
        also: None,
        error,
    }
}

/// A 5xx answer as the error the client gets if no other worker takes the request.
pub(crate) async fn failed_answer(worker: WorkerId, answer: reqwest::Response) -> ApiError {
    let status = answer.status();
    let text = answer.text().await.unwrap_or_default();
    ApiError::bad_gateway(format!(
        "worker {worker} answered {status}: {}",
        text.chars().take(512).collect::<String>()
    ))
}

/// No answer within `--response-timeout-ms`.
pub(crate) fn no_answer(app: &App, worker: WorkerId) -> ApiError {
    ApiError::timeout(
        "upstream_timeout",
        format!(
            "worker {worker} did not answer within {} ms",
            app.settings.response_timeout.as_millis()
        ),
    )
}

/// The prompt as the routers get it: the local hashes of its full blocks when the model's
/// workers agree on a block size (a selection message ~6× smaller than the token ids, and no
/// hashing on the router), else the token ids.
fn prompt_for_routers(
    app: &App,
    model: &str,
    lora_name: Option<&str>,
    tokens: Vec<u32>,
) -> (Option<Vec<u32>>, Option<Vec<u64>>, Option<u32>) {
    match app.directory.block_size(model) {
        Some(bs) if tokens.len() >= bs as usize => {
            let seed = kvroute_common::hashing::seed_for_lora(lora_name);
            let hashes = kvroute_common::hashing::local_block_hashes(&tokens, bs as usize, seed);
            (None, Some(hashes), Some(bs))
        }
        _ => (Some(tokens), None, None),
    }
}

/// Why no worker of `model` can take requests here.
fn no_worker(app: &App, model: &str, without_http: usize) -> ApiError {
    let retry = app.settings.retry_after_secs;
    if without_http > 0 {
        return ApiError::unavailable(
            "no_http_worker",
            format!(
                "the workers of model `{model}` take requests only over NATS (their cards carry \
                 no HTTP URL); run engines behind kvroute-bridge to serve them here"
            ),
            retry,
        );
    }
    if let Err(why) = app.ready() {
        return ApiError::unavailable(
            "not_ready",
            format!("the gateway is not ready: {why}"),
            retry,
        );
    }
    ApiError::model_not_found(model)
}

/// The prompt's token ids: token ids as given; text refused unencoded when its size alone
/// proves it over the limit, else tokenized in a turn of the tokenize gate (off the runtime
/// when long).
pub async fn tokenize(app: &Arc<App>, parsed: &Parsed, label: &str) -> Result<Vec<u32>, ApiError> {
    let limit = app.prompt_limit(&parsed.model);
    let model = app.models.get(&parsed.model).cloned();
    if let (Api::Completions, Some(Prompt::Tokens(ids))) = (parsed.api, parsed.prompts.first()) {
        return Ok(ids.clone());
    }
    precheck(model.as_deref(), parsed, limit)?;
    let _turn = app.tokenize_gate.enter().await.map_err(|_| {
        app.metrics
            .tokenize_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ApiError::unavailable(
            "tokenizer_busy",
            "this gateway is tokenizing as many prompts as it takes at once \
             (--max-concurrent-tokenizations, --tokenize-queue); retry shortly",
            app.settings.retry_after_secs,
        )
    })?;
    let at = Instant::now();
    let tokens = if prompt_bytes(parsed) <= INLINE_TOKENIZE_BYTES {
        prompt_tokens(model.as_deref(), parsed, limit)?
    } else {
        let parsed = parsed.clone();
        tokio::task::spawn_blocking(move || prompt_tokens(model.as_deref(), &parsed, limit))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizing: {e}")))??
    };
    app.metrics.tokenize.observe(label, at.elapsed());
    Ok(tokens)
}

async fn select(app: &App, request: &SelectRequest) -> Result<SelectReply, ApiError> {
    let at = Instant::now();
    let result = app.select.select(request.clone()).await;
    app.metrics.select.observe(&request.model, at.elapsed());
    result
        .map(|s| s.reply)
        .map_err(|f| ApiError::from_select(&f, &request.model, app.settings.retry_after_secs))
}

/// A change a hop of a disaggregated request makes to the body.
pub(crate) type BodyEdit<'a> = dyn Fn(&mut Map<String, Value>) + 'a;

/// The body for the engine: the client's bytes, unless kvroute's extension must go, the prompt
/// is sent as token ids, an SGLang rank goes in the body, or `edit` (a hop of a disaggregated
/// request) changes it.
pub(crate) fn upstream_body(
    ctx: &Ctx<'_>,
    upstream: &Upstream,
    dp_rank: u32,
    edit: Option<&BodyEdit<'_>>,
) -> Result<Bytes, ApiError> {
    let parsed = ctx.parsed;
    let sglang_rank = upstream.engine == "sglang" && upstream.dp_size > 1;
    let as_ids = ctx.app.settings.forward_token_ids
        && parsed.api == Api::Completions
        && matches!(parsed.prompts.as_slice(), [Prompt::Text(_)]);
    if !parsed.edited && !sglang_rank && !as_ids && edit.is_none() {
        return Ok(ctx.raw.clone());
    }
    let mut body = forwarded_body(ctx.raw)?;
    if as_ids && let Some(ids) = ctx.forwarded {
        body.insert("prompt".into(), json!(ids));
    }
    if sglang_rank {
        body.insert("routed_dp_rank".into(), Value::from(dp_rank));
    }
    if let Some(edit) = edit {
        edit(&mut body);
    }
    Ok(Bytes::from(
        serde_json::to_vec(&body).expect("a JSON map serializes"),
    ))
}

pub(crate) async fn send(
    app: &App,
    api: Api,
    upstream: &Upstream,
    ids: &RequestIds,
    dp_rank: u32,
    body: Bytes,
) -> Result<reqwest::Response, SendError> {
    let url = format!("{}{}", upstream.base_url, api.path());
    let mut request = app
        .http
        .post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .header(request_id::HEADER, &ids.header)
        .body(body);
    if upstream.dp_size > 1 {
        request = request.header(DP_RANK_HEADER, dp_rank.to_string());
    }
    match tokio::time::timeout(app.settings.response_timeout, request.send()).await {
        Err(_) => Err(SendError::Timeout),
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(SendError::Retryable {
            reason: if e.is_connect() { "connect" } else { "send" },
            message: describe(&e),
        }),
    }
}

/// The engine's answer to the client: streamed through as it comes, or read whole (a body that
/// stalls is a 504, one that breaks a 502).
pub(crate) async fn respond(
    app: &App,
    answer: reqwest::Response,
    mut guard: InFlight,
    reply: &SelectReply,
) -> Response {
    let idle = app.settings.upstream_idle_timeout;
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = answer.headers().get(reqwest::header::CONTENT_TYPE).cloned();
    let streamed = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    guard.set_status(status.as_u16());
    let mut response = if streamed && status.is_success() {
        guard.start_stream();
        Response::new(relay(answer, guard, idle))
    } else {
        match read_whole(answer, idle, || guard.body_started()).await {
            Ok(bytes) => {
                if status.is_success() {
                    guard.finish_whole(&bytes);
                } else {
                    guard.fail_quietly();
                }
                Response::new(Body::from(bytes))
            }
            Err(BodyError::Broken(e)) => {
                guard.fail_before_client(502, "mid_stream");
                return ApiError::bad_gateway(format!(
                    "worker {} failed while answering: {}",
                    reply.worker_id,
                    describe(&e)
                ))
                .into_response();
            }
            Err(BodyError::Idle) => {
                guard.fail_before_client(504, "idle_timeout");
                return ApiError::timeout(
                    "upstream_timeout",
                    format!(
                        "worker {} sent nothing for {} ms in the middle of its answer",
                        reply.worker_id,
                        idle.as_millis()
                    ),
                )
                .into_response();
            }
        }
    };
    *response.status_mut() = status;
    let h = response.headers_mut();
    if let Some(ct) = content_type {
        h.insert(header::CONTENT_TYPE, ct);
    }
    if streamed {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    h.insert(WORKER_HEADER, HeaderValue::from(reply.worker_id));
    if let Ok(v) = HeaderValue::from_str(&reply.decision_id.to_string()) {
        h.insert(DECISION_HEADER, v);
    }
    let overlap = reply.overlap_blocks.values().copied().max().unwrap_or(0);
    h.insert(OVERLAP_HEADER, HeaderValue::from(overlap));
    response
}
