//! Drives one mode through a kvroute-gateway's OpenAI API (`--selector gateway`): every request,
//! at its arrival, is a streamed `POST /v1/completions` whose prompt is the trace row's token
//! ids, with `max_tokens` its output length and `ignore_eos`, so the worker generates exactly
//! that many tokens. The gateway selects through the routers and forwards; on a fleet with
//! prefill and decode workers it runs the hand-off, and the stream is the decode worker's.
//!
//! What the client measures, in wall time × the speedup (simulated, as the mocker's figures):
//! TTFT from the send to the first token's chunk, every gap between two token chunks (the
//! inter-token latency), the end to end latency; the usage chunk gives the token counts; the
//! answer's headers name the worker (`x-kvroute-worker-id`: the prefill worker of a split
//! request) and, for a split request, the decode worker (`x-kvroute-decode-worker-id`).
//!
//! A split request's usage is the decode worker's, which received the prompt's KV by transfer:
//! it says nothing of the prefill worker's cache. The mode's hits are therefore read from the
//! engines' own counters (vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` on
//! every prefill and aggregated worker's `/metrics`), before and after the mode, as the prompt
//! tokens found cached where prompts are computed; without them (an engine that does not
//! expose them), from the usage of the requests that were not split.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt as _;
use kvroute_common::WorkerId;
use kvroute_common::messages::{WorkerCard, WorkerRole};
use kvroute_common::trace::TraceRequest;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::Instant;

use super::driver::{DriveSettings, Outcome, Tally, schedule};
use super::plan::Plan;
use super::report::{DisaggregationReport, ModeRecorder, ModeReport, RequestSample};
use super::sessions::session_context;
use super::stats::{Summary, coefficient_of_variation};
use kvroute_bridge::engine_http::prometheus;
use kvroute_bridge::engine_http::sse::SseDecoder;
use kvroute_bridge::engine_http::vllm::{PREFIX_HITS, PREFIX_QUERIES};

/// The gateway's answer header naming the worker (the prefill worker of a split request).
const WORKER_HEADER: &str = "x-kvroute-worker-id";
/// The gateway's answer header naming a split request's decode worker.
const DECODE_WORKER_HEADER: &str = "x-kvroute-decode-worker-id";

/// Where the gateway is and how to reach it.
#[derive(Debug, Clone)]
pub struct GatewayTarget {
    /// The gateway's base URL (`http://host:port`, without `/v1`).
    pub url: String,
    /// Sent as `Authorization: Bearer …` when the gateway asks for API keys.
    pub api_key: Option<String>,
}

/// What a completed request adds to the mode besides its sample.
#[derive(Debug)]
pub struct Streamed {
    itl_ms: Vec<f64>,
    decode_worker: Option<WorkerId>,
}

/// Replays `plan` once through the gateway; `cards`: the model's workers at the start.
pub async fn drive_gateway(
    plan: &Plan,
    settings: &DriveSettings,
    target: &GatewayTarget,
    cards: &[WorkerCard],
    stop: &watch::Receiver<bool>,
    progress: impl FnMut(&Tally),
) -> anyhow::Result<ModeReport> {
    let client = reqwest::Client::builder()
        .timeout(settings.request_timeout)
        .pool_max_idle_per_host(1024)
        .build()?;
    let computing: Vec<&WorkerCard> = cards
        .iter()
        .filter(|c| c.role != WorkerRole::Decode)
        .collect();
    let decoders: Vec<WorkerId> = cards
        .iter()
        .filter(|c| c.role == WorkerRole::Decode)
        .map(|c| c.worker_id)
        .collect();
    // Load spread over the workers that compute prompts; sessions are not reported (a split
    // request's usage does not show the prefill worker's hits).
    let mut recorder = ModeRecorder::new(
        settings.mode.as_str(),
        computing.iter().map(|c| c.worker_id),
    );
    let before = engine_counters(&client, &computing).await;
    let mut per_decode: BTreeMap<WorkerId, u64> = decoders.iter().map(|&w| (w, 0)).collect();
    let mut unpaired = 0u64;
    let url = format!("{}/v1/completions", target.url.trim_end_matches('/'));
    let duration = schedule(
        plan,
        settings.speedup,
        stop,
        &mut recorder,
        progress,
        |recorder, streamed: Streamed| {
            recorder.record_itl(&streamed.itl_ms);
            match streamed.decode_worker {
                Some(w) => *per_decode.entry(w).or_default() += 1,
                None => unpaired += 1,
            }
        },
        |request, start| {
            let task = StreamTask {
                request,
                trace: plan.requests[request].clone(),
                client: client.clone(),
                url: url.clone(),
                api_key: target.api_key.clone(),
                settings: settings.clone(),
                start,
            };
            async move {
                match task.attempt().await {
                    Ok(outcome) => outcome,
                    Err(kind) => {
                        tracing::debug!(kind, "request failed");
                        Outcome::Failed { kind }
                    }
                }
            }
        },
    )
    .await;
    let after = engine_counters(&client, &computing).await;
    let mut report = recorder.finish(duration);
    if let (Some(before), Some(after)) = (before, after) {
        report.prompt_tokens = after.0.saturating_sub(before.0);
        report.cached_prompt_tokens = after.1.saturating_sub(before.1);
        report.hit_rate = super::oracle::ratio(report.cached_prompt_tokens, report.prompt_tokens);
        report.hits_from_engines = true;
    }
    if !decoders.is_empty() {
        let paired: u64 = per_decode.values().sum();
        let loads: Vec<f64> = per_decode.values().map(|&n| n as f64).collect();
        report.disaggregation = Some(DisaggregationReport {
            mode: "gateway".to_owned(),
            prefill_workers: computing.len() as u32,
            decode_workers: decoders.len() as u32,
            paired,
            unpaired,
            transfer_ms: Summary::default(),
            prefill_ms: Summary::default(),
            load_cv_decode_requests: coefficient_of_variation(&loads),
        });
    }
    Ok(report)
}

/// The sums of `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` over
/// `cards`' engines (`None` if one has no HTTP URL, does not answer, or lacks them).
async fn engine_counters(client: &reqwest::Client, cards: &[&WorkerCard]) -> Option<(u64, u64)> {
    let mut urls: Vec<&str> = cards.iter().filter_map(|c| c.http_url.as_deref()).collect();
    if urls.len() != cards.len() || urls.is_empty() {
        return None;
    }
    // Several workers may share an engine (its data-parallel ranks): count each engine once.
    urls.sort_unstable();
    urls.dedup();
    let (mut queries, mut hits) = (0u64, 0u64);
    for url in urls {
        let metrics = client
            .get(format!("{}/metrics", url.trim_end_matches('/')))
            .send()
            .await
            .ok()?
            .error_for_status()
            .ok()?
            .text()
            .await
            .ok()?;
        let (q, h) = prefix_cache_counters(&metrics)?;
        queries += q;
        hits += h;
    }
    Some((queries, hits))
}

/// vLLM's prefix-cache counters (queries, hits) in a `/metrics` page, summed over their
/// series (read with the bridge's parser of the exposition format).
pub fn prefix_cache_counters(metrics: &str) -> Option<(u64, u64)> {
    let page = prometheus::parse(metrics, |n| n == PREFIX_QUERIES || n == PREFIX_HITS);
    let sum = |name: &str| {
        let mut series = page.named(name).peekable();
        series.peek()?;
        Some(series.map(|s| s.value).sum::<f64>() as u64)
    };
    Some((sum(PREFIX_QUERIES)?, sum(PREFIX_HITS)?))
}

struct StreamTask {
    request: usize,
    trace: TraceRequest,
    client: reqwest::Client,
    url: String,
    api_key: Option<String>,
    settings: DriveSettings,
    start: Instant,
}

impl StreamTask {
    async fn attempt(self) -> Result<Outcome<Streamed>, String> {
        let output = self.trace.output_length;
        let body = serde_json::json!({
            "model": self.settings.model,
            "prompt": self.trace.tokens(),
            "max_tokens": output,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut req = self.client.post(&self.url).json(&body);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        if self.settings.send_sessions
            && let Some(session) = session_context(&self.trace, &self.settings.session_scope)
        {
            req = req.header("x-session-id", session.id);
        }
        let sent = Instant::now();
        let resp = req.send().await.map_err(|e| transport_kind(&e))?;
        let status = resp.status();
        if !status.is_success() {
            let code = resp
                .json::<ErrorBody>()
                .await
                .ok()
                .and_then(|b| b.error.code.or(b.error.kind));
            return Err(match code {
                Some(code) => format!("gateway_{}_{code}", status.as_u16()),
                None => format!("gateway_{}", status.as_u16()),
            });
        }
        let header = |name: &str| -> Option<WorkerId> {
            resp.headers().get(name)?.to_str().ok()?.parse().ok()
        };
        let worker_id = header(WORKER_HEADER).ok_or("gateway_no_worker_header")?;
        let decode_worker = header(DECODE_WORKER_HEADER);
        let mut reader = SseDecoder::default();
        let mut tokens: Vec<Instant> = Vec::with_capacity(output as usize);
        let mut usage = None;
        let mut done = false;
        let mut body = resp.bytes_stream();
        let mut read = |event: &str, now: Instant| -> Result<(), String> {
            match parse_event(event)? {
                Event::Done => done = true,
                Event::Chunk { token, chunk_usage } => {
                    if token {
                        tokens.push(now);
                    }
                    usage = chunk_usage.or(usage.take());
                }
                Event::Other => {}
            }
            Ok(())
        };
        while let Some(bytes) = body.next().await {
            let bytes = bytes.map_err(|e| transport_kind(&e))?;
            let now = Instant::now();
            let events = reader
                .feed(&bytes)
                .map_err(|_| "gateway_malformed_stream")?;
            for event in events {
                read(&event, now)?;
            }
        }
        // An event the body ended without its blank line still counts.
        if let Some(event) = reader.finish() {
            read(&event, Instant::now())?;
        }
        let ended = Instant::now();
        if !done {
            return Err("gateway_stream_cut".to_owned());
        }
        let usage = usage.ok_or("gateway_no_usage")?;
        let first = *tokens.first().ok_or("gateway_no_tokens")?;
        let sim = |d: Duration| d.mul_f64(self.settings.speedup);
        let itl_ms = tokens
            .windows(2)
            .map(|w| sim(w[1] - w[0]).as_secs_f64() * 1e3)
            .collect();
        // A split request's usage is the decode worker's: its prompt and hits are the engines'
        // counters' business (see the module's note).
        let (prompt_tokens, cached_tokens) = match decode_worker {
            Some(_) => (0, 0),
            None => (usage.prompt_tokens, usage.cached()),
        };
        Ok(Outcome::Done {
            sample: RequestSample {
                request: self.request,
                worker_id,
                prompt_tokens,
                cached_tokens,
                output_tokens: usage.completion_tokens,
                ttft: sim(first - sent),
                latency: sim(ended - sent),
                selection_latency: None,
                selection_wait: Duration::ZERO,
            },
            finished_at: sim(ended.saturating_duration_since(self.start)),
            retries: 0,
            extra: Streamed {
                itl_ms,
                decode_worker,
            },
        })
    }
}

fn transport_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "gateway_timeout".to_owned()
    } else if e.is_connect() {
        "gateway_unreachable".to_owned()
    } else {
        "gateway_transport".to_owned()
    }
}

#[derive(Debug, PartialEq)]
enum Event {
    Done,
    /// A chunk: whether it carries a token (a choice with text), and its usage if any.
    Chunk {
        token: bool,
        chunk_usage: Option<Usage>,
    },
    Other,
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

impl Usage {
    fn cached(&self) -> u64 {
        self.prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: ErrorFields,
}

#[derive(Debug, Deserialize)]
struct ErrorFields {
    #[serde(default)]
    code: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

fn parse_event(data: &str) -> Result<Event, String> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    let chunk: Chunk = serde_json::from_str(data).map_err(|_| "gateway_malformed_chunk")?;
    if chunk.error.is_some() {
        return Err("gateway_stream_error".to_owned());
    }
    if chunk.choices.is_empty() && chunk.usage.is_none() {
        return Ok(Event::Other);
    }
    Ok(Event::Chunk {
        token: chunk
            .choices
            .iter()
            .any(|c| c.text.as_deref().is_some_and(|t| !t.is_empty())),
        chunk_usage: chunk.usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tell_tokens_usage_done_and_errors() {
        let token = parse_event(r#"{"choices":[{"index":0,"text":"a"}]}"#).unwrap();
        assert_eq!(
            token,
            Event::Chunk {
                token: true,
                chunk_usage: None
            }
        );
        // The last chunk may carry only the finish reason.
        let empty = parse_event(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#);
        assert_eq!(
            empty.unwrap(),
            Event::Chunk {
                token: false,
                chunk_usage: None
            }
        );
        let usage = parse_event(
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}"#,
        )
        .unwrap();
        let Event::Chunk {
            chunk_usage: Some(u),
            ..
        } = usage
        else {
            panic!("{usage:?}")
        };
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached()),
            (10, 3, 4)
        );
        assert_eq!(parse_event(" [DONE]").unwrap(), Event::Done);
        assert_eq!(
            parse_event(r#"{"error":{"message":"x"}}"#).unwrap_err(),
            "gateway_stream_error"
        );
        assert_eq!(parse_event("nope").unwrap_err(), "gateway_malformed_chunk");
    }

    #[test]
    fn prefix_cache_counters_sum_the_series() {
        let page = "# HELP vllm:prefix_cache_queries x\n\
            vllm:prefix_cache_queries_total{engine=\"0\"} 100.0\n\
            vllm:prefix_cache_queries_total{engine=\"1\"} 50.0\n\
            vllm:prefix_cache_queries_created{engine=\"0\"} 1.7e9\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 30.0\n";
        assert_eq!(prefix_cache_counters(page), Some((150, 30)));
        assert_eq!(prefix_cache_counters("up 1\n"), None);
    }
}
