//! Membership of a queue group that comes and goes: a replica subscribes to its service's
//! group subject (and to its own direct subject, for clients' retries) while it should serve —
//! ready and keeping up, as the watchdog says — and unsubscribes from both when it should
//! not, still handling what was delivered before it left.

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

/// The subjects of one replica's membership.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The service subject, e.g. `kvroute.<ns>.select`.
    pub subject: String,
    pub queue_group: String,
    /// This replica's direct subject, e.g. `kvroute.<ns>.router.<id>.select`.
    pub direct_subject: String,
    /// For log lines: "select", "query".
    pub what: &'static str,
}

/// Runs until `serve`'s sender is dropped: joins whenever `serve` is true, leaves whenever it
/// turns false. `on_state(true|false)` is told each join (once the server has the
/// subscriptions) and leave; `handle` gets every delivered message, including those drained
/// after leaving.
pub async fn serve_membership<F, Fut>(
    nats: &async_nats::Client,
    m: &Membership,
    mut serve: watch::Receiver<bool>,
    on_state: impl Fn(bool),
    mut handle: F,
) where
    F: FnMut(async_nats::Message) -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        if serve.wait_for(|s| *s).await.is_err() {
            return;
        }
        let subscribed = async {
            let group = nats
                .queue_subscribe(m.subject.clone(), m.queue_group.clone())
                .await?;
            let direct = nats.subscribe(m.direct_subject.clone()).await?;
            // A round trip, so the server has both subscriptions before we say we serve.
            nats.flush().await?;
            anyhow::Ok((group, direct))
        };
        let (mut group, mut direct) = match subscribed.await {
            Ok(subs) => subs,
            Err(e) => {
                tracing::warn!(error = %e, what = m.what, "subscribing failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        on_state(true);
        tracing::info!(
            subject = m.subject,
            direct = m.direct_subject,
            "joined the {} queue group",
            m.what
        );
        loop {
            let msg = tokio::select! {
                m = group.next() => m,
                m = direct.next() => m,
                changed = serve.changed() => {
                    if changed.is_err() || !*serve.borrow_and_update() {
                        break;
                    }
                    continue;
                }
            };
            match msg {
                Some(msg) => handle(msg).await,
                // The connection was closed for good.
                None => break,
            }
        }
        on_state(false);
        let _ = group.unsubscribe().await;
        let _ = direct.unsubscribe().await;
        // Delivered before we left: still handled (an expired request is dropped there).
        let mut drained = 0u64;
        while let Some(msg) = group.next().await {
            drained += 1;
            handle(msg).await;
        }
        while let Some(msg) = direct.next().await {
            drained += 1;
            handle(msg).await;
        }
        tracing::warn!(
            subject = m.subject,
            drained,
            "left the {} queue group",
            m.what
        );
    }
}
