//! One selection request through the service: intake checks → the model's candidates → the
//! prompt's overlap (only when the policy reads it) → the decision core's selection machine
//! (`crate::decide::selection`, run by `crate::drive`: session lookup, then under the
//! partition's policy lock and the load view: eligibility, policy, decision, charge; then the
//! binding commit) → the decision is published, then the
//! reply sent (so a client's next request, answered by another replica, finds the decision
//! there).
//!
//! A request past its deadline is dropped (no reply, no decision, no load): its client has
//! retried. A request whose id already has a decision (a retry, answered by this replica or
//! by another) gets that decision again.
//!
//! The wall clock is read once per request, at intake; later times (after waiting for the lock
//! or for the session store) add the monotonic time elapsed since.
//!
//! When every eligible worker is busy, a request of a partition this replica queues waits in
//! its admission queue ([`super::admission`]) instead of failing `all_overloaded`; so does a
//! request whose partition already has requests waiting (they go first).

use kvroute_common::messages::{
    Decision, Disaggregation, ErrorCode, SelectRequest, SelectResponse,
};
use kvroute_common::names::headers;
use uuid::Uuid;

use super::admission::{Admit, Admitted, Arrival, Join, Queued, Waiting};
use super::intake::{self, Clock, Rejected};
use super::load_views::Locked;
use super::metrics::labels;
use super::peers::Forwarded;
use super::reply;
use super::reply::Concluded;
use super::{PolicySlot, Router};
use std::sync::Arc;

use crate::decide::prompt::Prepared;
use crate::decide::selection::{Context, Selection, Start};
use crate::decide::wire;
use crate::drive::{self, Ended};
use crate::eligibility::EligibilityError;
use crate::pipeline::WorkerInputs;
use crate::registry::ConfigError;
use crate::select::SelectFailure;
use crate::signals::SignalSnapshot;
use crate::worker::{WorkerRank, WorkerTarget};

/// What became of one request message (lives for one request: not worth a box).
#[allow(clippy::large_enum_variant)]
enum Outcome {
    /// Answer with this, and publish the decision if one was made.
    Answer(SelectResponse, Option<Decision>),
    /// The partition's owner answered this (encoded reply, passed on as it is).
    Relayed(bytes::Bytes),
    /// Past its deadline when picked up (`intake`), when its turn on the policy came
    /// (`queued`) or once its session binding was committed (`selected`): dropped unanswered.
    Expired(&'static str),
    /// In this replica's admission queue: the answer goes to the client later (`forwarded`:
    /// tell the forwarding replica so).
    Queued { forwarded: bool },
    /// The partition's owner queued it and answers the client itself.
    QueuedByOwner,
}

impl Router {
    /// Answers one request message: every request gets a reply (ok or error with a code),
    /// except one past its deadline, which nobody waits for any more.
    pub(super) async fn handle(&self, msg: async_nats::Message) {
        let clock = Clock::now();
        let Some(inbox) = msg.reply.clone() else {
            self.metrics.bad_messages.inc("select_no_reply_subject");
            return;
        };
        let (response, decision) = match self.respond(&msg, clock).await {
            Outcome::Answer(response, decision) => (response, decision),
            Outcome::Relayed(bytes) => {
                if let Err(e) = self.nats.publish(inbox, bytes).await {
                    tracing::warn!(error = %e, "passing on the owner's reply failed");
                }
                self.metrics
                    .selection_latency
                    .observe(clock.elapsed().as_secs_f64());
                return;
            }
            Outcome::Expired(stage) => {
                self.metrics.expired.inc(stage);
                return;
            }
            Outcome::Queued { forwarded } => {
                if forwarded {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert(headers::QUEUED, self.router_id.as_str());
                    if let Err(e) = self
                        .nats
                        .publish_with_headers(inbox, headers, bytes::Bytes::new())
                        .await
                    {
                        tracing::warn!(error = %e, "telling the forwarding replica a request is queued failed");
                    }
                }
                return;
            }
            Outcome::QueuedByOwner => return,
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
            .observe(clock.elapsed().as_secs_f64());
    }

    async fn respond(&self, msg: &async_nats::Message, clock: Clock) -> Outcome {
        let mut request = match intake::parse(&msg.payload) {
            Ok(r) => r,
            Err(Rejected { code, message }) => {
                return Outcome::Answer(wire::error(code, message, None), None);
            }
        };
        if request.attempt > 0 {
            self.metrics.retries_received.inc();
        }
        if clock.expired(&request) {
            tracing::debug!(request_id = ?request.request_id, attempt = request.attempt, "dropped a request past its deadline");
            return Outcome::Expired(labels::EXPIRED_INTAKE);
        }
        // A request that may be disaggregated is decided (and owned) in the prefill partition.
        let pair = self.plan_hops(&mut request);
        let headers = msg.headers.as_ref();
        let forwarded = headers.and_then(|h| h.get(headers::FORWARDED_BY)).is_some();
        // A request whose owner did not answer is decided here, and may queue here.
        let mut owner_failed = false;
        if !forwarded && let Some(owner) = self.owner_of(&request) {
            match self.forward(&owner, msg, &request, clock).await {
                Some(Forwarded::Answered(reply)) => return Outcome::Relayed(reply),
                Some(Forwarded::Queued) => return Outcome::QueuedByOwner,
                None => owner_failed = true,
            }
        }
        // The client's inbox: a forwarded request names it (the owner may answer it later).
        let client = headers
            .and_then(|h| h.get(headers::REPLY_TO))
            .map(|v| async_nats::Subject::from(v.as_str()))
            .or_else(|| msg.reply.clone());
        // A request handed over by a former owner keeps its first arrival.
        let arrived_ms = headers
            .and_then(|h| h.get(headers::ARRIVED_MS))
            .and_then(|v| v.as_str().parse::<u64>().ok())
            .unwrap_or(clock.wall_ms);
        let request_id = request.request_id.unwrap_or_else(Uuid::new_v4);
        let queue = self
            .queues_here(&request, forwarded || owner_failed)
            .then_some(client)
            .flatten()
            .map(|reply_to| (reply_to, arrived_ms, forwarded));
        match self.choose(request, pair, request_id, clock, queue).await {
            Ok(outcome) => outcome,
            Err(response) => Outcome::Answer(response, None),
        }
    }

    /// The request prepared for selection (its partition and hashed prompt) and its policy
    /// slot; `queued`: the request as prepared when it joined the queue, hashed again only
    /// when its partition's block size changed. The error is the reply itself (sent once, on a
    /// cold path).
    #[allow(clippy::result_large_err)]
    fn prepare(
        &self,
        request: Result<(SelectRequest, Option<Disaggregation>), &Arc<Prepared>>,
        request_id: Uuid,
    ) -> Result<(Arc<Prepared>, Arc<PolicySlot>), SelectResponse> {
        let fail = |f: SelectFailure| SelectResponse::Error(f.to_select_error(Some(request_id)));
        if !self.is_ready() {
            return Err(wire::error(
                ErrorCode::Unavailable,
                format!("router {} is not ready yet", self.router_id),
                Some(request_id),
            ));
        }
        let (model, role) = match &request {
            Ok((r, _)) => (&r.model, r.role),
            Err(p) => (&p.request.model, p.request.role),
        };
        let partition = self
            .candidates
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .partition(model, role);
        let Some(partition) = partition else {
            return Err(fail(SelectFailure::Eligibility(
                EligibilityError::NoWorkers {
                    model: model.clone(),
                    role,
                },
            )));
        };
        let prepared = match request {
            Ok((request, pair)) => {
                let mut prepared = Prepared::new(request, request_id, partition).map_err(fail)?;
                prepared.pair = pair;
                Arc::new(prepared)
            }
            Err(queued) if Arc::ptr_eq(&queued.partition, &partition) => queued.clone(),
            Err(queued) => {
                let mut fresh = Prepared::clone(queued);
                fresh.refresh(partition).map_err(fail)?;
                Arc::new(fresh)
            }
        };
        let request = &prepared.request;
        let slot = self
            .policies
            .slot(
                request.role,
                &request.model,
                request.policy.as_deref(),
                &self.settings,
            )
            .map_err(|e| {
                // A type that cannot run without parameters is the request's mistake.
                let code = match e {
                    ConfigError::NeedsParameters { .. } => ErrorCode::BadRequest,
                    _ => ErrorCode::Unavailable,
                };
                wire::error(code, e.to_string(), Some(request_id))
            })?
            .ok_or_else(|| {
                wire::error(
                    ErrorCode::BadRequest,
                    format!(
                        "unknown policy {:?}: name a configured instance or a registered type",
                        request.policy.as_deref().unwrap_or_default()
                    ),
                    Some(request_id),
                )
            })?;
        Ok((prepared, slot))
    }

    /// Decides a request (see the module docs); `queue` — the client's inbox, the request's
    /// first arrival and whether it was forwarded — when this replica may queue it.
    async fn choose(
        &self,
        request: SelectRequest,
        pair: Option<Disaggregation>,
        request_id: Uuid,
        clock: Clock,
        queue: Option<(async_nats::Subject, u64, bool)>,
    ) -> Result<Outcome, SelectResponse> {
        let fail = |f: SelectFailure| SelectResponse::Error(f.to_select_error(Some(request_id)));
        let (prepared, slot) = self.prepare(Ok((request, pair)), request_id)?;
        let key = (prepared.request.model.clone(), prepared.request.role);
        let forwarded = queue.as_ref().is_some_and(|q| q.2);
        let arrived_ms = queue.as_ref().map_or(clock.wall_ms, |q| q.1);
        let reply_to = queue.map(|q| q.0);
        // Admission (a classifier, or requests already waiting) may queue or refuse it first.
        let mut admitted = Admitted::default();
        if self.admission.consulted(reply_to.is_some()) {
            let arrival = Arrival {
                key: key.clone(),
                prepared: prepared.clone(),
                reply_to: reply_to.clone(),
                arrived_ms,
                now_ms: clock.now_ms(),
            };
            match self.admission.arrive(arrival).await {
                Admit::Select(a) => admitted = a,
                Admit::Queued => return Ok(Outcome::Queued { forwarded }),
                Admit::Refused(response) => return Err(*response),
            }
        }
        let ended = self
            .select(
                &prepared,
                &slot,
                None,
                admitted.target(),
                reply_to.is_some(),
                clock,
            )
            .await;
        let decided = match (ended, reply_to) {
            (Ended::Join(overlap), Some(reply_to)) => {
                let now = clock.now_ms();
                let join = Join {
                    key,
                    waiting: Waiting {
                        prepared: prepared.clone(),
                        reply_to,
                        overlap: Some((overlap, now)),
                        classify: admitted.classify.take(),
                    },
                    admitted,
                    arrived_ms,
                    now_ms: now,
                };
                return match self.admission.join(join).await {
                    Admit::Refused(response) => Err(*response),
                    Admit::Queued | Admit::Select(_) => Ok(Outcome::Queued { forwarded }),
                };
            }
            (Ended::Join(_), None) => unreachable!("only a request that may queue joins"),
            (Ended::Reply(Err(f)), _) => {
                self.admission.ended(request_id, None, clock.now_ms());
                return Err(fail(f));
            }
            (Ended::Reply(Ok(decided)), _) => self.pair(&prepared, decided, clock).await,
        };
        let outcome = match self.conclude(&prepared, decided, clock) {
            Concluded::Answer(response, decision) => Outcome::Answer(response, decision),
            Concluded::Expired(stage) => Outcome::Expired(stage),
        };
        if let Outcome::Answer(SelectResponse::Ok(reply), Some(_)) = &outcome {
            let rank = WorkerRank::new(reply.worker_id, reply.dp_rank);
            self.admission.ended(request_id, Some(rank), clock.now_ms());
        }
        Ok(outcome)
    }

    /// A queued request's turn (the dispatcher's): decided with the overlap it had when not
    /// too old (else fetched again, and handed to `fresh`).
    pub(super) async fn decide_queued(
        &self,
        queued: &Arc<Prepared>,
        overlap: Option<SignalSnapshot>,
        target: Option<WorkerTarget>,
        clock: Clock,
        fresh: impl FnOnce(SignalSnapshot),
    ) -> Queued {
        let (prepared, slot) = match self.prepare(Err(queued), queued.request_id) {
            Ok(p) => p,
            Err(response) => return Queued::Answer(response, None),
        };
        let given = overlap.is_some();
        let ended = self
            .select(&prepared, &slot, overlap, target, true, clock)
            .await;
        match ended {
            Ended::Join(overlap) => {
                if !given {
                    fresh(overlap);
                }
                Queued::Overloaded
            }
            Ended::Reply(Err(f)) => Queued::Answer(
                SelectResponse::Error(f.to_select_error(Some(prepared.request_id))),
                None,
            ),
            Ended::Reply(Ok(decided)) => {
                match self.conclude(&prepared, self.pair(&prepared, decided, clock).await, clock) {
                    Concluded::Answer(response, decision) => Queued::Answer(response, decision),
                    Concluded::Expired(_) => Queued::Expired,
                }
            }
        }
    }

    /// Runs the selection machine for a prepared request (see `crate::decide::selection`): the
    /// overlap from the index, the session binding from the bucket; reading the load view,
    /// selecting and charging the decision to the view happen under the partition's policy
    /// lock, so concurrent selections (a burst of requests) each see the ones before them,
    /// instead of all picking the same least-loaded worker.
    pub(super) async fn select(
        &self,
        prepared: &Prepared,
        slot: &PolicySlot,
        overlap: Option<SignalSnapshot>,
        target: Option<WorkerTarget>,
        queues: bool,
        clock: Clock,
    ) -> Ended {
        let context = Context {
            settings: &self.settings,
            names: &self.names,
            router_id: &self.router_id,
            sessions: *self.sessions.config(),
        };
        let start = Start {
            decision_id: Uuid::new_v4(),
            reads_cache: slot.inputs.contains(WorkerInputs::CACHE),
            overlap,
            target,
            queues,
        };
        let request = &prepared.request;
        let mut state = Locked {
            slot,
            view: self.load.partition(&(request.model.clone(), request.role)),
            clock,
        };
        let (selection, need) = Selection::start(prepared, context, start, &mut state);
        let (model, prompt) = (&prepared.request.model, &prepared.prompt);
        drive::run(selection, need, &mut state, self.sessions.store(), || {
            self.overlap_signals(model, prompt)
        })
        .await
    }
}
