//! One selection request through the service: intake checks → the model's candidates →
//! overlap and load signals (only the groups the policy declared) → the core's `select`
//! (session lookup, eligibility, policy, binding commit) → reply, then the decision is
//! applied locally and published.
//!
//! A request past its deadline is dropped (no reply, no decision, no load): its client has
//! retried. A request whose id already has a decision (a retry, answered by this replica or
//! by another) gets that decision again.

use std::time::Instant;

use kvroute_common::messages::{Decision, ErrorCode, SelectRequest, SelectResponse, now_ms};
use uuid::Uuid;

use super::intake::{self, Prompt, Rejected};
use super::load_view::Applied;
use super::reply;
use super::{PolicySlot, Router};
use crate::eligibility::EligibilityError;
use crate::pipeline::WorkerInputs;
use crate::registry::ConfigError;
use crate::select::{SelectFailure, SelectInput, select};
use crate::signals::SignalSnapshot;

/// What became of one request message (lives for one request: not worth a box).
#[allow(clippy::large_enum_variant)]
enum Outcome {
    /// Answer with this, and publish the decision if one was made.
    Answer(SelectResponse, Option<Decision>),
    /// Past its deadline when picked up (`intake`), when its turn on the policy came
    /// (`queued`) or once selected (`selected`, before any charge): dropped unanswered.
    Expired(&'static str),
}

fn expired(request: &SelectRequest) -> bool {
    request.deadline_ms.is_some_and(|d| now_ms() > d)
}

impl Router {
    /// Answers one request message: every request gets a reply (ok or error with a code),
    /// except one past its deadline, which nobody waits for any more.
    pub(super) async fn handle(&self, msg: async_nats::Message) {
        let started = Instant::now();
        let Some(inbox) = msg.reply.clone() else {
            self.metrics.bad_messages.inc("select_no_reply_subject");
            return;
        };
        let (response, decision) = match self.respond(&msg.payload).await {
            Outcome::Answer(response, decision) => (response, decision),
            Outcome::Expired(stage) => {
                self.metrics.expired.inc(stage);
                return;
            }
        };
        if let SelectResponse::Error(e) = &response {
            self.metrics.errors.inc(e.code.as_str());
            tracing::debug!(request_id = ?e.request_id, code = e.code.as_str(), message = e.message, "selection failed");
        }
        // The decision goes out first: a client's next request, answered by another replica,
        // then finds it already on that replica's connection.
        if let Some(decision) = decision {
            reply::publish_decision(&self.nats, &self.decisions_subject, &decision).await;
        }
        reply::send(&self.nats, inbox, &response).await;
        self.metrics
            .selection_latency
            .observe(started.elapsed().as_secs_f64());
    }

    async fn respond(&self, payload: &[u8]) -> Outcome {
        let request = match intake::parse(payload) {
            Ok(r) => r,
            Err(Rejected { code, message }) => {
                return Outcome::Answer(reply::error(code, message, None), None);
            }
        };
        if request.attempt > 0 {
            self.metrics.retries_received.inc();
        }
        if expired(&request) {
            tracing::debug!(request_id = ?request.request_id, attempt = request.attempt, "dropped a request past its deadline");
            return Outcome::Expired("intake");
        }
        let request_id = request.request_id.unwrap_or_else(Uuid::new_v4);
        match self.choose(&request, request_id).await {
            Ok(outcome) => outcome,
            Err(response) => Outcome::Answer(response, None),
        }
    }

    async fn choose(
        &self,
        request: &SelectRequest,
        request_id: Uuid,
    ) -> Result<Outcome, SelectResponse> {
        let fail = |f: SelectFailure| SelectResponse::Error(f.to_select_error(Some(request_id)));
        let reject = |r: Rejected| reply::error(r.code, r.message, Some(request_id));
        if !self.is_ready() {
            return Err(reply::error(
                ErrorCode::Unavailable,
                format!("router {} is not ready yet", self.router_id),
                Some(request_id),
            ));
        }
        let partition = self
            .candidates
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .partition(&request.model, request.role);
        let Some(partition) = partition else {
            return Err(fail(SelectFailure::Eligibility(
                EligibilityError::NoWorkers {
                    model: request.model.clone(),
                    role: request.role,
                },
            )));
        };
        let prompt = intake::prompt(request, &partition).map_err(reject)?;
        let slot = self
            .policies
            .slot(
                request.role,
                &request.model,
                request.policy.as_deref(),
                &self.host,
            )
            .map_err(|e| {
                // A type that cannot run without parameters is the request's mistake.
                let code = match e {
                    ConfigError::NeedsParameters { .. } => ErrorCode::BadRequest,
                    _ => ErrorCode::Unavailable,
                };
                reply::error(code, e.to_string(), Some(request_id))
            })?
            .ok_or_else(|| {
                reply::error(
                    ErrorCode::BadRequest,
                    format!(
                        "unknown policy {:?}: name a configured instance or a registered type",
                        request.policy.as_deref().unwrap_or_default()
                    ),
                    Some(request_id),
                )
            })?;
        let overlap = self.overlap_signals(request, &prompt, &slot).await;
        let subject_of = |d: &Decision| {
            partition
                .cards
                .iter()
                .find(|c| c.worker_id == d.worker_id)
                .map_or_else(
                    || self.names.worker_requests(d.worker_id),
                    |c| c.request_subject.clone(),
                )
        };
        // Reading the load view, selecting and charging the decision to the view happen under
        // the partition's policy lock: concurrent selections (a burst of requests) each see
        // the ones before them, instead of all picking the same least-loaded worker.
        let (selection, decision) = {
            let mut guard = slot.state.lock().await;
            let state = &mut *guard;
            if let Some(known) = self.lock_load().decided(&request_id).cloned() {
                self.metrics.repeated.inc();
                let reply = reply::from_decision(&known, subject_of(&known));
                return Ok(Outcome::Answer(SelectResponse::Ok(reply), None));
            }
            if expired(request) {
                return Ok(Outcome::Expired("queued"));
            }
            let signals = self.load_signals(overlap, &partition.cards, &slot);
            let input = SelectInput {
                request,
                request_blocks: prompt.blocks(),
                block_size: partition.block_size,
                workers: &partition.cards,
                signals: &signals,
                host: &self.host,
            };
            let selection = select(
                &input,
                &mut state.policy,
                &self.sessions,
                now_ms(),
                &mut state.rng,
            )
            .await
            .map_err(fail)?;
            // The session round trips may have taken the rest of the deadline (or the process
            // was stopped mid-selection): nobody would use this decision.
            if expired(request) {
                return Ok(Outcome::Expired("selected"));
            }
            let decision = reply::decision(
                request,
                request_id,
                Uuid::new_v4(),
                &selection,
                &prompt,
                partition.block_size,
                &self.router_id,
            );
            let mut view = self.lock_load();
            match view.apply_decision(&decision, now_ms()) {
                Applied::Added | Applied::Replaced | Applied::AlreadyCounted => {
                    self.metrics.decisions_applied.inc()
                }
                Applied::Duplicate => {}
                Applied::Superseded => {
                    // Another replica's decision for this request arrived meanwhile and wins
                    // (a later attempt): answer with it, so the client uses the charged one.
                    self.metrics.decisions_superseded.inc();
                    if let Some(winner) = view.decided(&request_id).cloned() {
                        drop(view);
                        let reply = reply::from_decision(&winner, subject_of(&winner));
                        return Ok(Outcome::Answer(SelectResponse::Ok(reply), None));
                    }
                }
            }
            (selection, decision)
        };
        let decision_id = decision.decision_id;
        let m = &self.metrics;
        m.decisions.inc(&selection.worker.to_string());
        m.request_blocks.add(u64::from(prompt.blocks()));
        m.overlap_blocks.add(u64::from(decision.overlap_blocks));
        if let Some(binding) = selection.binding {
            m.sessions.inc(binding.as_str());
        }
        tracing::debug!(
            %request_id,
            worker_id = selection.worker.worker_id,
            dp_rank = selection.worker.dp_rank,
            overlap_blocks = decision.overlap_blocks,
            cost = selection.cost.total,
            policy = selection.policy,
            binding = ?selection.binding,
            attempt = request.attempt,
            "selected"
        );
        let reply = selection.to_reply(request_id, decision_id, prompt.blocks(), &self.router_id);
        Ok(Outcome::Answer(SelectResponse::Ok(reply), Some(decision)))
    }

    /// The prompt's overlap per rank, when the policy reads `CACHE`.
    async fn overlap_signals(
        &self,
        request: &SelectRequest,
        prompt: &Prompt,
        slot: &PolicySlot,
    ) -> SignalSnapshot {
        let mut signals = SignalSnapshot::new();
        if slot.inputs.contains(WorkerInputs::CACHE) && !prompt.hashes.is_empty() {
            let started = Instant::now();
            match self.overlap.matches(&request.model, &prompt.hashes).await {
                Ok(found) => {
                    if found.attempts > 1 {
                        self.metrics
                            .overlap_retries
                            .add(u64::from(found.attempts - 1));
                    }
                    signals = SignalSnapshot::from_matches(&found.matches);
                }
                Err(fallback) => {
                    self.metrics.overlap_fallbacks.inc(fallback.reason());
                    tracing::debug!(
                        reason = fallback.reason(),
                        "no overlap available; scoring on load alone"
                    );
                }
            }
            self.metrics
                .overlap_latency
                .observe(started.elapsed().as_secs_f64());
        }
        signals
    }

    /// `signals` plus the load view's figures for the partition's ranks, when the policy
    /// reads `LOAD`.
    fn load_signals(
        &self,
        signals: SignalSnapshot,
        cards: &[kvroute_common::messages::WorkerCard],
        slot: &PolicySlot,
    ) -> SignalSnapshot {
        if !slot.inputs.contains(WorkerInputs::LOAD) {
            return signals;
        }
        let view = self.lock_load();
        signals.with_loads(cards, |rank| view.load(rank))
    }
}
