//! The edge where answers go out: the reply on the requester's inbox and the `Decision` every
//! router replica applies to its load view.

use kvroute_common::codec::encode;
use kvroute_common::messages::{Decision, SelectResponse};

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
