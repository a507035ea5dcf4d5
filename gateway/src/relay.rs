//! One forwarded request from its decision to its end: the [`InFlight`] guard publishes the
//! lifecycle events (`prefill_done` at the first byte of the answer's body, `finished` when the
//! request ends however it ends — its `Drop` runs when the client disconnects too), records the
//! metrics and writes the access log line; [`relay`] streams the engine's answer through with
//! backpressure (a chunk is read from the engine only when the client took the last one), and
//! [`read_whole`] reads a whole answer. Both give the engine `--upstream-idle-timeout-ms` for
//! each next piece of the body.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use futures::StreamExt;
use kvroute_common::WorkerId;

use crate::app::App;
use crate::error::ApiError;
use crate::lifecycle::Placement;
use crate::request_id::RequestIds;

/// What the access log line and the request metrics say.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub endpoint: &'static str,
    /// The model asked for, once known to be served (else `unknown`, to bound label values).
    pub model: String,
    pub request_id: String,
    pub status: u16,
    pub worker: Option<WorkerId>,
    /// A disaggregated request's decode worker (`worker` did its prefill).
    pub decode_worker: Option<WorkerId>,
    pub prompt_tokens: usize,
    pub overlap_blocks: u32,
    /// Workers tried.
    pub attempts: u32,
    pub output_tokens: u64,
    pub error: Option<&'static str>,
}

impl Outcome {
    pub fn new(endpoint: &'static str, ids: &RequestIds) -> Self {
        Self {
            endpoint,
            model: "unknown".into(),
            request_id: ids.header.clone(),
            status: 0,
            worker: None,
            decode_worker: None,
            prompt_tokens: 0,
            overlap_blocks: 0,
            attempts: 0,
            output_tokens: 0,
            error: None,
        }
    }

    /// Counts the request and logs it.
    pub fn record(&self, app: &App, started: Instant, ttft: Option<Duration>) {
        let elapsed = started.elapsed();
        let status = self.status.to_string();
        app.metrics
            .requests
            .inc([self.endpoint, &self.model, &status]);
        if self.worker.is_some() {
            app.metrics.e2e.observe(&self.model, elapsed);
        }
        if app.settings.access_log {
            tracing::info!(
                target: "kvroute_gateway::access",
                request_id = self.request_id,
                endpoint = self.endpoint,
                model = self.model,
                status = self.status,
                worker = self.worker,
                decode_worker = self.decode_worker,
                prompt_tokens = self.prompt_tokens,
                overlap_blocks = self.overlap_blocks,
                attempts = self.attempts,
                output_tokens = self.output_tokens,
                ttft_ms = ttft.map(|d| d.as_secs_f64() * 1000.0),
                duration_ms = elapsed.as_secs_f64() * 1000.0,
                error = self.error,
                "request"
            );
        }
    }
}

/// A request placed on a worker, until it ends.
#[derive(Debug)]
pub struct InFlight {
    app: Arc<App>,
    placement: Placement,
    started: Instant,
    outcome: Outcome,
    streaming: bool,
    first: Option<Instant>,
    last: Option<Instant>,
    events: u64,
    usage_tokens: Option<u64>,
    /// The engine's `usage.prompt_tokens`, when its answer had one.
    engine_prompt_tokens: Option<u64>,
    saw_done: bool,
    /// An event set `finish_reason`: the last token went out.
    saw_finish: bool,
    /// `prefill_done` was published.
    prefill_done: bool,
    /// The stream's last line so far, not yet ended by a newline.
    partial: Vec<u8>,
    ended: bool,
    /// The attempt failed before reaching the client: only the lifecycle event is due.
    abandoned: bool,
}

impl InFlight {
    pub fn new(app: Arc<App>, placement: Placement, started: Instant, outcome: Outcome) -> Self {
        app.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        Self {
            app,
            placement,
            started,
            outcome,
            streaming: false,
            first: None,
            last: None,
            events: 0,
            usage_tokens: None,
            engine_prompt_tokens: None,
            saw_done: false,
            saw_finish: false,
            prefill_done: false,
            partial: Vec::new(),
            ended: false,
            abandoned: false,
        }
    }

    /// This attempt failed before the client saw anything (another may follow): release the
    /// decision, count why.
    pub fn abandon(mut self, reason: &'static str) {
        self.app.metrics.upstream_failures.inc([reason]);
        self.abandoned = true;
    }

    pub fn set_status(&mut self, status: u16) {
        self.outcome.status = status;
    }

    pub fn start_stream(&mut self) {
        self.streaming = true;
        self.app
            .metrics
            .streams_in_flight
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The first byte of a successful answer's body: the prompt is prefilled.
    pub fn body_started(&mut self) {
        if !self.prefill_done {
            self.prefill_done = true;
            self.app.lifecycle.prefill_done(self.placement);
        }
    }

    /// The answer failed after its headers, before anything reached the client: the client
    /// gets `status` (a 502 or 504 the caller builds); counted under `reason`.
    pub fn fail_before_client(&mut self, status: u16, reason: &'static str) {
        self.outcome.status = status;
        self.fail(reason);
    }

    /// A whole (non-streamed) answer arrived.
    pub fn finish_whole(&mut self, body: &[u8]) {
        let usage = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .map(|v| Usage::of(&v))
            .unwrap_or_default();
        self.outcome.output_tokens = usage.completion.unwrap_or(0);
        self.engine_prompt_tokens = usage.prompt;
        self.ended = true;
    }

    /// The engine counted other prompt tokens than the gateway sent it to the router with: the
    /// two tokenize differently, and every prompt's overlap is then 0 while the engine reports
    /// cached tokens. Counted per model, and logged (at warn the first time).
    fn check_prompt_tokens(&self) {
        let (Some(engine), gateway) = (self.engine_prompt_tokens, self.outcome.prompt_tokens)
        else {
            return;
        };
        if gateway == 0 || engine == gateway as u64 {
            return;
        }
        let metrics = &self.app.metrics;
        metrics
            .prompt_token_mismatches
            .inc([self.outcome.model.as_str()]);
        if !metrics.mismatch_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                model = self.outcome.model,
                worker = self.outcome.worker,
                gateway_prompt_tokens = gateway,
                engine_prompt_tokens = engine,
                "the engine counted other prompt tokens than the gateway: it tokenizes differently, so routing sees none of its cache; give the gateway the model folder the engine loads (kvroute_gateway_prompt_token_mismatches_total counts them)"
            );
        } else {
            tracing::debug!(
                model = self.outcome.model,
                gateway_prompt_tokens = gateway,
                engine_prompt_tokens = engine,
                "prompt token mismatch"
            );
        }
    }

    /// The answer is over with nothing to report: a stream that ended with `[DONE]`, or an
    /// engine's refusal (a 4xx) passed to the client as it is.
    pub fn fail_quietly(&mut self) {
        self.ended = true;
    }

    fn on_chunk(&mut self, chunk: &[u8]) {
        let now = Instant::now();
        match self.last {
            None => {
                self.first = Some(now);
                self.app
                    .metrics
                    .ttft
                    .observe(&self.outcome.model, now - self.started);
                self.body_started();
            }
            Some(last) => self
                .app
                .metrics
                .itl
                .observe(&self.outcome.model, now - last),
        }
        self.last = Some(now);
        let sse = scan_lines(&mut self.partial, chunk);
        self.events += sse.data_events;
        self.saw_done |= sse.done;
        self.saw_finish |= sse.finished;
        if let Some(n) = sse.completion_tokens {
            self.usage_tokens = Some(n);
        }
        if let Some(n) = sse.prompt_tokens {
            self.engine_prompt_tokens = Some(n);
        }
    }

    fn fail(&mut self, reason: &'static str) {
        if self.outcome.error.is_none() {
            self.outcome.error = Some(reason);
            self.app.metrics.upstream_failures.inc([reason]);
        }
        self.ended = true;
    }

    /// Output tokens: the usage chunk's count, else the content events (a chat's first event
    /// is its role).
    fn output_tokens(&self) -> u64 {
        if let Some(n) = self.usage_tokens {
            return n;
        }
        if self.streaming {
            let role = u64::from(self.outcome.endpoint == "chat");
            return self.events.saturating_sub(u64::from(self.saw_done) + role);
        }
        self.outcome.output_tokens
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let output = self.output_tokens();
        self.app.lifecycle.finished(self.placement, output);
        let metrics = &self.app.metrics;
        metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.streaming {
            metrics.streams_in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        if self.abandoned {
            return;
        }
        if !self.ended && self.outcome.error.is_none() && !self.saw_finish {
            // Dropped before the end: the client went away (axum dropped the body or the
            // handler), which also drops the engine connection, so the engine aborts. A
            // client that leaves after the last token (before `[DONE]`) got its answer: a
            // success.
            self.outcome.error = Some("client_gone");
            metrics.upstream_failures.inc(["client_gone"]);
        }
        self.outcome.output_tokens = output;
        self.check_prompt_tokens();
        let ttft = self.first.map(|f| f - self.started);
        self.outcome.record(&self.app, self.started, ttft);
    }
}

/// A partial line longer than this is dropped unscanned (an event line is far shorter).
const MAX_PARTIAL_LINE: usize = 1 << 20;
/// Chunks the engine already sent are relayed in one write, up to this many.
const COALESCE: usize = 64;

/// What one chunk of a server-sent-event stream holds.
#[derive(Debug, Default, PartialEq, Eq)]
struct SseScan {
    data_events: u64,
    done: bool,
    completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` of the usage chunk.
    prompt_tokens: Option<u64>,
    /// An event carried a choice's `finish_reason` (its last token).
    finished: bool,
}

impl SseScan {
    fn of(chunk: &[u8]) -> Self {
        let mut scan = Self::default();
        for line in chunk.split(|b| *b == b'\n') {
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            scan.data_events += 1;
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                scan.done = true;
            } else {
                scan.finished |= has_finish_reason(data);
                if let Some(usage) = usage_of_event(data) {
                    scan.completion_tokens = usage.completion.or(scan.completion_tokens);
                    scan.prompt_tokens = usage.prompt.or(scan.prompt_tokens);
                }
            }
        }
        scan
    }
}

/// Scans the whole lines of `partial` + `chunk` (lines may be split across reads), leaving the
/// unfinished last line in `partial`.
fn scan_lines(partial: &mut Vec<u8>, chunk: &[u8]) -> SseScan {
    let scan = match chunk.iter().rposition(|b| *b == b'\n') {
        None => {
            partial.extend_from_slice(chunk);
            SseScan::default()
        }
        Some(end) if partial.is_empty() => {
            let scan = SseScan::of(&chunk[..=end]);
            partial.extend_from_slice(&chunk[end + 1..]);
            scan
        }
        Some(end) => {
            let mut lines = std::mem::take(partial);
            lines.extend_from_slice(&chunk[..=end]);
            partial.extend_from_slice(&chunk[end + 1..]);
            SseScan::of(&lines)
        }
    };
    if partial.len() > MAX_PARTIAL_LINE {
        partial.clear(); // not an event-stream line worth scanning
    }
    scan
}

/// Whether an event's JSON sets a `finish_reason` (a string, not null): the answer's last
/// token has been sent.
fn has_finish_reason(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"finish_reason\":";
    let mut rest = data;
    while let Some(at) = rest.windows(KEY.len()).position(|w| w == KEY) {
        rest = &rest[at + KEY.len()..];
        if rest.trim_ascii_start().first() == Some(&b'"') {
            return true;
        }
    }
    false
}

/// An answer's `usage` counts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    prompt: Option<u64>,
    completion: Option<u64>,
}

impl Usage {
    fn of(v: &serde_json::Value) -> Self {
        Self {
            prompt: v["usage"]["prompt_tokens"].as_u64(),
            completion: v["usage"]["completion_tokens"].as_u64(),
        }
    }
}

/// The `usage` of a stream event that has one (the usage chunk of
/// `stream_options.include_usage`); parsed only when the bytes mention it.
fn usage_of_event(data: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    data.windows(KEY.len()).position(|w| w == KEY)?;
    let v: serde_json::Value = serde_json::from_slice(data).ok()?;
    let usage = Usage::of(&v);
    (usage != Usage::default()).then_some(usage)
}

/// Why a whole answer's body did not arrive.
#[derive(Debug)]
pub enum BodyError {
    /// Nothing came for `--upstream-idle-timeout-ms`.
    Idle,
    Broken(reqwest::Error),
}

/// The engine's whole (non-streamed) answer body, each piece of it awaited at most `idle`.
/// `on_body` runs at each piece of a successful answer (the first publishes `prefill_done`).
pub async fn read_whole(
    mut answer: reqwest::Response,
    idle: Duration,
    mut on_body: impl FnMut(),
) -> Result<Bytes, BodyError> {
    let success = answer.status().is_success();
    let mut body = bytes::BytesMut::new();
    loop {
        match tokio::time::timeout(idle, answer.chunk()).await {
            Err(_) => return Err(BodyError::Idle),
            Ok(Err(e)) => return Err(BodyError::Broken(e)),
            Ok(Ok(None)) => return Ok(body.freeze()),
            Ok(Ok(Some(chunk))) => {
                if success && !chunk.is_empty() {
                    on_body();
                }
                body.extend_from_slice(&chunk);
            }
        }
    }
}

/// The engine's streamed answer, relayed chunk by chunk. An engine error, an end without
/// `data: [DONE]`, or nothing from the engine for `idle` ends the stream with an error event,
/// never a hang.
pub fn relay(answer: reqwest::Response, guard: InFlight, idle: Duration) -> Body {
    struct State {
        upstream: futures::stream::BoxStream<'static, Vec<reqwest::Result<Bytes>>>,
        guard: InFlight,
        idle: Duration,
        over: bool,
    }
    let state = State {
        // What the engine already sent goes out in one write (with TCP_NODELAY on the client
        // side, one write per token would be one packet per token).
        upstream: answer.bytes_stream().ready_chunks(COALESCE).boxed(),
        guard,
        idle,
        over: false,
    };
    let stream = futures::stream::unfold(state, |mut s| async move {
        if s.over {
            return None;
        }
        let Ok(next) = tokio::time::timeout(s.idle, s.upstream.next()).await else {
            s.over = true;
            s.guard.fail("idle_timeout");
            let event = error_event(&ApiError::timeout(
                "upstream_timeout",
                format!(
                    "the worker sent nothing for {} ms in the middle of the stream",
                    s.idle.as_millis()
                ),
            ));
            return Some((Ok(event), s));
        };
        match next {
            Some(batch) => {
                let mut out = bytes::BytesMut::new();
                let mut failed = None;
                for item in batch {
                    match item {
                        Ok(chunk) => {
                            s.guard.on_chunk(&chunk);
                            out.extend_from_slice(&chunk);
                        }
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                if let Some(e) = failed {
                    s.over = true;
                    s.guard.fail("mid_stream");
                    out.extend_from_slice(&error_event(&ApiError::bad_gateway(format!(
                        "the worker failed mid-stream: {}",
                        kvroute_common::error_chain::describe(&e)
                    ))));
                }
                Some((Ok::<Bytes, Infallible>(out.freeze()), s))
            }
            None if s.guard.saw_done => {
                s.guard.fail_quietly(); // ended as it should; the guard's drop records it
                drop(s);
                None
            }
            None => {
                s.over = true;
                s.guard.fail("mid_stream");
                let event = error_event(&ApiError::bad_gateway(
                    "the worker ended the stream before the answer was complete",
                ));
                Some((Ok(event), s))
            }
        }
    });
    Body::from_stream(stream)
}

/// An OpenAI-style error as a server-sent event.
fn error_event(e: &ApiError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", e.body()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_chunks_are_counted() {
        let chunk =
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n";
        assert_eq!(
            SseScan::of(chunk),
            SseScan {
                data_events: 2,
                done: false,
                completion_tokens: None,
                prompt_tokens: None,
                finished: false
            }
        );
        let end = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":7}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            SseScan::of(end),
            SseScan {
                data_events: 2,
                done: true,
                completion_tokens: Some(7),
                prompt_tokens: Some(3),
                finished: false
            }
        );
        assert_eq!(SseScan::of(b": keep-alive\n\n"), SseScan::default());
        // vLLM's chunks carry `"usage": null` until the last when usage is continuous.
        let null = b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n";
        assert_eq!(SseScan::of(null).prompt_tokens, None);
        let last = b"data: {\"choices\":[{\"text\":\"z\",\"finish_reason\": \"stop\"}]}\n\n";
        assert!(SseScan::of(last).finished);
        let not_yet = b"data: {\"choices\":[{\"text\":\"z\",\"finish_reason\":null}]}\n\n";
        assert!(!SseScan::of(not_yet).finished);
    }

    #[test]
    fn lines_split_across_reads_are_scanned_whole() {
        let stream = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let (a, b) = stream.split_at(cut);
            let mut partial = Vec::new();
            let mut total = SseScan::default();
            for chunk in [a, b] {
                let scan = scan_lines(&mut partial, chunk);
                total.data_events += scan.data_events;
                total.done |= scan.done;
                total.completion_tokens = scan.completion_tokens.or(total.completion_tokens);
                total.finished |= scan.finished;
            }
            assert_eq!(
                total,
                SseScan {
                    data_events: 3,
                    done: true,
                    completion_tokens: Some(2),
                    prompt_tokens: None,
                    finished: false
                },
                "cut at {cut}"
            );
        }
    }
}
