//! `POST /v1/completions` and `POST /v1/chat/completions`: each prompt becomes a request on a
//! rank's simulated engine; the answer is built from its progress (streamed: `stream.rs`).
//! A client that disconnects aborts its prompts, as the engines do: the handler future (or the
//! streamed body) is dropped, and with it the [`AbortOnDrop`] guard — at once for vLLM and for
//! SGLang's plain answers, 2 s later for SGLang's streams (its abort task's sleep).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::abort::AbortOnDrop;
use super::config::EngineKind;
use super::face::{ApiError, WorkerFace};
use super::job::{FINISH_REASON, Job};
use super::openai::{self, ChatRequest, CommonFields, CompletionRequest};
use super::progress::{End, progress_channel};
use super::rank::unix_now;
use super::shapes::{
    Api, ChoiceExtra, Envelope, Message, MessageChoice, MessageExtra, TextChoice, TopExtra,
};
use super::stream;
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

async fn run(face: Arc<WorkerFace>, headers: &HeaderMap, asked: Asked<'_>) -> Response {
    let job = match submit(face.clone(), headers, &asked) {
        Ok(j) => j,
        Err(e) => return face.refuse(e),
    };
    if asked.common.streaming() {
        stream::respond(job, asked.common.include_usage())
    } else {
        full(job).await
    }
}

/// Checks the request and submits each prompt to a rank; their progress comes on the job's
/// channel.
fn submit(face: Arc<WorkerFace>, headers: &HeaderMap, asked: &Asked<'_>) -> Result<Job, ApiError> {
    face.check_model(asked.model)?;
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
            .submit(prompt, max_tokens, streamed, index, tx.clone())
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
        id: format!("{}{}", api.id_prefix(), uuid::Uuid::new_v4().simple()),
        created: unix_now().as_secs(),
        prompt_tokens: asked.prompts.iter().map(|p| p.len() as u64).collect(),
        max_tokens,
        progress,
        requests,
        face,
    })
}

async fn full(mut job: Job) -> Response {
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
    let model = &job.face.settings.model;
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
            extra: TopExtra::full(engine),
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
            extra: TopExtra::full(engine),
        }),
    }
    .expect("response shapes serialize");
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}
