//! The edge where answers go out: the reply on the requester's inbox and the `Decision` every
//! router replica applies to its load view.

use kvroute_common::codec::encode;
use kvroute_common::messages::{Decision, SelectResponse};

use super::Router;
use super::intake::Clock;
use super::metrics::labels;
use crate::decide::Decided;
use crate::decide::prompt::Prepared;

/// What a decision came to.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "lives for one request: not worth a box"
)]
pub(super) enum Concluded {
    /// Answer with this, and publish the decision if one was made.
    Answer(SelectResponse, Option<Decision>),
    /// Nobody waits for it any more (the label of `expired_total`).
    Expired(&'static str),
}

/// Publishes `response` to `inbox`. A reply that cannot be sent is logged (the requester
/// times out; nothing else can be done from here).
pub async fn send(
    nats: &async_nats::Client,
    inbox: async_nats::Subject,
    response: &SelectResponse,
) {
    let bytes = match encode(response) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "encoding a select reply failed");
            return;
        }
    };
    if let Err(e) = nats.publish(inbox, bytes).await {
        tracing::warn!(error = %e, "publishing a select reply failed");
    }
}

/// Publishes a decision on `kvroute.<ns>.decisions`.
pub async fn publish_decision(nats: &async_nats::Client, subject: &str, decision: &Decision) {
    match encode(decision) {
        Ok(bytes) => {
            if let Err(e) = nats.publish(subject.to_owned(), bytes).await {
                tracing::warn!(error = %e, "publishing a decision failed");
            }
        }
        Err(e) => tracing::error!(error = %e, "encoding a decision failed"),
    }
}

impl Router {
    /// What a decision comes to: the answer and the decision to publish (its metrics counted),
    /// or nothing (a decision nobody would use is withdrawn).
    pub(super) fn conclude(
        &self,
        prepared: &Prepared,
        decided: Decided,
        clock: Clock,
    ) -> Concluded {
        let (request, request_id, prompt) =
            (&prepared.request, prepared.request_id, &prepared.prompt);
        let new = match decided {
            Decided::Known(reply) => {
                self.metrics.repeated.inc();
                return Concluded::Answer(SelectResponse::Ok(*reply), None);
            }
            Decided::Expired => return Concluded::Expired(labels::EXPIRED_QUEUED),
            Decided::New(new) => new,
        };
        // The session round trips may have taken the rest of the deadline (or the process
        // was stopped mid-selection): nobody would use this decision.
        if request.session.is_some() && clock.expired(request) {
            self.load.withdraw(&new.decision);
            return Concluded::Expired(labels::EXPIRED_SELECTED);
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
        let new = *new;
        Concluded::Answer(SelectResponse::Ok(new.reply), Some(new.decision))
    }
}
