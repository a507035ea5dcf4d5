//! One selection request through the service: intake checks → the model's candidates →
//! overlap and load signals (only the groups the policy declared) → the core's `select`
//! (session lookup, eligibility, policy, binding commit) → reply, then the decision is
//! applied locally and published.

use std::time::Instant;

use kvroute_common::messages::{Decision, ErrorCode, SelectRequest, SelectResponse, now_ms};
use uuid::Uuid;

use super::intake::{self, Prompt, Rejected};
use super::load_view::Applied;
use super::reply;
use super::{PolicySlot, Router};
use crate::eligibility::EligibilityError;
use crate::pipeline::WorkerInputs;
use crate::select::{SelectFailure, SelectInput, select};
use crate::signals::{Overlap, SignalSnapshot};
use crate::worker::WorkerRank;

/// The stable label of an error code (as on the wire).
pub fn code_label(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::BadRequest => "bad_request",
        ErrorCode::TooLarge => "too_large",
        ErrorCode::UnsupportedVersion => "unsupported_version",
        ErrorCode::NoWorkers => "no_workers",
        ErrorCode::AllFiltered => "all_filtered",
        ErrorCode::AllOverloaded => "all_overloaded",
        ErrorCode::PinnedUnavailable => "pinned_unavailable",
        ErrorCode::PolicyError => "policy_error",
        ErrorCode::Unavailable => "unavailable",
    }
}

impl Router {
    /// Answers one request message; every request gets a reply (ok or error with a code).
    pub(super) async fn handle(&self, msg: async_nats::Message) {
        let started = Instant::now();
        let Some(inbox) = msg.reply.clone() else {
            self.metrics.bad_messages.inc("select_no_reply_subject");
            return;
        };
        let (response, decision) = self.respond(&msg.payload).await;
        if let SelectResponse::Error(e) = &response {
            self.metrics.errors.inc(code_label(e.code));
            tracing::debug!(request_id = ?e.request_id, code = code_label(e.code), message = e.message, "selection failed");
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

    async fn respond(&self, payload: &[u8]) -> (SelectResponse, Option<Decision>) {
        let request = match intake::parse(payload) {
            Ok(r) => r,
            Err(Rejected { code, message }) => return (reply::error(code, message, None), None),
        };
        let request_id = request.request_id.unwrap_or_else(Uuid::new_v4);
        match self.choose(&request, request_id).await {
            Ok((response, decision)) => (response, Some(decision)),
            Err(response) => (response, None),
        }
    }

    async fn choose(
        &self,
        request: &SelectRequest,
        request_id: Uuid,
    ) -> Result<(SelectResponse, Decision), SelectResponse> {
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
            .map_err(|e| reply::error(ErrorCode::Unavailable, e.to_string(), Some(request_id)))?
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
        // Reading the load view, selecting and charging the decision to the view happen under
        // the partition's policy lock: concurrent selections (a burst of requests) each see
        // the ones before them, instead of all picking the same least-loaded worker.
        let (selection, decision) = {
            let mut guard = slot.state.lock().await;
            let state = &mut *guard;
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
            let decision = reply::decision(
                request,
                request_id,
                Uuid::new_v4(),
                &selection,
                &prompt,
                partition.block_size,
                &self.router_id,
            );
            if self.lock_load().apply_decision(&decision, now_ms()) == Applied::Added {
                self.metrics.decisions_applied.inc();
            }
            (selection, decision)
        };
        let decision_id = decision.decision_id;
        let m = &self.metrics;
        m.decisions.inc(&selection.worker.to_string());
        m.request_blocks.add(u64::from(prompt.blocks()));
        m.overlap_blocks.add(u64::from(decision.overlap_blocks));
        if let Some(binding) = selection.binding {
            m.sessions.inc(match binding {
                kvroute_common::messages::BindingState::New => "new",
                kvroute_common::messages::BindingState::Kept => "kept",
                kvroute_common::messages::BindingState::Rebound => "rebound",
                kvroute_common::messages::BindingState::Released => "released",
            });
        }
        tracing::debug!(
            %request_id,
            worker_id = selection.worker.worker_id,
            dp_rank = selection.worker.dp_rank,
            overlap_blocks = decision.overlap_blocks,
            cost = selection.cost.total,
            policy = selection.policy,
            binding = ?selection.binding,
            "selected"
        );
        let reply = selection.to_reply(request_id, decision_id, prompt.blocks(), &self.router_id);
        Ok((SelectResponse::Ok(reply), decision))
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
                Ok(matches) => {
                    for m in matches {
                        let overlap = Overlap {
                            device: m.device,
                            host: m.host,
                            disk: m.disk,
                            cached_blocks: m.total_blocks,
                        };
                        signals =
                            signals.with_overlap(WorkerRank::new(m.worker_id, m.dp_rank), overlap);
                    }
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
        mut signals: SignalSnapshot,
        cards: &[kvroute_common::messages::WorkerCard],
        slot: &PolicySlot,
    ) -> SignalSnapshot {
        if slot.inputs.contains(WorkerInputs::LOAD) {
            let view = self.lock_load();
            for card in cards {
                for rank in card.dp_ranks() {
                    let worker = WorkerRank::new(card.worker_id, rank);
                    if let Some(load) = view.load(worker) {
                        signals = signals.with_load(worker, load);
                    }
                }
            }
        }
        signals
    }
}
