//! A dispatch round's I/O, in a task of its own while the actor goes on: first the requests
//! of partitions another replica owns now are handed to it (those it does not take go back to
//! the actor), then each queued request's turn runs the selection machine as a new request
//! would (in order per partition; a partition stops after
//! [`MAX_OVERLOADED_IN_A_ROW`] requests in a row found every eligible worker busy), and what
//! each came to goes back to the actor.

use std::sync::Arc;

use kvroute_common::names::headers;
use tokio::sync::mpsc;

use super::queues::{Turn, Waiting};
use super::{Input, Queued, Turned};
use crate::decide::candidates::PartitionKey;
use crate::queue::Left;
use crate::service::Router;
use crate::service::intake::Clock;

/// A round stops trying a partition after this many consecutive requests found every
/// eligible worker busy.
const MAX_OVERLOADED_IN_A_ROW: usize = 8;
/// A queued request's overlap is fetched again when older than this.
const OVERLAP_MAX_AGE_MS: u64 = 500;

/// Runs one round (see the module docs); ends with [`Input::RoundDone`].
pub(super) async fn run(
    router: Arc<Router>,
    moving: Vec<(PartitionKey, Left<Waiting>)>,
    tries: Vec<(PartitionKey, Vec<Turn>)>,
    actor: mpsc::UnboundedSender<Input>,
) {
    if !moving.is_empty() {
        let (left, failed) = hand_over(&router, moving).await;
        if !left.is_empty() || failed {
            let _ = actor.send(Input::Kept { left, failed });
        }
    }
    for (key, turns) in tries {
        let mut overloaded = 0;
        for turn in turns {
            let turned = try_turn(&router, &key, turn).await;
            let was_overloaded = matches!(turned.queued, Queued::Overloaded);
            if actor.send(Input::Turned(Box::new(turned))).is_err() {
                return;
            }
            if !was_overloaded {
                overloaded = 0;
                continue;
            }
            overloaded += 1;
            if overloaded >= MAX_OVERLOADED_IN_A_ROW {
                break;
            }
        }
    }
    let _ = actor.send(Input::RoundDone);
}

/// One queued request's turn: decided with the overlap it had when not too old (else fetched
/// again, and kept for its next turn).
async fn try_turn(router: &Router, key: &PartitionKey, turn: Turn) -> Turned {
    let clock = Clock::now();
    let now = clock.now_ms();
    let overlap = turn
        .overlap
        .filter(|(_, at)| now.saturating_sub(*at) <= OVERLAP_MAX_AGE_MS)
        .map(|(o, _)| o);
    let mut fresh_overlap = None;
    let queued = router
        .decide_queued(&turn.prepared, overlap, turn.target, clock, |fresh| {
            fresh_overlap = Some(fresh)
        })
        .await;
    Turned {
        key: key.clone(),
        id: turn.id,
        queued,
        fresh_overlap,
        now_ms: now,
    }
}

/// Hands each request to its partition's owner, keeping its first arrival; once an owner does
/// not take one, the rest are kept too. Returns the kept requests, and whether an owner
/// failed.
async fn hand_over(
    router: &Router,
    moving: Vec<(PartitionKey, Left<Waiting>)>,
) -> (Vec<(PartitionKey, Left<Waiting>)>, bool) {
    let mut failed = false;
    let mut kept = Vec::new();
    for (key, left) in moving {
        let owner = router.owner_of_partition(&key).filter(|_| !failed);
        let handed = match &owner {
            Some(owner) => hand_to(router, owner, &left).await,
            None => false,
        };
        if owner.is_some() && !handed {
            failed = true;
        }
        if handed {
            router.metrics.queue_handed_over.inc();
        } else {
            kept.push((key, left));
        }
    }
    (kept, failed)
}

async fn hand_to(router: &Router, owner: &str, left: &Left<Waiting>) -> bool {
    let prepared = &left.item.prepared;
    // A paired request goes as it came (the owner plans its hops again); any other as
    // prepared (its role is the partition's).
    let request = match prepared.pair {
        Some(mode) => &kvroute_common::messages::SelectRequest {
            role: kvroute_common::messages::WorkerRole::Aggregated,
            disaggregation: Some(mode),
            ..prepared.request.clone()
        },
        None => &prepared.request,
    };
    let Ok(payload) = kvroute_common::codec::encode(request) else {
        return false;
    };
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(headers::FORWARDED_BY, router.router_id.as_str());
    headers.insert(headers::REPLY_TO, left.item.reply_to.as_str());
    headers.insert(
        headers::ARRIVED_MS,
        left.ticket.arrived_ms.to_string().as_str(),
    );
    let request = async_nats::Request::new()
        .payload(payload)
        .headers(headers)
        .timeout(Some(router.forward_timeout));
    match router
        .nats
        .send_request(router.names.router_select(owner), request)
        .await
    {
        Ok(answer) => {
            let queued = answer
                .headers
                .as_ref()
                .is_some_and(|h| h.get(headers::QUEUED).is_some());
            if !queued {
                // The owner decided at once: pass its answer on.
                if let Err(e) = router
                    .nats
                    .publish(left.item.reply_to.clone(), answer.payload)
                    .await
                {
                    tracing::warn!(error = %e, "passing on the new owner's reply failed");
                }
            }
            true
        }
        Err(e) => {
            tracing::debug!(owner, error = %e, "the new owner did not take a queued request; keeping it");
            false
        }
    }
}
