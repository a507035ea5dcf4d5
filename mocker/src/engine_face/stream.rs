//! A streamed completion or chat answer: one SSE chunk per generated token, sent as the
//! simulated engine produces it (the first at the TTFT, then one per decode step), the chat's
//! role chunk first and `finish_reason` on the last content chunk, then the usage chunk if
//! `stream_options.include_usage`, then `[DONE]`. If the engine drops the request (shutdown)
//! the stream ends without `[DONE]`.
//!
//! The body owns the [`Job`], so when the client leaves and the server drops the body, the
//! job's guard aborts the prompts still running.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::config::EngineKind;
use super::job::{FINISH_REASON, Job};
use super::openai;
use super::progress::{End, PromptProgress};
use super::shapes::{Api, ChoiceExtra, DONE, Delta, DeltaChoice, Envelope, TextChoice, sse};

/// The SSE response of `job`.
pub(super) fn respond(job: Job, include_usage: bool) -> Response {
    let body = futures::stream::unfold(Streamer::new(job, include_usage), |mut s| async move {
        let chunk = s.next().await?;
        Some((Ok::<_, Infallible>(Bytes::from(chunk)), s))
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

/// What of one prompt has been sent.
#[derive(Debug, Clone, Copy, Default)]
struct Sent {
    /// The chat's role chunk (or, for completions, nothing: the first token is out).
    started: bool,
    tokens: u64,
    /// The chunk with `finish_reason`.
    finished: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Tokens,
    Usage,
    Done,
    Over,
}

struct Streamer {
    job: Job,
    include_usage: bool,
    /// The progress last read (a reused copy, so the ranks' writes never wait on chunking).
    seen: Vec<PromptProgress>,
    sent: Vec<Sent>,
    phase: Phase,
}

impl Streamer {
    fn new(mut job: Job, include_usage: bool) -> Self {
        let seen = job.progress.borrow_and_update().clone();
        Self {
            sent: vec![Sent::default(); seen.len()],
            seen,
            job,
            include_usage,
            phase: Phase::Tokens,
        }
    }

    /// The next chunk, waiting for the engine if none is due; `None` at the end.
    async fn next(&mut self) -> Option<String> {
        loop {
            match self.phase {
                Phase::Tokens => {
                    if let Some(chunk) = self.token_chunk() {
                        return Some(chunk);
                    }
                    if self.sent.iter().all(|s| s.finished) {
                        self.job.requests.disarm();
                        self.phase = if self.include_usage {
                            Phase::Usage
                        } else {
                            Phase::Done
                        };
                    } else if self.seen.iter().any(|p| p.end == Some(End::Cancelled)) {
                        self.job.requests.disarm();
                        self.phase = Phase::Over;
                    } else if self.job.progress.changed().await.is_ok() {
                        self.seen.clear();
                        self.seen
                            .extend_from_slice(&self.job.progress.borrow_and_update());
                    } else {
                        // Every rank let go of the request without ending it: as cancelled.
                        self.phase = Phase::Over;
                    }
                }
                Phase::Usage => {
                    self.phase = Phase::Done;
                    return Some(self.usage_chunk());
                }
                Phase::Done => {
                    self.phase = Phase::Over;
                    return Some(DONE.to_owned());
                }
                Phase::Over => return None,
            }
        }
    }

    /// The next chunk the progress read allows, in prompt order.
    fn token_chunk(&mut self) -> Option<String> {
        let max_tokens = u64::from(self.job.max_tokens);
        for (index, (p, sent)) in self.seen.iter().zip(&mut self.sent).enumerate() {
            if sent.finished || p.cached_tokens.is_none() {
                continue;
            }
            if !sent.started {
                sent.started = true;
                if self.job.api == Api::Chat {
                    return Some(
                        self.job
                            .delta(index, Some("assistant"), String::new(), None),
                    );
                }
            }
            let finished = p.end == Some(End::Finished);
            // The last token waits for the end, so it carries the finish reason.
            let due = if finished {
                p.generated
            } else {
                p.generated.min(max_tokens - 1)
            };
            let more = sent.tokens < due;
            if more || finished {
                let text = if more {
                    sent.tokens += 1;
                    openai::filler(1)
                } else {
                    String::new()
                };
                sent.finished = finished && sent.tokens == due;
                let reason = sent.finished.then_some(FINISH_REASON);
                return Some(self.job.chunk(index, text, reason));
            }
        }
        None
    }

    fn usage_chunk(&self) -> String {
        sse(&Envelope::<TextChoice> {
            id: &self.job.id,
            object: self.job.api.object(true),
            created: self.job.created,
            model: &self.job.model,
            choices: Vec::new(),
            usage: Some(self.job.usage(&self.seen)),
            extra: None,
        })
    }
}

impl Job {
    /// A content chunk for prompt `index`.
    fn chunk(&self, index: usize, text: String, finish: Option<&'static str>) -> String {
        match self.api {
            Api::Completion => sse(&Envelope {
                id: &self.id,
                object: self.api.object(true),
                created: self.created,
                model: &self.model,
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
            (Some(_), EngineKind::Vllm) => ChoiceExtra::None {},
            (_, engine) => ChoiceExtra::of(engine),
        };
        sse(&Envelope {
            id: &self.id,
            object: self.api.object(true),
            created: self.created,
            model: &self.model,
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
