//! The engines' HTTP APIs: health, model and cache facts, load, and streamed OpenAI
//! completions. [`EngineClient`] is the shell (reqwest); what the pages mean is read by pure
//! functions in [`prometheus`], [`vllm`], [`sglang`] and [`sse`], tested on the engines' real
//! output.
//!
//! Endpoints (vLLM 0.32 / SGLang 0.5.23): `GET /health` (200 = healthy, both);
//! `GET /v1/models` (the served model is the first `data[].id`, both; vLLM lists its LoRA
//! adapters there too, each with its base model as `parent`, [`models`]); vLLM `GET /metrics`
//! (Prometheus: cache facts and per-rank load) and `GET /version`; SGLang `GET /server_info`
//! (cache facts; on a 404, its deprecated name `/get_server_info`, which older versions only
//! have) and `GET /v1/loads` (per-rank load); both `POST /v1/completions` with `stream: true`,
//! the data-parallel rank in vLLM's `X-data-parallel-rank` header or SGLang's body.

pub mod models;
pub mod prometheus;
pub mod sglang;
pub mod sse;
pub mod vllm;

use std::time::Duration;

use futures::StreamExt;
use kvroute_common::error_chain::describe;
use kvroute_common::messages::GenerateErrorCode;
use kvroute_common::{DpRank, RequestId};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::config::EngineKind;
pub use models::{first_model, lora_adapters};
use sse::{Chunk, ChunkError, SseDecoder, StreamTally};

/// Largest body read from an engine's information endpoints (`/metrics` is the big one).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// What an engine says about itself; every fact may be unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineInfo {
    /// The first model of `/v1/models` (SGLang: else its `served_model_name`).
    pub model: Option<String>,
    /// Tokens per KV block (vLLM `block_size`, SGLang `page_size`).
    pub block_size: Option<u32>,
    /// Device KV blocks of one rank.
    pub num_gpu_blocks: Option<u64>,
    /// Data-parallel ranks (SGLang only; vLLM's `/metrics` does not say).
    pub dp_size: Option<u32>,
    /// The per-step token budget (SGLang only).
    pub max_num_batched_tokens: Option<u64>,
    pub version: Option<String>,
    /// An SGLang prefill server's bootstrap port (`disaggregation_bootstrap_port` when its
    /// `disaggregation_mode` is `prefill`): where decode workers fetch a request's KV.
    pub bootstrap_port: Option<u16>,
    /// The LoRA adapters the engine serves: vLLM's `/v1/models` entries that name a
    /// `parent` (the base model). `None` when not known (SGLang, or no `/v1/models` answer).
    pub lora_adapters: Option<Vec<String>>,
    /// Calls that failed, so a missing fact can be told from one the engine does not report.
    pub problems: Vec<String>,
}

/// One rank's load as the engine reports it; unknown fields are `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineLoad {
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    /// Fraction of the KV cache held by requests, 0..=1 (evictable cached blocks are free).
    pub kv_usage: Option<f64>,
    /// Prompt tokens of waiting requests not found in the cache (SGLang).
    pub waiting_uncached_tokens: Option<u64>,
    /// KV tokens held by requests (SGLang).
    pub used_tokens: Option<u64>,
    /// KV tokens of the rank's pool (SGLang).
    pub total_tokens: Option<u64>,
    /// Prompt tokens looked up in the prefix cache so far, and those found (vLLM's counters).
    pub prefix_cache_queries: Option<u64>,
    pub prefix_cache_hits: Option<u64>,
    /// The rank's LoRA adapter slots (vLLM with LoRA enabled, one rank).
    pub adapters: Option<kvroute_common::messages::AdapterSlots>,
}

impl EngineLoad {
    /// Whether the engine said anything about the rank's requests.
    pub fn is_known(&self) -> bool {
        self.running.is_some() || self.waiting.is_some()
    }

    /// Prompt tokens the engine computed (looked up and not found) so far, when it says.
    pub fn computed_prompt_tokens(&self) -> Option<u64> {
        Some(
            self.prefix_cache_queries?
                .saturating_sub(self.prefix_cache_hits.unwrap_or(0)),
        )
    }
}

/// One streamed completion to run.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The base model, or a LoRA adapter's name (engines list adapters as models).
    pub model: String,
    pub prompt: Vec<u32>,
    /// Exactly this many tokens are generated (`ignore_eos`).
    pub max_tokens: u32,
    /// The data-parallel rank to run on; `None` leaves it to the engine.
    pub dp_rank: Option<DpRank>,
    /// Sent as `X-Request-Id`, so the engine's logs name kvroute's request.
    pub request_id: RequestId,
}

/// A finished completion. Token counts are the final `usage`'s, `None` if the engine sent none.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// From the request's arrival to the first chunk with output; `None` if none came.
    pub ttft: Option<Duration>,
    /// From the arrival to `[DONE]`.
    pub latency: Duration,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Only with vLLM's `--enable-prompt-tokens-details` / SGLang's `--enable-cache-report`.
    pub cached_tokens: Option<u64>,
    /// Chunks that carried output (at least one token each).
    pub output_chunks: u64,
}

/// A call to the engine failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("{url}: unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url}: no answer within {timeout_ms} ms")]
    Timeout { url: String, timeout_ms: u64 },
    #[error("{url}: HTTP {status}: {message}")]
    Status {
        url: String,
        status: u16,
        message: String,
    },
    #[error("{url}: unexpected answer: {reason}")]
    BadResponse { url: String, reason: String },
    #[error("{url}: the engine failed the stream: {message}")]
    Stream {
        url: String,
        status: Option<u16>,
        message: String,
    },
}

impl EngineError {
    /// The HTTP status the engine gave, if it answered with one.
    pub fn status(&self) -> Option<u16> {
        match self {
            EngineError::Status { status, .. } => Some(*status),
            EngineError::Stream { status, .. } => *status,
            _ => None,
        }
    }

    /// The `GenerateError` code of a failed completion: the engine's 400s are the request's
    /// fault (e.g. a prompt above the context length), 413 too large, anything else the
    /// worker's.
    pub fn generate_code(&self) -> GenerateErrorCode {
        match self.status() {
            Some(400 | 422) => GenerateErrorCode::BadRequest,
            Some(413) => GenerateErrorCode::TooLarge,
            _ => GenerateErrorCode::Unavailable,
        }
    }
}

/// The JSON body of a completion request.
pub fn completion_body(kind: EngineKind, req: &CompletionRequest) -> Value {
    let mut body = json!({
        "model": req.model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    if let (EngineKind::Sglang, Some(rank)) = (kind, req.dp_rank) {
        // SGLang takes the rank in the body: `routed_dp_rank` (0.5.23), and the deprecated
        // `data_parallel_rank` that older versions know (0.5.23 maps it, ignored if both).
        body["routed_dp_rank"] = json!(rank);
        body["data_parallel_rank"] = json!(rank);
    }
    body
}

/// What SGLang's `/health` takes beyond a plain answer (see [`EngineClient::health_timeout`]).
pub const SGLANG_HEALTH_DELAY: Duration = Duration::from_millis(1500);

/// vLLM takes the data-parallel rank of a request in this header.
pub const VLLM_DP_RANK_HEADER: &str = "X-data-parallel-rank";

/// One engine's HTTP API.
#[derive(Debug, Clone)]
pub struct EngineClient {
    kind: EngineKind,
    base: String,
    http: reqwest::Client,
    timeout: Duration,
}

impl EngineClient {
    /// A client of the engine at `base_url`; `timeout` bounds every call except a completion
    /// (which only has to connect within it: a long prompt may take minutes).
    pub fn new(
        kind: EngineKind,
        base_url: &str,
        timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .build()?;
        Ok(Self {
            kind,
            base: base_url.trim().trim_end_matches('/').to_owned(),
            http,
            timeout,
        })
    }

    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn transport_error(&self, url: &str, e: &reqwest::Error, timeout: Duration) -> EngineError {
        if e.is_timeout() {
            EngineError::Timeout {
                url: url.to_owned(),
                timeout_ms: timeout.as_millis() as u64,
            }
        } else {
            EngineError::Unreachable {
                url: url.to_owned(),
                reason: describe(e),
            }
        }
    }

    /// A GET within the timeout; a status other than 200 is an error carrying the body's start.
    async fn get(&self, path: &str) -> Result<String, EngineError> {
        self.get_within(path, self.timeout).await
    }

    async fn get_within(&self, path: &str, timeout: Duration) -> Result<String, EngineError> {
        let url = self.url(path);
        let response = self
            .http
            .get(&url)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| self.transport_error(&url, &e, timeout))?;
        let status = response.status().as_u16();
        let body = read_limited(response, MAX_BODY_BYTES)
            .await
            .map_err(|e| match e {
                ReadError::Transport(e) => self.transport_error(&url, &e, timeout),
                ReadError::TooLarge => EngineError::BadResponse {
                    url: url.clone(),
                    reason: format!("body above {MAX_BODY_BYTES} bytes"),
                },
            })?;
        if status != 200 {
            return Err(EngineError::Status {
                url,
                status,
                message: error_message(&body),
            });
        }
        Ok(body)
    }

    async fn get_json(&self, path: &str) -> Result<Value, EngineError> {
        let body = self.get(path).await?;
        serde_json::from_str(&body).map_err(|e| EngineError::BadResponse {
            url: self.url(path),
            reason: format!("not JSON: {e}"),
        })
    }

    /// `GET /health`: `Ok` on 200.
    pub async fn health(&self) -> Result<(), EngineError> {
        self.get_within("/health", self.health_timeout())
            .await
            .map(drop)
    }

    /// SGLang's `/health` runs a one-token generation and answers only after its first 1 s
    /// check (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`, on by default; 503 after
    /// `SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s), so its probe gets that second on top.
    pub fn health_timeout(&self) -> Duration {
        match self.kind {
            EngineKind::Vllm => self.timeout,
            EngineKind::Sglang => self.timeout + SGLANG_HEALTH_DELAY,
        }
    }

    /// The engine's model and cache facts. `Err` only when the engine answered none of the
    /// calls; a fact behind a failed call is `None`, with the failure in `problems`.
    pub async fn info(&self) -> Result<EngineInfo, EngineError> {
        let (models, mut info, facts_error) = match self.kind {
            EngineKind::Vllm => {
                let (models, metrics, version) = tokio::join!(
                    self.get_json("/v1/models"),
                    self.get("/metrics"),
                    self.get_json("/version"),
                );
                let (mut info, error) = match metrics {
                    Ok(text) => (vllm::info(&vllm::parse_page(&text)), None),
                    Err(e) => (EngineInfo::default(), Some(e)),
                };
                match version {
                    Ok(v) => {
                        info.version = v.get("version").and_then(Value::as_str).map(Into::into)
                    }
                    Err(e) => info.problems.push(e.to_string()),
                }
                (models, info, error)
            }
            EngineKind::Sglang => {
                let (models, server_info) =
                    tokio::join!(self.get_json("/v1/models"), self.sglang_server_info());
                match server_info {
                    Ok(v) => (models, sglang::info(&v), None),
                    Err(e) => (models, EngineInfo::default(), Some(e)),
                }
            }
        };
        match (models, facts_error) {
            (Err(e), Some(_)) => return Err(e),
            (Ok(models), facts_error) => {
                if let Some(model) = first_model(&models) {
                    info.model = Some(model);
                }
                if self.kind == EngineKind::Vllm {
                    info.lora_adapters = lora_adapters(&models);
                }
                info.problems.extend(facts_error.map(|e| e.to_string()));
            }
            (Err(e), None) => info.problems.push(e.to_string()),
        }
        Ok(info)
    }

    /// The LoRA adapters a vLLM engine lists in `/v1/models` (`None`: SGLang, whose list is
    /// not read, or an answer without a model list).
    pub async fn lora_adapters(&self) -> Result<Option<Vec<String>>, EngineError> {
        if self.kind != EngineKind::Vllm {
            return Ok(None);
        }
        Ok(lora_adapters(&self.get_json("/v1/models").await?))
    }

    /// SGLang's `/server_info`, or `/get_server_info` on versions without it.
    async fn sglang_server_info(&self) -> Result<Value, EngineError> {
        match self.get_json("/server_info").await {
            Err(EngineError::Status { status: 404, .. }) => self.get_json("/get_server_info").await,
            other => other,
        }
    }

    /// The load of every rank of `ranks` (a rank the engine does not describe gets an
    /// all-unknown load).
    pub async fn load(&self, ranks: &[DpRank]) -> Result<Vec<(DpRank, EngineLoad)>, EngineError> {
        match self.kind {
            EngineKind::Vllm => {
                let text = self.get("/metrics").await?;
                Ok(vllm::load(&vllm::parse_page(&text), ranks))
            }
            EngineKind::Sglang => Ok(sglang::load(&self.get_json("/v1/loads").await?, ranks)),
        }
    }

    /// Empties the engine's prefix cache: vLLM's `POST /reset_prefix_cache` (served with
    /// `VLLM_SERVER_DEV_MODE=1`; `{"success": false}` while blocks are in use, an empty 200 from
    /// versions that do not say), SGLang's `POST /flush_cache` (400 while requests run). `Ok`
    /// only when the engine says the cache is empty.
    pub async fn reset_cache(&self) -> Result<(), EngineError> {
        let path = match self.kind {
            EngineKind::Vllm => "/reset_prefix_cache",
            EngineKind::Sglang => "/flush_cache",
        };
        let url = self.url(path);
        let response = self
            .http
            .post(&url)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| self.transport_error(&url, &e, self.timeout))?;
        let status = response.status().as_u16();
        let body = read_limited(response, 64 << 10).await.unwrap_or_default();
        if status != 200 {
            return Err(EngineError::Status {
                url,
                status,
                message: error_message(&body),
            });
        }
        let refused = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v.get("success").and_then(Value::as_bool))
            == Some(false);
        if refused {
            return Err(EngineError::BadResponse {
                url,
                reason: "the engine did not reset its cache (blocks still in use: retry when idle)"
                    .into(),
            });
        }
        Ok(())
    }

    /// Runs a streamed completion. Times count from `arrived`; `first_token` is told the TTFT
    /// as soon as the first output chunk is read, and `on_output` the output chunks read so
    /// far after each one.
    pub async fn complete(
        &self,
        req: &CompletionRequest,
        arrived: Instant,
        mut first_token: Option<oneshot::Sender<Duration>>,
        mut on_output: impl FnMut(u64) + Send,
    ) -> Result<Completion, EngineError> {
        let url = self.url("/v1/completions");
        let mut request = self
            .http
            .post(&url)
            .header("X-Request-Id", req.request_id.to_string())
            .json(&completion_body(self.kind, req));
        if let (EngineKind::Vllm, Some(rank)) = (self.kind, req.dp_rank) {
            request = request.header(VLLM_DP_RANK_HEADER, rank.to_string());
        }
        let response = request
            .send()
            .await
            .map_err(|e| self.transport_error(&url, &e, self.timeout))?;
        let status = response.status().as_u16();
        if status != 200 {
            let body = read_limited(response, 64 << 10).await.unwrap_or_default();
            return Err(EngineError::Status {
                url,
                status,
                message: error_message(&body),
            });
        }
        let mut decoder = SseDecoder::default();
        let mut tally = StreamTally::default();
        let mut ttft = None;
        let mut body = response.bytes_stream();
        let stream_error = |status, message: String| EngineError::Stream {
            url: url.clone(),
            status,
            message,
        };
        while !tally.done {
            let events = match body.next().await {
                Some(Ok(bytes)) => decoder.feed(&bytes),
                Some(Err(e)) => return Err(self.transport_error(&url, &e, self.timeout)),
                None => {
                    let last = decoder.finish();
                    if last.is_none() {
                        return Err(stream_error(None, "the stream ended before [DONE]".into()));
                    }
                    Ok(last.into_iter().collect())
                }
            }
            .map_err(|e| stream_error(None, e.to_string()))?;
            for event in events {
                match tally.on_event(&event) {
                    Ok(Chunk::Output) => {
                        if ttft.is_none() {
                            let t = arrived.elapsed();
                            ttft = Some(t);
                            if let Some(tx) = first_token.take() {
                                let _ = tx.send(t);
                            }
                        }
                        on_output(tally.output_chunks);
                    }
                    Ok(Chunk::Done) => break,
                    Ok(_) => {}
                    Err(ChunkError::Engine { status, message }) => {
                        return Err(stream_error(status, message));
                    }
                    Err(e @ ChunkError::Malformed { .. }) => {
                        return Err(stream_error(None, e.to_string()));
                    }
                }
            }
        }
        let usage = tally.usage.unwrap_or_default();
        Ok(Completion {
            ttft,
            latency: arrived.elapsed(),
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cached_tokens: usage.cached_tokens,
            output_chunks: tally.output_chunks,
        })
    }
}

enum ReadError {
    Transport(reqwest::Error),
    TooLarge,
}

async fn read_limited(response: reqwest::Response, limit: usize) -> Result<String, ReadError> {
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(ReadError::Transport)?;
        if body.len() + chunk.len() > limit {
            return Err(ReadError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The message of an error body (`{"error": {"message": ..}}`, FastAPI's `{"detail": ..}`),
/// else its first 200 characters.
pub fn error_message(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        if let Some(ChunkError::Engine { message, .. }) = sse::stream_error(&v) {
            return message;
        }
        if let Some(detail) = v.get("detail") {
            return match detail.as_str() {
                Some(s) => s.to_owned(),
                None => detail.to_string(),
            };
        }
    }
    let body = body.trim();
    if body.is_empty() {
        return "(empty body)".into();
    }
    body.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_bodies_name_the_rank_the_engines_way() {
        let req = CompletionRequest {
            model: "m".into(),
            prompt: vec![1, 2, 3],
            max_tokens: 0,
            dp_rank: Some(1),
            request_id: RequestId::from_u128(7),
        };
        let vllm = completion_body(EngineKind::Vllm, &req);
        assert_eq!(
            vllm,
            json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": true,
                   "stream_options": {"include_usage": true}, "ignore_eos": true})
        );
        let sglang = completion_body(EngineKind::Sglang, &req);
        assert_eq!(sglang["routed_dp_rank"], json!(1));
        assert_eq!(sglang["data_parallel_rank"], json!(1));
        let one_rank = CompletionRequest {
            dp_rank: None,
            ..req
        };
        assert!(
            completion_body(EngineKind::Sglang, &one_rank)
                .get("routed_dp_rank")
                .is_none()
        );
    }

    #[test]
    fn sglang_health_probes_wait_for_its_generation() {
        let t = Duration::from_millis(1000);
        let vllm = EngineClient::new(EngineKind::Vllm, "http://e:8000/", t).unwrap();
        assert_eq!(
            (vllm.health_timeout(), vllm.base_url()),
            (t, "http://e:8000")
        );
        let sglang = EngineClient::new(EngineKind::Sglang, "http://e:30000", t).unwrap();
        assert_eq!(sglang.health_timeout(), t + SGLANG_HEALTH_DELAY);
    }

    #[test]
    fn error_messages_and_codes() {
        assert_eq!(
            error_message(
                r#"{"error":{"message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":null,"code":400}}"#
            ),
            "This model's maximum context length is 4096 tokens."
        );
        assert_eq!(error_message(r#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(error_message(""), "(empty body)");
        assert_eq!(error_message(&"x".repeat(500)).len(), 200);
        let status = |status| EngineError::Status {
            url: "u".into(),
            status,
            message: String::new(),
        };
        assert_eq!(status(400).generate_code(), GenerateErrorCode::BadRequest);
        assert_eq!(status(413).generate_code(), GenerateErrorCode::TooLarge);
        assert_eq!(status(503).generate_code(), GenerateErrorCode::Unavailable);
        let unreachable = EngineError::Unreachable {
            url: "u".into(),
            reason: "refused".into(),
        };
        assert_eq!(unreachable.generate_code(), GenerateErrorCode::Unavailable);
        assert_eq!(unreachable.status(), None);
    }
}
