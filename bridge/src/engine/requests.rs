//! Serving `GenerateRequest`s: the card's request subject → the engine's streamed
//! `/v1/completions` → a `GenerateResponse`, with `prefill_done` (at the first output chunk),
//! `progress` (each time the output chunks reach a multiple of the card's block size; a chunk
//! carries one token unless the engine batches its stream, so this counts a lower bound) and
//! `finished` lifecycle events as kvroute-mocker publishes them.
//!
//! While the engine is deregistered the subscription is dropped, but requests already running
//! finish (a slow `/health` is no reason to kill them); at shutdown they are answered
//! `cancelled`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::{Message, Subject};
use futures::StreamExt;
use kvroute_common::codec::decode;
use kvroute_common::messages::{
    GenerateError, GenerateErrorCode, GenerateReply, GenerateRequest, GenerateResponse,
    LifecycleKind, RequestLifecycle, SchemaVersion, now_ms,
};
use kvroute_common::{DecodeError, DpRank, RequestId};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use super::report::Reporter;
use crate::engine_http::{Completion, CompletionRequest, EngineClient};
use crate::metrics::{BridgeMetrics, names};

/// The error reply for a request that could not be decoded.
pub fn decode_error(e: &DecodeError) -> GenerateError {
    GenerateError::undecodable(e)
}

fn error(
    request_id: Option<RequestId>,
    code: GenerateErrorCode,
    message: impl Into<String>,
) -> GenerateError {
    GenerateError::new(request_id, code, message)
}

/// The worker a request is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    pub model: String,
    /// The card's ranks, first the default.
    pub ranks: Vec<DpRank>,
    /// The card's block size (`progress` events come per block of output).
    pub block_size: u32,
}

/// Checks `req` and turns it into the engine's completion; returns the rank it runs on.
pub fn to_completion(
    req: &GenerateRequest,
    serving: &Serving,
) -> Result<(CompletionRequest, DpRank), GenerateError> {
    let id = req.request_id;
    let bad = |message: &str| error(Some(id), GenerateErrorCode::BadRequest, message);
    let prompt = match (&req.token_ids, &req.block_hashes) {
        (Some(_), Some(_)) => return Err(bad("give token_ids or block_hashes, not both")),
        (None, None) => return Err(bad("one of token_ids or block_hashes is required")),
        (None, Some(_)) => {
            return Err(bad(
                "the engine needs token ids: send token_ids (block_hashes cannot be run)",
            ));
        }
        (Some(tokens), None) if tokens.is_empty() => return Err(bad("the prompt is empty")),
        (Some(tokens), None) => tokens.clone(),
    };
    let first = serving.ranks.first().copied().unwrap_or(0);
    let rank = req.dp_rank.unwrap_or(first);
    if !serving.ranks.contains(&rank) {
        return Err(error(
            Some(id),
            GenerateErrorCode::UnknownDpRank,
            format!(
                "dp rank {rank} is not served here (ranks {:?})",
                serving.ranks
            ),
        ));
    }
    let model = match req.lora_name.as_deref() {
        Some(lora) if !lora.is_empty() => lora.to_owned(),
        _ => serving.model.clone(),
    };
    let completion = CompletionRequest {
        model,
        prompt,
        max_tokens: req.max_tokens.max(1),
        // An engine with one rank may not run data-parallel at all: name no rank then.
        dp_rank: (serving.ranks.len() > 1).then_some(rank),
        request_id: id,
    };
    Ok((completion, rank))
}

/// The reply of a finished completion. Counts the engine did not report fall back: the prompt
/// to its length, output tokens to the chunks with output (each carries at least one), cached
/// tokens to 0 (the engines report them only when asked to, see [`Completion`]).
pub fn reply_of(
    c: &Completion,
    request_id: RequestId,
    worker_id: u64,
    dp_rank: DpRank,
    prompt_len: usize,
) -> GenerateReply {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    GenerateReply {
        v: SchemaVersion::CURRENT,
        request_id,
        worker_id,
        dp_rank,
        ttft_ms: ms(c.ttft.unwrap_or(c.latency)),
        latency_ms: ms(c.latency),
        prompt_tokens: c.prompt_tokens.unwrap_or(prompt_len as u64),
        cached_tokens: c.cached_tokens.unwrap_or(0),
        output_tokens: c.completion_tokens.unwrap_or(c.output_chunks),
    }
}

/// How the request task stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Take no new requests; let the running ones finish.
    Drain,
    /// Abort the running ones and answer them `cancelled` (shutdown).
    Cancel,
}

/// The running request task.
#[derive(Debug)]
pub struct RequestsHandle {
    stop: oneshot::Sender<StopMode>,
    task: JoinHandle<()>,
}

impl RequestsHandle {
    /// Stops taking requests; the returned task ends when the running ones have ended.
    pub fn stop(self, mode: StopMode) -> JoinHandle<()> {
        let _ = self.stop.send(mode);
        self.task
    }
}

/// What the request task needs.
#[derive(Debug, Clone)]
pub struct RequestTask {
    pub label: String,
    pub client: EngineClient,
    pub serving: Serving,
    pub reporter: Reporter,
    pub metrics: Arc<BridgeMetrics>,
    /// Set once the engine was seen not to report cached tokens (warned once per engine).
    pub warned_no_cache_report: Arc<AtomicBool>,
}

impl RequestTask {
    /// Serves `requests` (a subscription to the card's request subject) until stopped.
    pub fn spawn(self, requests: async_nats::Subscriber) -> RequestsHandle {
        let (stop, stop_rx) = oneshot::channel();
        let task = tokio::spawn(self.run(requests, stop_rx));
        RequestsHandle { stop, task }
    }

    async fn run(
        self,
        mut requests: async_nats::Subscriber,
        mut stop: oneshot::Receiver<StopMode>,
    ) {
        let mut running: JoinSet<RequestId> = JoinSet::new();
        let mut in_flight: HashMap<RequestId, (Option<Subject>, DpRank)> = HashMap::new();
        let mode = loop {
            tokio::select! {
                mode = &mut stop => break mode.unwrap_or(StopMode::Cancel),
                Some(done) = running.join_next(), if !running.is_empty() => {
                    if let Ok(id) = done {
                        in_flight.remove(&id);
                    }
                }
                msg = requests.next() => match msg {
                    Some(msg) => self.on_request(msg, &mut running, &mut in_flight).await,
                    None => break StopMode::Drain,
                },
            }
        };
        let _ = requests.unsubscribe().await;
        if mode == StopMode::Cancel {
            running.abort_all();
        }
        while let Some(done) = running.join_next().await {
            if let Ok(id) = done {
                in_flight.remove(&id);
            }
        }
        // What is left was aborted.
        for (id, (reply, rank)) in in_flight {
            self.metrics
                .inc(names::REQUESTS, &self.label, None, "cancelled");
            self.finished(id, rank, 0).await;
            if let Some(reply) = reply {
                let e = error(
                    Some(id),
                    GenerateErrorCode::Cancelled,
                    "the bridge is shutting down",
                );
                let _ = self
                    .reporter
                    .reply(reply, &GenerateResponse::Error(e))
                    .await;
            }
        }
    }

    async fn on_request(
        &self,
        msg: Message,
        running: &mut JoinSet<RequestId>,
        in_flight: &mut HashMap<RequestId, (Option<Subject>, DpRank)>,
    ) {
        let arrived = Instant::now();
        let checked = decode::<GenerateRequest>(&msg.payload)
            .map_err(|e| decode_error(&e))
            .and_then(|req| {
                let (completion, rank) = to_completion(&req, &self.serving)?;
                if in_flight.contains_key(&req.request_id) {
                    return Err(error(
                        Some(req.request_id),
                        GenerateErrorCode::Duplicate,
                        "a request with this id is already running here",
                    ));
                }
                Ok((completion, rank))
            });
        match checked {
            Err(e) => {
                tracing::debug!(engine = self.label, code = e.code.as_str(), error = %e.message, "request refused");
                self.metrics
                    .inc(names::REQUESTS, &self.label, None, e.code.as_str());
                if let Some(reply) = msg.reply {
                    let _ = self
                        .reporter
                        .reply(reply, &GenerateResponse::Error(e))
                        .await;
                }
            }
            Ok((completion, rank)) => {
                in_flight.insert(completion.request_id, (msg.reply.clone(), rank));
                running.spawn(self.clone().serve(completion, rank, msg.reply, arrived));
            }
        }
    }

    async fn serve(
        self,
        completion: CompletionRequest,
        rank: DpRank,
        reply: Option<Subject>,
        arrived: Instant,
    ) -> RequestId {
        let id = completion.request_id;
        let (first_token, first_token_rx) = oneshot::channel();
        let (blocks_tx, mut blocks_rx) = tokio::sync::mpsc::unbounded_channel();
        let block_size = u64::from(self.serving.block_size.max(1));
        let on_output = move |chunks: u64| {
            if chunks.is_multiple_of(block_size) {
                let _ = blocks_tx.send(chunks);
            }
        };
        // In order: `prefill_done`, then a `progress` per block of output (ends with the
        // stream, which drops the sender).
        let events = async {
            if first_token_rx.await.is_ok() {
                // The engines report cached tokens only with the final usage.
                self.lifecycle(id, rank, LifecycleKind::PrefillDone { cached_tokens: 0 })
                    .await;
            }
            while let Some(output_tokens) = blocks_rx.recv().await {
                self.lifecycle(id, rank, LifecycleKind::Progress { output_tokens })
                    .await;
            }
        };
        let (result, ()) = tokio::join!(
            self.client
                .complete(&completion, arrived, Some(first_token), on_output),
            events
        );
        let (response, output_tokens) = match result {
            Ok(c) => {
                if c.cached_tokens.is_none()
                    && !self.warned_no_cache_report.swap(true, Ordering::Relaxed)
                {
                    tracing::warn!(
                        engine = self.label,
                        "the engine does not report cached prompt tokens; replies say 0 \
                         (start vLLM with --enable-prompt-tokens-details, SGLang with --enable-cache-report)"
                    );
                }
                self.metrics.inc(names::REQUESTS, &self.label, None, "ok");
                let r = reply_of(
                    &c,
                    id,
                    self.reporter.worker_id(),
                    rank,
                    completion.prompt.len(),
                );
                let output = r.output_tokens;
                (GenerateResponse::Ok(r), output)
            }
            Err(e) => {
                let code = e.generate_code();
                tracing::warn!(engine = self.label, request_id = %id, code = code.as_str(), error = %e, "completion failed");
                self.metrics
                    .inc(names::REQUESTS, &self.label, None, code.as_str());
                (
                    GenerateResponse::Error(error(Some(id), code, e.to_string())),
                    0,
                )
            }
        };
        self.finished(id, rank, output_tokens).await;
        if let Some(reply) = reply
            && let Err(e) = self.reporter.reply(reply, &response).await
        {
            tracing::warn!(engine = self.label, error = %e, "publishing a reply failed");
        }
        id
    }

    async fn finished(&self, id: RequestId, rank: DpRank, output_tokens: u64) {
        self.lifecycle(id, rank, LifecycleKind::Finished { output_tokens })
            .await;
    }

    async fn lifecycle(&self, request_id: RequestId, dp_rank: DpRank, kind: LifecycleKind) {
        let event = RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id,
            worker_id: self.reporter.worker_id(),
            dp_rank,
            kind,
            ts: now_ms(),
        };
        if let Err(e) = self.reporter.lifecycle(&event).await {
            tracing::warn!(engine = self.label, error = %e, "publishing a lifecycle event failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn serving(ranks: &[DpRank]) -> Serving {
        Serving {
            model: "base".into(),
            ranks: ranks.to_vec(),
            block_size: 16,
        }
    }

    fn request() -> GenerateRequest {
        GenerateRequest {
            request_id: RequestId::from_u128(9),
            token_ids: Some(vec![1, 2, 3]),
            max_tokens: 4,
            ..GenerateRequest::default()
        }
    }

    #[test]
    fn a_request_becomes_a_completion() {
        let (c, rank) = to_completion(&request(), &serving(&[0])).unwrap();
        assert_eq!(
            c,
            CompletionRequest {
                model: "base".into(),
                prompt: vec![1, 2, 3],
                max_tokens: 4,
                dp_rank: None,
                request_id: RequestId::from_u128(9),
            }
        );
        assert_eq!(rank, 0);
        let lora = GenerateRequest {
            lora_name: Some("sql".into()),
            dp_rank: Some(3),
            max_tokens: 0,
            ..request()
        };
        let (c, rank) = to_completion(&lora, &serving(&[2, 3])).unwrap();
        assert_eq!(
            (c.model.as_str(), c.dp_rank, rank, c.max_tokens),
            ("sql", Some(3), 3, 1)
        );
        let (c, rank) = to_completion(&request(), &serving(&[2, 3])).unwrap();
        assert_eq!((c.dp_rank, rank), (Some(2), 2), "the first rank by default");
    }

    #[test]
    fn refusals_carry_codes() {
        let code = |req: GenerateRequest| to_completion(&req, &serving(&[0])).unwrap_err();
        let e = code(GenerateRequest {
            token_ids: None,
            block_hashes: Some(vec![1]),
            block_size: Some(16),
            ..request()
        });
        assert_eq!(e.code, GenerateErrorCode::BadRequest);
        assert!(e.message.contains("needs token ids"), "{}", e.message);
        assert_eq!(e.request_id, Some(RequestId::from_u128(9)));
        for req in [
            GenerateRequest {
                token_ids: None,
                ..request()
            },
            GenerateRequest {
                token_ids: Some(vec![]),
                ..request()
            },
            GenerateRequest {
                block_hashes: Some(vec![1]),
                ..request()
            },
        ] {
            assert_eq!(code(req).code, GenerateErrorCode::BadRequest);
        }
        let e = code(GenerateRequest {
            dp_rank: Some(1),
            ..request()
        });
        assert_eq!(e.code, GenerateErrorCode::UnknownDpRank);
        let e = decode_error(&DecodeError::UnsupportedVersion {
            message: "GenerateRequest",
            version: 2,
            supported: 1,
        });
        assert_eq!(
            (e.code, e.request_id),
            (GenerateErrorCode::UnsupportedVersion, None)
        );
    }

    #[test]
    fn replies_use_the_usage_and_fall_back_when_it_is_missing() {
        let c = Completion {
            ttft: Some(Duration::from_millis(12)),
            latency: Duration::from_millis(50),
            prompt_tokens: Some(40),
            completion_tokens: Some(3),
            cached_tokens: Some(32),
            output_chunks: 3,
        };
        let r = reply_of(&c, RequestId::from_u128(1), 7, 1, 40);
        assert_eq!((r.ttft_ms, r.latency_ms), (12.0, 50.0));
        assert_eq!(
            (r.prompt_tokens, r.cached_tokens, r.output_tokens),
            (40, 32, 3)
        );
        assert_eq!((r.worker_id, r.dp_rank), (7, 1));
        let bare = Completion {
            ttft: None,
            prompt_tokens: None,
            completion_tokens: None,
            cached_tokens: None,
            output_chunks: 2,
            ..c
        };
        let r = reply_of(&bare, RequestId::from_u128(1), 7, 0, 41);
        assert_eq!(
            r.ttft_ms, 50.0,
            "no output chunk: the first token is the last"
        );
        assert_eq!(
            (r.prompt_tokens, r.cached_tokens, r.output_tokens),
            (41, 0, 2)
        );
    }
}
