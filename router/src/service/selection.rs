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

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: stamps each request with the clock at intake"
)]

use std::time::Instant;

use kvroute_common::messages::{Decision, ErrorCode, SelectRequest, SelectResponse};
use kvroute_common::names::headers;
use uuid::Uuid;

use super::admission::{Admit, Admitted, Arrival, Join, Queued, Waiting};
use super::clock::Clock;
use super::intake::{self, Rejected};
use super::load_views::{self, SharedView};
use super::metrics::labels;
use super::reply;
use super::{PolicySlot, Router};
use std::sync::Arc;

use crate::decide::load_view::LoadView;
use crate::decide::prompt::{Prepared, Prompt};
use crate::decide::selection::{Context, Selection, Start};
use crate::decide::{Decided, DecisionState, PartitionPolicy, wire};
use crate::drive::{self, Ended};
use crate::eligibility::EligibilityError;
use crate::pipeline::WorkerInputs;
use crate::registry::ConfigError;
use crate::select::SelectFailure;
use crate::signals::SignalSnapshot;
use crate::worker::{WorkerRank, WorkerTarget};

/// The owner's answer to a forwarded request.
enum Forwarded {
    /// Its reply, to pass on to the client.
    Answered(bytes::Bytes),
    /// It queued the request and answers the client itself.
    Queued,
}

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

/// The service's decision state: a partition's policy slot and the replica's load view, locked
/// in that order for one decision.
struct Locked<'a> {
    slot: &'a PolicySlot,
    view: SharedView,
    clock: Clock,
}

impl DecisionState for Locked<'_> {
    fn with<R>(&mut self, f: impl FnOnce(&mut PartitionPolicy, &mut LoadView, u64) -> R) -> R {
        let mut policy = self.slot.lock();
        let mut view = load_views::lock(&self.view);
        f(&mut policy, &mut view, self.clock.now_ms())
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }
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
        let request = match intake::parse(&msg.payload) {
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
        match self.choose(request, request_id, clock, queue).await {
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
        request: Result<SelectRequest, &Arc<Prepared>>,
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
            Ok(r) => (&r.model, r.role),
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
            Ok(request) => Arc::new(Prepared::new(request, request_id, partition).map_err(fail)?),
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
        request_id: Uuid,
        clock: Clock,
        queue: Option<(async_nats::Subject, u64, bool)>,
    ) -> Result<Outcome, SelectResponse> {
        let fail = |f: SelectFailure| SelectResponse::Error(f.to_select_error(Some(request_id)));
        let (prepared, slot) = self.prepare(Ok(request), request_id)?;
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
            (Ended::Reply(Ok(decided)), _) => decided,
        };
        let outcome = self.conclude(&prepared, decided, clock);
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
            Ended::Reply(Ok(decided)) => match self.conclude(&prepared, decided, clock) {
                Outcome::Answer(response, decision) => Queued::Answer(response, decision),
                _ => Queued::Expired,
            },
        }
    }

    /// Runs the selection machine for a prepared request (see `crate::decide::selection`): the
    /// overlap from the index, the session binding from the bucket; reading the load view,
    /// selecting and charging the decision to the view happen under the partition's policy
    /// lock, so concurrent selections (a burst of requests) each see the ones before them,
    /// instead of all picking the same least-loaded worker.
    async fn select(
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

    /// What a decision comes to: the answer and the decision to publish, or nothing.
    fn conclude(&self, prepared: &Prepared, decided: Decided, clock: Clock) -> Outcome {
        let (request, request_id, prompt) =
            (&prepared.request, prepared.request_id, &prepared.prompt);
        let new = match decided {
            Decided::Known(reply) => {
                self.metrics.repeated.inc();
                return Outcome::Answer(SelectResponse::Ok(*reply), None);
            }
            Decided::Expired => return Outcome::Expired(labels::EXPIRED_QUEUED),
            Decided::New(new) => new,
        };
        // The session round trips may have taken the rest of the deadline (or the process
        // was stopped mid-selection): nobody would use this decision.
        if request.session.is_some() && clock.expired(request) {
            self.load.withdraw(&new.decision);
            return Outcome::Expired(labels::EXPIRED_SELECTED);
        }
        let m = &self.metrics;
        m.decisions_applied.inc();
        m.decisions.inc(&new.selection.worker.to_string());
        m.request_blocks.add(u64::from(prompt.blocks()));
        m.overlap_blocks.add(u64::from(new.decision.overlap_blocks));
        if let Some(binding) = new.selection.binding {
            m.sessions.inc(binding.as_str());
        }
        tracing::debug!(
            %request_id,
            worker_id = new.selection.worker.worker_id,
            dp_rank = new.selection.worker.dp_rank,
            overlap_blocks = new.decision.overlap_blocks,
            cost = new.selection.cost.total,
            policy = new.selection.policy,
            binding = ?new.selection.binding,
            attempt = request.attempt,
            "selected"
        );
        let reply = new.reply();
        Outcome::Answer(SelectResponse::Ok(reply), Some(new.decision))
    }

    /// The replica owning the request's partition, when it is another one (see
    /// `crate::decide::owner`); `None` when this replica owns it, forwarding is off, or no
    /// replica is registered yet.
    pub(super) fn owner_of(&self, request: &SelectRequest) -> Option<String> {
        let peers = self.peers.as_ref()?.borrow().clone();
        let owner = crate::decide::owner::owner(
            peers.iter().map(String::as_str),
            &request.model,
            request.role,
        )?;
        (owner != self.router_id).then(|| owner.to_owned())
    }

    /// Forwards the request to `owner` with the client's inbox; its encoded reply, or word
    /// that it queued the request; `None` when the owner cannot answer in time (gone,
    /// stalled, not serving), and this replica decides instead.
    async fn forward(
        &self,
        owner: &str,
        msg: &async_nats::Message,
        request: &SelectRequest,
        clock: Clock,
    ) -> Option<Forwarded> {
        let mut timeout = self.forward_timeout;
        if let Some(deadline) = request.deadline_ms {
            let left = deadline.saturating_sub(clock.now_ms());
            timeout = timeout.min(std::time::Duration::from_millis(left.max(1)));
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(headers::FORWARDED_BY, self.router_id.as_str());
        if let Some(inbox) = &msg.reply {
            headers.insert(headers::REPLY_TO, inbox.as_str());
        }
        let forward = async_nats::Request::new()
            .payload(msg.payload.clone())
            .headers(headers)
            .timeout(Some(timeout));
        let outcome = self
            .nats
            .send_request(self.names.router_select(owner), forward)
            .await;
        let forwards = &self.metrics.forwards;
        match outcome {
            Ok(reply)
                if reply
                    .headers
                    .as_ref()
                    .is_some_and(|h| h.get(headers::QUEUED).is_some()) =>
            {
                forwards.inc(labels::FORWARD_QUEUED);
                Some(Forwarded::Queued)
            }
            Ok(reply) => {
                forwards.inc(labels::FORWARD_ANSWERED);
                Some(Forwarded::Answered(reply.payload))
            }
            Err(e) => {
                use async_nats::client::RequestErrorKind;
                let reason = match e.kind() {
                    RequestErrorKind::NoResponders => labels::FORWARD_NO_RESPONDERS,
                    RequestErrorKind::TimedOut => labels::FORWARD_TIMEOUT,
                    _ => labels::FORWARD_ERROR,
                };
                forwards.inc(reason);
                tracing::debug!(
                    owner,
                    reason,
                    "the partition's owner did not answer; deciding here"
                );
                None
            }
        }
    }

    /// The prompt's overlap per rank (the policy reads `CACHE`); none for a prompt without a
    /// block.
    async fn overlap_signals(&self, model: &str, prompt: &Prompt) -> SignalSnapshot {
        let mut signals = SignalSnapshot::new();
        if !prompt.hashes.is_empty() {
            let started = Instant::now();
            match self.overlap.matches(model, &prompt.hashes).await {
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
}
