//! A disaggregated request's two hops: the prompt is prefilled on the prefill worker of the
//! routers' paired decision, its KV cache moves to the decode worker, and the answer streams
//! from the decode worker. The hand-off speaks each engine's own protocol, chosen by the prefill
//! worker's engine (its card's `kvroute.bridge/engine` label):
//!
//! - **vLLM** (a KV connector such as NIXL): the prefill request carries `kv_transfer_params`
//!   with `do_remote_decode: true`, `stream: false` and `max_tokens: 1`; its answer's
//!   `kv_transfer_params` (the remote engine, blocks, host and port) go with the client's
//!   request to the decode worker, which pulls the blocks before it decodes.
//! - **SGLang**: both workers get the client's request at once with the prefill server's
//!   `bootstrap_host`, `bootstrap_port` (its card's `kvroute.bridge/bootstrap-port` label) and
//!   the decision's `bootstrap_room`; the decode server waits for the room's KV.
//!
//! A prefill that fails before the hand-off (no connection, a 5xx, no or incomplete transfer
//! parameters) is retried on another prefill worker; a decode that fails before its first byte
//! is retried on another pair without either worker (a failed KV transfer may be the prefill
//! worker's fault: it may have died after answering); the second failure is the client's 502. Each hop has its own lifecycle events: the prefill worker's
//! `prefill_done` at its answer's first byte and `finished` when its answer is read (or its
//! hop is given up), the decode worker's as for any forwarded request.

use std::sync::Arc;

use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use kvroute_common::WorkerId;
use kvroute_common::error_chain::describe;
use kvroute_common::messages::{DecodeHop, SelectReply};
use serde_json::{Map, Value, json};

use crate::app::App;
use crate::directory::Upstream;
use crate::error::ApiError;
use crate::lifecycle::Placement;
use crate::proxy::{
    Ctx, SendError, Step, failed_answer, gone, no_answer, respond, retry, send, upstream_body,
};
use crate::relay::{BodyError, InFlight, Outcome, read_whole};
use crate::request_id::RequestIds;

/// Answer headers naming the decode hop (`x-kvroute-worker-id` names the prefill worker).
pub const DECODE_WORKER_HEADER: &str = "x-kvroute-decode-worker-id";
pub const DECODE_DECISION_HEADER: &str = "x-kvroute-decode-decision-id";
/// SGLang's default `--disaggregation-bootstrap-port`, for a prefill card without the label.
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// The hand-off protocol (the metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Vllm,
    Sglang,
}

impl Protocol {
    fn of(prefill: &Upstream) -> Self {
        match prefill.engine.as_str() {
            "sglang" => Protocol::Sglang,
            _ => Protocol::Vllm,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }
}

/// Serves `reply`'s request on its prefill worker and `hop`'s decode worker.
pub(crate) async fn run(
    ctx: &Ctx<'_>,
    outcome: &Outcome,
    reply: &SelectReply,
    hop: &DecodeHop,
) -> Step {
    let app = ctx.app;
    let decode_at = Placement {
        request_id: reply.request_id,
        worker_id: hop.worker_id,
        dp_rank: hop.dp_rank,
    };
    let prefill_hop = PrefillHop::new(
        app.clone(),
        Placement {
            request_id: reply.request_id,
            worker_id: reply.worker_id,
            dp_rank: reply.dp_rank,
        },
    );
    let guard = InFlight::new(app.clone(), decode_at, ctx.started, outcome.clone());
    let Some(prefill) = app.directory.upstream(reply.worker_id) else {
        return gone(guard, reply.worker_id);
    };
    let Some(decode) = app.directory.upstream(hop.worker_id) else {
        return gone(guard, hop.worker_id);
    };
    let protocol = Protocol::of(&prefill);
    if Protocol::of(&decode) != protocol {
        guard.abandon("handoff_mismatch");
        return Step::Fail(ApiError::bad_gateway(format!(
            "the prefill worker {} is {} and the decode worker {} is {}: no KV hand-off \
             between them (register each model's prefill and decode workers with one engine)",
            reply.worker_id,
            label(&prefill),
            hop.worker_id,
            label(&decode)
        )));
    }
    let pair = Pair {
        ctx,
        reply,
        hop,
        prefill,
        decode,
    };
    let step = match protocol {
        Protocol::Vllm => pair.vllm(prefill_hop, guard).await,
        Protocol::Sglang => pair.sglang(prefill_hop, guard).await,
    };
    let result = match &step {
        Step::Done(_) => "ok",
        Step::Retry { worker, .. } if *worker == reply.worker_id => "prefill_failed",
        Step::Retry { .. } => "decode_failed",
        Step::Fail(_) => "failed",
    };
    app.metrics.handoffs.inc([protocol.label(), result]);
    match step {
        Step::Done(mut response) => {
            let h = response.headers_mut();
            h.insert(DECODE_WORKER_HEADER, HeaderValue::from(hop.worker_id));
            if let Ok(v) = HeaderValue::from_str(&hop.decision_id.to_string()) {
                h.insert(DECODE_DECISION_HEADER, v);
            }
            Step::Done(response)
        }
        other => other,
    }
}

fn label(u: &Upstream) -> &str {
    if u.engine.is_empty() {
        "of no known engine"
    } else {
        &u.engine
    }
}

/// The two workers of one attempt.
struct Pair<'a> {
    ctx: &'a Ctx<'a>,
    reply: &'a SelectReply,
    hop: &'a DecodeHop,
    prefill: Upstream,
    decode: Upstream,
}

/// How the prefill hop ended, when not with its answer.
enum PrefillFailure {
    /// Try another prefill worker: `error` if none takes it.
    Retry {
        reason: &'static str,
        error: ApiError,
    },
    /// The engine refused the request (a 4xx): the client gets its answer.
    Refused(Box<Response>),
    Fail(ApiError),
}

impl Pair<'_> {
    /// vLLM: prefill (one token, not streamed) first, then the decode with the prefill's
    /// `kv_transfer_params`.
    async fn vllm(&self, mut prefill_hop: PrefillHop, guard: InFlight) -> Step {
        let app = self.ctx.app;
        let body = upstream_body(
            self.ctx,
            &self.prefill,
            self.reply.dp_rank,
            Some(&vllm_prefill_edit),
        );
        let params = match body {
            Err(e) => Err(PrefillFailure::Fail(e)),
            Ok(body) => self
                .run_prefill(body, &mut prefill_hop)
                .await
                .and_then(|answer| transfer_params(self.reply.worker_id, &answer)),
        };
        let params = match params {
            Ok(params) => params,
            Err(failure) => return self.prefill_failed(failure, guard),
        };
        drop(prefill_hop); // its answer is read: the prefill worker is done with the request
        let edit = move |body: &mut Map<String, Value>| {
            body.insert("kv_transfer_params".into(), params.clone());
        };
        let body = match upstream_body(self.ctx, &self.decode, self.hop.dp_rank, Some(&edit)) {
            Ok(body) => body,
            Err(e) => {
                guard.abandon("body");
                return Step::Fail(e);
            }
        };
        let answer = send(
            app,
            self.ctx.api,
            &self.decode,
            self.ctx.ids,
            self.hop.dp_rank,
            body,
        )
        .await;
        self.decode_answered(answer, guard).await
    }

    /// SGLang: both hops at once, each with the prefill server's bootstrap address and the
    /// room; the answer streams from the decode server. A prefill that fails before the
    /// decode answers ends the attempt (the decode, waiting for the room, is dropped); one
    /// that fails later shows in the decode's answer.
    async fn sglang(&self, prefill_hop: PrefillHop, guard: InFlight) -> Step {
        let app = self.ctx.app;
        let host = self.prefill.host().to_owned();
        let port = self.prefill.bootstrap_port.unwrap_or(SGLANG_BOOTSTRAP_PORT);
        let room = self.hop.bootstrap_room;
        let bootstrap = move |body: &mut Map<String, Value>| {
            body.insert("bootstrap_host".into(), json!(host));
            body.insert("bootstrap_port".into(), json!(port));
            body.insert("bootstrap_room".into(), json!(room));
        };
        let prefill_edit = |body: &mut Map<String, Value>| {
            bootstrap(body);
            body.insert("stream".into(), Value::Bool(false));
            body.remove("stream_options");
        };
        let bodies = (
            upstream_body(
                self.ctx,
                &self.prefill,
                self.reply.dp_rank,
                Some(&prefill_edit),
            ),
            upstream_body(self.ctx, &self.decode, self.hop.dp_rank, Some(&bootstrap)),
        );
        let (prefill_body, decode_body) = match bodies {
            (Ok(p), Ok(d)) => (p, d),
            (Err(e), _) | (_, Err(e)) => {
                guard.abandon("body");
                return Step::Fail(e);
            }
        };
        let prefill = {
            let pair = Prefill {
                app: app.clone(),
                api: self.ctx.api,
                upstream: self.prefill.clone(),
                ids: self.ctx.ids.clone(),
                dp_rank: self.reply.dp_rank,
                worker: self.reply.worker_id,
            };
            let mut hop = prefill_hop;
            tokio::spawn(async move { pair.run(prefill_body, &mut hop).await.map(drop) })
        };
        let decode = send(
            app,
            self.ctx.api,
            &self.decode,
            self.ctx.ids,
            self.hop.dp_rank,
            decode_body,
        );
        tokio::pin!(decode);
        let mut prefill = Some(prefill);
        let answer = loop {
            let Some(task) = prefill.as_mut() else {
                break decode.await;
            };
            tokio::select! {
                answer = &mut decode => break answer,
                done = task => {
                    prefill = None;
                    match done {
                        Ok(Ok(())) => continue, // prefilled; the decode is pulling
                        Ok(Err(failure)) => return self.prefill_failed(failure, guard),
                        Err(e) => return self.prefill_failed(
                            PrefillFailure::Fail(ApiError::internal(format!("the prefill hop: {e}"))),
                            guard,
                        ),
                    }
                }
            }
        };
        let answered = matches!(&answer, Ok(a) if a.status().is_success());
        if let Some(task) = prefill
            && !answered
        {
            // The decode failed: its prefill is of no use (dropping the connection aborts it).
            task.abort();
        }
        self.decode_answered(answer, guard).await
    }

    async fn run_prefill(
        &self,
        body: Bytes,
        hop: &mut PrefillHop,
    ) -> Result<Bytes, PrefillFailure> {
        let p = Prefill {
            app: self.ctx.app.clone(),
            api: self.ctx.api,
            upstream: self.prefill.clone(),
            ids: self.ctx.ids.clone(),
            dp_rank: self.reply.dp_rank,
            worker: self.reply.worker_id,
        };
        p.run(body, hop).await
    }

    /// The prefill hop failed before the hand-off: the decode's charge goes too.
    fn prefill_failed(&self, failure: PrefillFailure, guard: InFlight) -> Step {
        let app = self.ctx.app;
        match failure {
            PrefillFailure::Retry { reason, error } => {
                retry(guard, self.reply.worker_id, reason, error, app)
            }
            PrefillFailure::Refused(response) => {
                guard.abandon("prefill_refused");
                Step::Done(*response)
            }
            PrefillFailure::Fail(e) => {
                guard.abandon("prefill_failed");
                Step::Fail(e)
            }
        }
    }

    /// A decode's retry goes to another prefill worker too.
    fn decode_retry(&self, step: Step) -> Step {
        match step {
            Step::Retry { worker, error, .. } => Step::Retry {
                worker,
                also: Some(self.reply.worker_id),
                error,
            },
            other => other,
        }
    }

    /// The decode worker's answer to the client; a failure before its first byte is retried.
    async fn decode_answered(
        &self,
        answer: Result<reqwest::Response, SendError>,
        guard: InFlight,
    ) -> Step {
        let app = self.ctx.app;
        let worker = self.hop.worker_id;
        match answer {
            Ok(answer) if answer.status().is_server_error() => {
                let error = failed_answer(worker, answer).await;
                self.decode_retry(retry(guard, worker, "decode_5xx", error, app))
            }
            Ok(answer) => Step::Done(respond(app, answer, guard, self.reply).await),
            Err(SendError::Timeout) => {
                guard.abandon("timeout");
                Step::Fail(no_answer(app, worker))
            }
            Err(SendError::Retryable { reason, message }) => {
                let error = ApiError::bad_gateway(format!(
                    "decode worker {worker} ({}) failed: {message}",
                    self.decode.base_url
                ));
                self.decode_retry(retry(guard, worker, reason, error, app))
            }
        }
    }
}

/// The prefill hop's request, owned (SGLang's runs in a task of its own).
struct Prefill {
    app: Arc<App>,
    api: crate::openai::Api,
    upstream: Upstream,
    ids: RequestIds,
    dp_rank: u32,
    worker: WorkerId,
}

impl Prefill {
    /// Sends the prefill request and reads its whole answer.
    async fn run(self, body: Bytes, hop: &mut PrefillHop) -> Result<Bytes, PrefillFailure> {
        let app = &self.app;
        let answer = match send(app, self.api, &self.upstream, &self.ids, self.dp_rank, body).await
        {
            Ok(answer) => answer,
            Err(SendError::Timeout) => {
                return Err(PrefillFailure::Fail(no_answer(app, self.worker)));
            }
            Err(SendError::Retryable { reason, message }) => {
                return Err(PrefillFailure::Retry {
                    reason,
                    error: ApiError::bad_gateway(format!(
                        "prefill worker {} ({}) failed: {message}",
                        self.worker, self.upstream.base_url
                    )),
                });
            }
        };
        let status = answer.status();
        if status.is_server_error() {
            return Err(PrefillFailure::Retry {
                reason: "prefill_5xx",
                error: failed_answer(self.worker, answer).await,
            });
        }
        let content_type = answer.headers().get(reqwest::header::CONTENT_TYPE).cloned();
        let idle = app.settings.upstream_idle_timeout;
        let body = match read_whole(answer, idle, || hop.prefilled()).await {
            Ok(body) => body,
            Err(BodyError::Idle) => {
                return Err(PrefillFailure::Fail(ApiError::timeout(
                    "upstream_timeout",
                    format!(
                        "prefill worker {} sent nothing for {} ms in the middle of its answer",
                        self.worker,
                        idle.as_millis()
                    ),
                )));
            }
            Err(BodyError::Broken(e)) => {
                return Err(PrefillFailure::Retry {
                    reason: "prefill_broken",
                    error: ApiError::bad_gateway(format!(
                        "prefill worker {} failed while answering: {}",
                        self.worker,
                        describe(&e)
                    )),
                });
            }
        };
        if !status.is_success() {
            // The engine refused the request itself (bad parameters, too long): as it said.
            let mut response = Response::new(axum::body::Body::from(body));
            *response.status_mut() =
                StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            if let Some(ct) = content_type {
                response
                    .headers_mut()
                    .insert(axum::http::header::CONTENT_TYPE, ct);
            }
            return Err(PrefillFailure::Refused(Box::new(response)));
        }
        Ok(body)
    }
}

/// vLLM's prefill request: the KV is kept for a remote decode, one token, not streamed.
fn vllm_prefill_edit(body: &mut Map<String, Value>) {
    body.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    body.insert("stream".into(), Value::Bool(false));
    body.remove("stream_options");
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
}

/// The `kv_transfer_params` of a vLLM prefill answer, as the decode request carries them:
/// `do_remote_prefill: true` and where the blocks are (`remote_engine_id`, `remote_block_ids`,
/// `remote_host`, `remote_port`), so a decode worker never gets parameters it cannot pull with.
fn transfer_params(worker: WorkerId, answer: &[u8]) -> Result<Value, PrefillFailure> {
    let params = serde_json::from_slice::<Value>(answer)
        .ok()
        .and_then(|v| v.get("kv_transfer_params").cloned())
        .filter(|p| {
            p.get("do_remote_prefill").and_then(Value::as_bool) == Some(true)
                && p.get("remote_engine_id").is_some_and(Value::is_string)
                && p.get("remote_host").is_some_and(Value::is_string)
                && p.get("remote_port").is_some_and(Value::is_u64)
                && p.get("remote_block_ids").is_some_and(Value::is_array)
        });
    params.ok_or_else(|| PrefillFailure::Retry {
        reason: "no_transfer_params",
        error: ApiError::bad_gateway(format!(
            "prefill worker {worker} answered without complete kv_transfer_params for a \
             remote decode (do_remote_prefill: true, remote_engine_id, remote_block_ids, \
             remote_host, remote_port; is the engine started with a KV connector whose kv_role \
             is kv_producer or kv_both?)"
        )),
    })
}

/// The prefill hop's lifecycle: `prefill_done` at its answer's first byte, `finished` when
/// dropped (its answer read, or the hop given up).
struct PrefillHop {
    app: Arc<App>,
    placement: Placement,
    prefilled: bool,
}

impl PrefillHop {
    fn new(app: Arc<App>, placement: Placement) -> Self {
        Self {
            app,
            placement,
            prefilled: false,
        }
    }

    fn prefilled(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            self.app.lifecycle.prefill_done(self.placement);
        }
    }
}

impl Drop for PrefillHop {
    fn drop(&mut self) {
        self.app
            .lifecycle
            .finished(self.placement, u64::from(self.prefilled));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vllm_prefill_keeps_its_kv_for_the_decode_and_makes_one_token() {
        let mut body: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "prompt": "hi", "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 50,
            "max_completion_tokens": 50,
        }))
        .unwrap();
        vllm_prefill_edit(&mut body);
        assert_eq!(body["stream"], false);
        assert!(!body.contains_key("stream_options"));
        assert_eq!(
            (&body["max_tokens"], &body["max_completion_tokens"]),
            (&json!(1), &json!(1))
        );
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(body["kv_transfer_params"]["do_remote_prefill"], false);
    }

    #[test]
    fn only_a_prefill_answer_with_remote_prefill_params_hands_off() {
        let ok = br#"{"choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1,2]],"remote_host":"h","remote_port":5600,"remote_request_id":"r"}}"#;
        let params = transfer_params(1, ok).ok().unwrap();
        assert_eq!(params["remote_port"], 5600);
        for bad in [
            &br#"{"choices":[]}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":{"do_remote_prefill":false}}"#,
            br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1]],"remote_host":"h"}}"#,
            br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":null,"remote_block_ids":[[1]],"remote_host":"h","remote_port":1}}"#,
            b"not json",
        ] {
            assert!(matches!(
                transfer_params(1, bad),
                Err(PrefillFailure::Retry {
                    reason: "no_transfer_params",
                    ..
                })
            ));
        }
    }
}
