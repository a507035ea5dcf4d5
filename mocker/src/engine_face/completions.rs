//! `POST /v1/completions` and `POST /v1/chat/completions`: each prompt becomes a request on a
//! rank's simulated engine; the answer is built from its progress. Streaming sends the first
//! token's chunk when the engine produces it (at the simulated TTFT) and the rest in one chunk
//! when it finishes, then the usage chunk if `stream_options.include_usage`, then `[DONE]`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use super::config::FaceEngine;
use super::http::{ApiError, WorkerFace};
use super::openai::{self, ChatRequest, CommonFields, CompletionRequest};
use super::rank::{Progress, unix_now};
use super::shapes::{
    Api, ChoiceExtra, DONE, Delta, DeltaChoice, Envelope, Message, MessageChoice, MessageExtra,
    TextChoice, TopExtra, Usage, sse,
};
use crate::engine::SubmitError;

/// The finish reason of every request: the simulated engine always runs to `max_tokens`.
const FINISH_REASON: &str = "length";

pub(crate) async fn completions(
    State(face): State<Arc<WorkerFace>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return face.error(StatusCode::BAD_REQUEST, format!("invalid request: {e}")),
    };
    let prompts = match openai::prompts(&req.prompt) {
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
    let text = match openai::render_chat(&req.messages) {
        Ok(t) => t,
        Err(e) => return face.error(StatusCode::BAD_REQUEST, e),
    };
    let asked = Asked {
        api: Api::Chat,
        model: req.model.as_deref(),
        common: &req.common,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        prompts: vec![openai::tokenize(&text)],
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

/// A request's prompts submitted to the engine, and what its answer needs.
struct Job {
    face: Arc<WorkerFace>,
    api: Api,
    id: String,
    created: u64,
    /// Per prompt.
    prompt_tokens: Vec<u64>,
    progress: mpsc::UnboundedReceiver<Progress>,
}

async fn run(face: Arc<WorkerFace>, headers: &HeaderMap, asked: Asked<'_>) -> Response {
    let progress = match submit(&face, headers, &asked) {
        Ok(p) => p,
        Err(e) => return face.refuse(e),
    };
    let api = asked.api;
    let job = Job {
        api,
        id: format!("{}{}", api.id_prefix(), uuid::Uuid::new_v4().simple()),
        created: unix_now().as_secs(),
        prompt_tokens: asked.prompts.iter().map(|p| p.len() as u64).collect(),
        progress,
        face,
    };
    if asked.common.streaming() {
        stream(job, asked.common.include_usage())
    } else {
        full(job).await
    }
}

/// Checks the request and submits each prompt to a rank; their progress comes on the channel.
fn submit(
    face: &WorkerFace,
    headers: &HeaderMap,
    asked: &Asked<'_>,
) -> Result<mpsc::UnboundedReceiver<Progress>, ApiError> {
    face.check_model(asked.model)?;
    let common = asked.common;
    common.check().map_err(ApiError::bad_request)?;
    let max_tokens = openai::max_tokens(asked.max_tokens).map_err(ApiError::bad_request)?;
    let (tx, progress) = mpsc::unbounded_channel();
    let pinned = common.routed_dp_rank.or(common.data_parallel_rank);
    for (index, prompt) in asked.prompts.iter().enumerate() {
        let rank = face.pick_rank(headers, pinned)?;
        // On a refusal, earlier prompts of the request run on; their progress goes nowhere.
        rank.submit(prompt, max_tokens, index, tx.clone())
            .map_err(|e| ApiError {
                status: match e {
                    SubmitError::TooLarge { .. } => StatusCode::BAD_REQUEST,
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                },
                message: e.to_string(),
            })?;
    }
    Ok(progress)
}

/// Every prompt's cached and output tokens, once all have finished.
struct Totals {
    cached: Vec<u64>,
    output: Vec<u64>,
}

impl Totals {
    fn new(prompts: usize) -> Self {
        Self {
            cached: vec![0; prompts],
            output: vec![0; prompts],
        }
    }

    fn usage(&self, engine: FaceEngine, prompt_tokens: &[u64]) -> Usage {
        Usage::new(
            engine,
            prompt_tokens.iter().sum(),
            self.output.iter().sum(),
            self.cached.iter().sum(),
        )
    }
}

async fn full(mut job: Job) -> Response {
    let engine = job.face.settings.engine_api;
    let mut totals = Totals::new(job.prompt_tokens.len());
    let mut open = job.prompt_tokens.len();
    while open > 0 {
        match job.progress.recv().await {
            Some(Progress::FirstToken {
                index,
                cached_tokens,
            }) => totals.cached[index] = cached_tokens,
            Some(Progress::Finished {
                index,
                output_tokens,
            }) => {
                totals.output[index] = output_tokens;
                open -= 1;
            }
            Some(Progress::Cancelled { .. }) | None => {
                return job.face.error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the engine is shutting down",
                );
            }
        }
    }
    let usage = Some(totals.usage(engine, &job.prompt_tokens));
    let model = &job.face.settings.model;
    let choices = totals.output.iter().enumerate();
    // Serialized from the shapes, so fields keep the engines' order.
    let body = match job.api {
        Api::Completion => serde_json::to_string(&Envelope {
            id: &job.id,
            object: job.api.object(false),
            created: job.created,
            model,
            choices: choices
                .map(|(index, &n)| TextChoice {
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
                .map(|(index, &n)| MessageChoice {
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

/// The SSE response; a task turns the job's progress into chunks.
fn stream(job: Job, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<String>(16);
    tokio::spawn(stream_job(job, include_usage, tx));
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, Infallible>(Bytes::from(chunk)), rx))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

async fn stream_job(mut job: Job, include_usage: bool, out: mpsc::Sender<String>) {
    let engine = job.face.settings.engine_api;
    let mut totals = Totals::new(job.prompt_tokens.len());
    let mut open = job.prompt_tokens.len();
    while open > 0 {
        let chunks = match job.progress.recv().await {
            Some(Progress::FirstToken {
                index,
                cached_tokens,
            }) => {
                totals.cached[index] = cached_tokens;
                let mut chunks = Vec::new();
                if job.api == Api::Chat {
                    chunks.push(job.delta(index, Some("assistant"), String::new(), None));
                }
                chunks.push(job.chunk(index, openai::filler(1), None));
                chunks
            }
            Some(Progress::Finished {
                index,
                output_tokens,
            }) => {
                totals.output[index] = output_tokens;
                open -= 1;
                let rest = openai::filler(output_tokens.saturating_sub(1));
                vec![job.chunk(index, rest, Some(FINISH_REASON))]
            }
            // The engine stopped: end the stream without `[DONE]`.
            Some(Progress::Cancelled { .. }) | None => return,
        };
        for chunk in chunks {
            if out.send(chunk).await.is_err() {
                return; // the client left; the requests run to their end anyway
            }
        }
    }
    if include_usage {
        let usage = Envelope::<TextChoice> {
            id: &job.id,
            object: job.api.object(true),
            created: job.created,
            model: &job.face.settings.model,
            choices: Vec::new(),
            usage: Some(totals.usage(engine, &job.prompt_tokens)),
            extra: None,
        };
        let _ = out.send(sse(&usage)).await;
    }
    let _ = out.send(DONE.to_owned()).await;
}

impl Job {
    /// A content chunk for prompt `index`.
    fn chunk(&self, index: usize, text: String, finish: Option<&'static str>) -> String {
        match self.api {
            Api::Completion => sse(&Envelope {
                id: &self.id,
                object: self.api.object(true),
                created: self.created,
                model: &self.face.settings.model,
                choices: vec![TextChoice {
                    index,
                    text,
                    logprobs: None,
                    finish_reason: finish,
                    extra: ChoiceExtra::of(self.face.settings.engine_api),
                }],
                usage: None,
                extra: None,
            }),
            Api::Chat => self.delta(index, None, text, finish),
        }
    }

    fn delta(
        &self,
        index: usize,
        role: Option<&'static str>,
        content: String,
        finish: Option<&'static str>,
    ) -> String {
        // vLLM's role chunk sets only index, delta, logprobs and finish_reason.
        let extra = match (role, self.face.settings.engine_api) {
            (Some(_), FaceEngine::Vllm) => ChoiceExtra::None {},
            (_, engine) => ChoiceExtra::of(engine),
        };
        sse(&Envelope {
            id: &self.id,
            object: self.api.object(true),
            created: self.created,
            model: &self.face.settings.model,
            choices: vec![DeltaChoice {
                index,
                delta: Delta {
                    role,
                    content: Some(content),
                },
                logprobs: None,
                finish_reason: finish,
                extra,
            }],
            usage: None,
            extra: None,
        })
    }
}
