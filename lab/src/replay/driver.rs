//! Drives one mode of a replay: every planned request, at its arrival time, goes to the
//! selector and then to the chosen worker; outcomes are recorded as they come back.
//!
//! Arrivals are simulated times; the driver sends at `start + arrival / speedup` of wall time.
//! A request that fails anywhere (selection refused, worker gone, timeout, error reply) is
//! counted by kind and the replay goes on. Once `stop` turns true, requests not yet sent are
//! counted as not sent and those already sent are waited for (up to their timeout).

use std::sync::Arc;
use std::time::Duration;

use async_nats::client::RequestErrorKind;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{GenerateRequest, GenerateResponse, SelectRequest};
use kvroute_common::trace::TraceRequest;
use kvroute_common::{Names, WorkerId};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::config::Mode;
use super::plan::Plan;
use super::report::{ModeRecorder, ModeReport, RequestSample};
use super::selector::Selector;
use super::sessions::session_context;

/// What a mode's run needs besides the plan and the selector.
#[derive(Debug, Clone)]
pub struct DriveSettings {
    pub mode: Mode,
    pub model: String,
    /// Simulated seconds per wall second of the fleet.
    pub speedup: f64,
    /// Wall time to wait for a worker's reply.
    pub request_timeout: Duration,
    /// The workers at the start (every one counts in the load spread, even if idle).
    pub workers: Vec<WorkerId>,
    /// Send a row's `session_id` as the request's `SessionContext`.
    pub send_sessions: bool,
    /// Put before every session id sent, so that this mode's sessions are new to the routers
    /// (their bindings outlive a mode: an earlier mode's would decide this one's placements).
    pub session_scope: String,
}

/// Running totals, for progress displays.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub total: u64,
    pub done: u64,
    pub errors: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl Tally {
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// How one request ended; `X`: what a driver records besides the sample.
#[derive(Debug)]
pub enum Outcome<X = ()> {
    Done {
        sample: RequestSample,
        /// Simulated time from the run's start to the last token.
        finished_at: Duration,
        /// Selection attempts beyond the first.
        retries: u32,
        extra: X,
    },
    Failed {
        kind: String,
    },
    /// The run was stopped before the request's arrival.
    NotSent,
}

/// Replays `plan` once through `selector`, until `stop` turns true; `progress` sees the totals
/// after every request.
pub async fn drive<S: Selector>(
    plan: &Plan,
    settings: &DriveSettings,
    selector: Arc<S>,
    nats: async_nats::Client,
    names: &Names,
    stop: &watch::Receiver<bool>,
    progress: impl FnMut(&Tally),
) -> ModeReport {
    let mut recorder = ModeRecorder::new(settings.mode.as_str(), settings.workers.clone())
        .with_sessions(plan.sessions.clone(), settings.send_sessions);
    let duration = schedule(
        plan,
        settings.speedup,
        stop,
        &mut recorder,
        progress,
        |_, ()| {},
        |request, start| {
            RequestTask {
                request,
                trace: plan.requests[request].clone(),
                settings: settings.clone(),
                selector: selector.clone(),
                nats: nats.clone(),
                names: names.clone(),
                start,
            }
            .run()
        },
    )
    .await;
    recorder.finish(duration)
}

/// Runs `task(request, start)` for every request of `plan` at its arrival (`start + arrival /
/// speedup` of wall time) until `stop` turns true, records each outcome in `recorder` (a
/// completed request's extra goes to `on_done`), and returns the simulated time from the start
/// to the last completion.
pub async fn schedule<X, Fut>(
    plan: &Plan,
    speedup: f64,
    stop: &watch::Receiver<bool>,
    recorder: &mut ModeRecorder,
    mut progress: impl FnMut(&Tally),
    mut on_done: impl FnMut(&mut ModeRecorder, X),
    task: impl Fn(usize, Instant) -> Fut,
) -> Duration
where
    X: Send + 'static,
    Fut: Future<Output = Outcome<X>> + Send + 'static,
{
    let (tx, mut rx) = mpsc::unbounded_channel();
    // A short lead so the first requests are not late while the rest are being scheduled.
    let start = Instant::now() + Duration::from_millis(20);
    for (request, arrival) in plan.arrivals.iter().enumerate() {
        let run = task(request, start);
        let at = start + arrival.div_f64(speedup);
        let tx = tx.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                biased;
                () = stopped(stop) => {
                    let _ = tx.send(Outcome::NotSent);
                }
                () = tokio::time::sleep_until(at) => {
                    let _ = tx.send(run.await);
                }
            }
        });
    }
    drop(tx);
    let mut tally = Tally {
        total: plan.len() as u64,
        ..Tally::default()
    };
    let mut duration = Duration::ZERO;
    while let Some(outcome) = rx.recv().await {
        match outcome {
            Outcome::Done {
                sample,
                finished_at,
                retries,
                extra,
            } => {
                recorder.record_selection_retries(retries);
                tally.done += 1;
                tally.prompt_tokens += sample.prompt_tokens;
                tally.cached_tokens += sample.cached_tokens;
                duration = duration.max(finished_at);
                recorder.record(sample);
                on_done(recorder, extra);
            }
            Outcome::Failed { kind } => {
                tally.errors += 1;
                recorder.record_error(&kind);
            }
            Outcome::NotSent => recorder.record_not_sent(),
        }
        progress(&tally);
    }
    duration
}

/// Resolves once `stop` turns true; never, if its sender is gone first (the run's owner no
/// longer able to stop it).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let closed = stop.wait_for(|stopped| *stopped).await.is_err();
    if closed {
        std::future::pending::<()>().await;
    }
}

struct RequestTask<S> {
    /// The request's index in the plan.
    request: usize,
    trace: TraceRequest,
    settings: DriveSettings,
    selector: Arc<S>,
    nats: async_nats::Client,
    names: Names,
    start: Instant,
}

impl<S: Selector> RequestTask<S> {
    async fn run(self) -> Outcome {
        match self.attempt().await {
            Ok(outcome) => outcome,
            Err(kind) => {
                tracing::debug!(kind, "request failed");
                Outcome::Failed { kind }
            }
        }
    }

    async fn attempt(&self) -> Result<Outcome, String> {
        let tokens = self.trace.tokens();
        let output = self.trace.output_length;
        let select = SelectRequest {
            request_id: Some(uuid::Uuid::new_v4()),
            model: self.settings.model.clone(),
            token_ids: Some(tokens.clone()),
            lora_name: self.trace.lora_name.clone(),
            expected_output_tokens: Some(output),
            policy: self.settings.mode.router_policy().map(str::to_owned),
            session: if self.settings.send_sessions {
                session_context(&self.trace, &self.settings.session_scope)
            } else {
                None
            },
            ..SelectRequest::default()
        };
        let asked = Instant::now();
        let selected = self.selector.select(select).await.map_err(|e| e.kind())?;
        let selection_latency = asked.elapsed();
        let reply = selected.reply;
        let subject = if reply.request_subject.is_empty() {
            self.names.worker_requests(reply.worker_id)
        } else {
            reply.request_subject.clone()
        };
        let generate = GenerateRequest {
            request_id: reply.request_id,
            token_ids: Some(tokens),
            lora_name: self.trace.lora_name.clone(),
            max_tokens: output,
            dp_rank: Some(reply.dp_rank),
            decision_id: Some(reply.decision_id),
            ..GenerateRequest::default()
        };
        let payload = encode(&generate).map_err(|_| "worker_too_large".to_owned());
        let sent = Instant::now();
        let answer = match payload {
            Ok(payload) => {
                let req = async_nats::Request::new()
                    .payload(payload)
                    .timeout(Some(self.settings.request_timeout));
                self.nats
                    .send_request(subject, req)
                    .await
                    .map_err(|e| match e.kind() {
                        RequestErrorKind::NoResponders => "worker_unreachable".to_owned(),
                        RequestErrorKind::TimedOut => "worker_timeout".to_owned(),
                        RequestErrorKind::MaxPayloadExceeded => "worker_too_large".to_owned(),
                        _ => "worker_transport".to_owned(),
                    })
            }
            Err(e) => Err(e),
        };
        self.selector.finished(&reply);
        let msg = answer?;
        match decode::<GenerateResponse>(&msg.payload) {
            Ok(GenerateResponse::Ok(r)) => {
                let latency = Duration::from_secs_f64(r.latency_ms.max(0.0) / 1e3);
                let sent_sim = sent
                    .saturating_duration_since(self.start)
                    .mul_f64(self.settings.speedup);
                Ok(Outcome::Done {
                    sample: RequestSample {
                        request: self.request,
                        worker_id: r.worker_id,
                        prompt_tokens: r.prompt_tokens,
                        cached_tokens: r.cached_tokens,
                        output_tokens: r.output_tokens,
                        ttft: Duration::from_secs_f64(r.ttft_ms.max(0.0) / 1e3),
                        latency,
                        selection_latency: Some(selection_latency),
                        selection_wait: selection_latency.mul_f64(self.settings.speedup),
                    },
                    finished_at: sent_sim + latency,
                    retries: selected.attempts.saturating_sub(1),
                    extra: (),
                })
            }
            Ok(GenerateResponse::Error(e)) => Err(format!("worker_{}", e.code.as_str())),
            Err(_) => Err("worker_malformed".to_owned()),
        }
    }
}
