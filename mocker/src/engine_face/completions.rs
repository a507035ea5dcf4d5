//! `POST /v1/completions` and `POST /v1/chat/completions`: each prompt becomes a request on a
//! rank's simulated engine; the answer is built from its progress (streamed: `stream.rs`).
//! A client that disconnects aborts its prompts, as the engines do: the handler future (or the
//! streamed body) is dropped, and with it the [`AbortOnDrop`] guard — at once for vLLM and for
//! SGLang's plain answers, 2 s later for SGLang's streams (its abort task's sleep).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::abort::AbortOnDrop;
use super::config::EngineKind;
use super::disagg::{self, Plan, VllmHandoff};
use super::face::{ApiError, WorkerFace};
use super::job::{FINISH_REASON, Job};
use super::openai::{self, ChatRequest, CommonFields, CompletionRequest};
use super::progress::{End, progress_channel};
use super::rank::unix_now;
use super::shapes::{
    Api, ChoiceExtra, Envelope, Message, MessageChoice, MessageExtra, TextChoice, TopExtra,
};
use super::stream;
use super::transfer::{Pulled, TransferError};
use crate::engine::SubmitError;

/// How long after a streaming client leaves SGLang aborts its request: the response's
/// background task (`TokenizerManager.create_abort_task`) sleeps 2 s, then aborts the request
/// if it is still in flight. vLLM aborts at once.
pub(crate) const SGLANG_STREAM_ABORT_DELAY: Duration = Duration::from_secs(2);

pub(crate) async fn completions(
    State(face): State<Arc<WorkerFace>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return face.error(StatusCode::BAD_REQUEST, format!("invalid request: {e}")),
    };
    let prompts = match openai::prompts_with(&req.prompt, face.settings.text.as_deref()) {
        Ok(p) => p,
        Err(e) => return face.error(StatusCode::BAD_REQUEST, e),
    };
    let asked = Asked {
        api: Api::Completion,
        model: req.model.as_deref(),
        common: &req.common,
        max_tokens: req.max_tokens,
        prompts,
    };
    run(face, &headers, asked).await
}

pub(crate) async fn chat(
    State(face): State<Arc<WorkerFace>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: ChatRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return face.error(StatusCode::BAD_REQUEST, format!("invalid request: {e}")),
    };
    let tokens = match &face.settings.text {
        Some(model) => openai::chat_tokens(model, &body),
        None => openai::render_chat(&req.messages).map(|t| openai::tokenize(&t)),
    };
    let tokens = match tokens {
        Ok(t) => t,
        Err(e) => return face.error(StatusCode::BAD_REQUEST, e),
    };
    let asked = Asked {
        api: Api::Chat,
        model: req.model.as_deref(),
        common: &req.common,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        prompts: vec![tokens],
    };
    run(face, &headers, asked).await
}

/// What a completion or chat request asks for, parsed.
struct Asked<'r> {
    api: Api,
    model: Option<&'r str>,
    common: &'r CommonFields,
    max_tokens: Option<u32>,
    /// As token ids.
    prompts: Vec<Vec<u32>>,
}

async fn run(face: Arc<WorkerFace>, headers: &HeaderMap, mut asked: Asked<'_>) -> Response {
    let api = asked.api;
    let id = format!("{}{}", api.id_prefix(), uuid::Uuid::new_v4().simple());
    let streamed = asked.common.streaming();
    let plan = match disagg::plan(face.disagg_me(&id), asked.common, &asked.prompts) {
        Ok(p) => p,
        Err(e) => {
            face.transfers
                .counters
                .refused
                .fetch_add(1, Ordering::Relaxed);
            face.metrics.requests_finished.inc("refused");
            return face.refuse(e);
        }
    };
    // A decode pulls its prompt's KV before the engine sees it: the transfer is in its TTFT.
    let mut transferred = 0;
    match &plan {
        Plan::Decode(pull) => match face.transfers.pull(&pull.url, &pull.request).await {
            Ok(got) => transferred = got.prompt_tokens,
            Err(e) => {
                tracing::warn!(worker = face.settings.index, request = id, error = %e, "KV transfer failed");
                let c = &face.transfers.counters;
                c.transfer_failed.fetch_add(1, Ordering::Relaxed);
                if matches!(
                    e,
                    TransferError::Unreachable { .. } | TransferError::Refused { .. }
                ) {
                    c.bootstrap_failed.fetch_add(1, Ordering::Relaxed);
                }
                face.metrics.requests_finished.inc("kv_transfer_failed");
                let failure = disagg::transfer_failure(
                    face.settings.engine_api,
                    &id,
                    pull.room,
                    &e.to_string(),
                );
                return face.failure(failure, streamed);
            }
        },
        Plan::Prefill {
            one_token: true, ..
        } => asked.max_tokens = Some(1),
        _ => {}
    }
    let job = match submit(face.clone(), headers, &asked, id, transferred) {
        Ok(j) => j,
        Err(e) => return face.refuse(e),
    };
    let handoff = match plan {
        Plan::Prefill { key, block_ids, .. } => hand_off(&face, &job, key, block_ids),
        _ => None,
    };
    if streamed {
        stream::respond(job, asked.common.include_usage())
    } else {
        full(job, handoff).await
    }
}

/// Holds a prefill's KV for its decode worker once the prompt is computed; vLLM's answer
/// carries where it is.
fn hand_off(
    face: &Arc<WorkerFace>,
    job: &Job,
    key: String,
    block_ids: Vec<u64>,
) -> Option<serde_json::Value> {
    let outbox = face.transfers.outbox.clone();
    outbox.announce(&key, block_ids.clone());
    let prompt_tokens = job.prompt_tokens[0];
    let blocks = prompt_tokens.div_ceil(u64::from(face.settings.engine.block_size));
    let mut progress = job.progress.clone();
    let held = key.clone();
    tokio::spawn(async move {
        let done = progress
            .wait_for(|p| p[0].cached_tokens.is_some() || p[0].end.is_some())
            .await
            .map(|p| p[0].cached_tokens.is_some())
            .unwrap_or(false);
        let ready = done.then_some(Pulled {
            prompt_tokens,
            blocks,
        });
        outbox.settle(&held, ready);
    });
    let (host, port) = face.transfers.side_channel.clone()?;
    (face.settings.engine_api == EngineKind::Vllm).then(|| {
        VllmHandoff {
            key: &key,
            block_ids: &block_ids,
            engine_id: face.transfers.outbox.engine_id(),
            host: &host,
            port,
            prompt_tokens,
        }
        .params()
    })
}

/// Checks the request and submits each prompt to a rank; their progress comes on the job's
/// channel.
fn submit(
    face: Arc<WorkerFace>,
    headers: &HeaderMap,
    asked: &Asked<'_>,
    id: String,
    transferred_tokens: u64,
) -> Result<Job, ApiError> {
    let lora = face.check_model(asked.model)?;
    let common = asked.common;
    common.check().map_err(ApiError::bad_request)?;
    let max_tokens = openai::max_tokens(asked.max_tokens).map_err(ApiError::bad_request)?;
    let streamed = common.streaming();
    let delay = match face.settings.engine_api {
        EngineKind::Sglang if streamed => SGLANG_STREAM_ABORT_DELAY,
        _ => Duration::ZERO,
    };
    // On a refusal, the prompts already submitted are aborted as the guard drops.
    let mut requests = AbortOnDrop::new(delay);
    let (tx, progress) = progress_channel(asked.prompts.len());
    let pinned = common.routed_dp_rank.or(common.data_parallel_rank);
    for (index, prompt) in asked.prompts.iter().enumerate() {
        let rank = face.pick_rank(headers, pinned)?.clone();
        let id = rank
            .submit(
                prompt,
                max_tokens,
                streamed,
                index,
                tx.clone(),
                transferred_tokens.min(prompt.len() as u64) as u32,
                lora,
            )
            .map_err(|e| ApiError {
                status: match e {
                    SubmitError::TooLarge { .. } => StatusCode::BAD_REQUEST,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                },
                message: e.to_string(),
            })?;
        requests.push(rank, id);
    }
    let api = asked.api;
    Ok(Job {
        api,
        id,
        created: unix_now().as_secs(),
        model: lora.unwrap_or(&face.settings.model).to_owned(),
        prompt_tokens: asked.prompts.iter().map(|p| p.len() as u64).collect(),
        max_tokens,
        progress,
        requests,
        face,
    })
}

async fn full(mut job: Job, handoff: Option<serde_json::Value>) -> Response {
    let engine = job.face.settings.engine_api;
    // Closed only after every rank wrote its prompt's end (the last value is still seen).
    let ended = job
        .progress
        .wait_for(|p| p.iter().all(|p| p.end.is_some()))
        .await
        .map(|p| p.clone());
    job.requests.disarm();
    let progress = match ended {
        Ok(p) if p.iter().all(|p| p.end == Some(End::Finished)) => p,
        _ => {
            return job.face.error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine is shutting down",
            );
        }
    };
    let usage = Some(job.usage(&progress));
    let model = &job.model;
    let choices = progress.iter().map(|p| p.generated).enumerate();
    // Serialized from the shapes, so fields keep the engines' order.
    let body = match job.api {
        Api::Completion => serde_json::to_string(&Envelope {
            id: &job.id,
            object: job.api.object(false),
            created: job.created,
            model,
            choices: choices
                .map(|(index, n)| TextChoice {
                    index,
                    text: openai::filler(n),
                    logprobs: None,
                    finish_reason: Some(FINISH_REASON),
                    extra: ChoiceExtra::of(engine),
                })
                .collect(),
            usage,
            extra: TopExtra::with_handoff(engine, handoff.clone()),
        }),
        Api::Chat => serde_json::to_string(&Envelope {
            id: &job.id,
            object: job.api.object(false),
            created: job.created,
            model,
            choices: choices
                .map(|(index, n)| MessageChoice {
                    index,
                    message: Message {
                        role: "assistant",
                        content: openai::filler(n),
                        extra: MessageExtra::of(engine),
                    },
                    logprobs: None,
                    finish_reason: Some(FINISH_REASON),
                    extra: ChoiceExtra::of(engine),
                })
                .collect(),
            usage,
            extra: TopExtra::with_handoff(engine, handoff.clone()),
        }),
    }
    .expect("response shapes serialize");
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}
