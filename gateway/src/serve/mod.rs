//! The client side's HTTP/1.1 server (hyper), with what a public front door needs against its
//! clients: at most `--max-connections` connections (a new one past it closes the oldest
//! connection that has no request in flight — idle, or still sending its head — and when every
//! connection is busy a small reserve answers only the health and metrics endpoints), the
//! timeouts of `socket.rs` (head, idle, a client that reads nothing), and a graceful stop: no new
//! connections, requests in flight finish up to a deadline. (The body's read timeout is the
//! handler's: `http.rs`.)

mod socket;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service as _;

use crate::metrics::{ConnectionStats, Metrics};
use socket::{Activity, Guarded, Tracked};

/// Connections beyond `--max-connections` that may still ask for `/healthz`, `/readyz`,
/// `/health` and `/metrics` while every connection is busy with a request.
pub const HEALTH_RESERVE: usize = 16;
/// The most header lines hyper parses (the handler answers 431 above `MAX_HEADERS`).
const HYPER_MAX_HEADERS: usize = 256;

/// The server's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// How long a write to the client may stay blocked (a client that does not read).
    pub write_timeout: Duration,
}

/// Open connections by age, for eviction.
#[derive(Debug, Default)]
struct Registry {
    next: u64,
    open: BTreeMap<u64, Arc<Activity>>,
}

/// Serves `app` (and `health` on the reserve) on `listener` until `stop` resolves, then lets
/// connections finish their requests for up to `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    health: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()>,
    drain: Duration,
) {
    let registry = Arc::new(Mutex::new(Registry::default()));
    let (stopping_tx, stopping) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let stats = &metrics.connections;
    let mut last_warning: Option<Instant> = None;
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            () = &mut stop => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(error) => {
                // Out of file descriptors and the like: wait rather than spin (and say so at
                // most every 10 s).
                if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    last_warning = Some(Instant::now());
                    tracing::warn!(%error, "accepting a client connection failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        prepare(&tcp);
        let open = stats.open.load(Ordering::Relaxed);
        let full = open >= limits.max_connections && !evict_oldest_idle(&registry, stats);
        let service = if !full {
            app.clone()
        } else if open < limits.max_connections + HEALTH_RESERVE {
            health.clone()
        } else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                last_warning = Some(Instant::now());
                tracing::warn!(
                    max_connections = limits.max_connections,
                    "every connection is busy with a request: closing new connections (--max-connections)"
                );
            }
            drop(tcp);
            continue;
        };
        let activity = Arc::new(Activity::new());
        let id = {
            let mut r = registry.lock().expect("connection registry lock");
            r.next += 1;
            let id = r.next;
            if !full {
                r.open.insert(id, activity.clone());
            }
            id
        };
        stats.open.fetch_add(1, Ordering::Relaxed);
        let metrics = metrics.clone();
        let registry = registry.clone();
        let stopping = stopping.clone();
        tasks.spawn(async move {
            connection(tcp, service, activity, limits, !full, stopping, &metrics).await;
            registry
                .lock()
                .expect("connection registry lock")
                .open
                .remove(&id);
            metrics.connections.open.fetch_sub(1, Ordering::Relaxed);
        });
    }
    drop(listener);
    let _ = stopping_tx.send(true);
    let drained =
        tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            "requests still in flight after {drain:?} (--shutdown-timeout-ms); closing their connections"
        );
        tasks.abort_all();
    }
}

/// Every accepted connection gets TCP_NODELAY, so a streamed token goes out at once instead of
/// waiting for the client's delayed ACK of the one before (about 40 ms on Linux).
fn prepare(tcp: &TcpStream) {
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::warn!(%error, "setting TCP_NODELAY on a client connection");
    }
}

/// Closes the oldest connection without a request in flight; whether there was one.
fn evict_oldest_idle(registry: &Mutex<Registry>, stats: &ConnectionStats) -> bool {
    let mut r = registry.lock().expect("connection registry lock");
    let Some(id) = r.open.iter().find(|(_, a)| a.idle()).map(|(id, _)| *id) else {
        return false;
    };
    if let Some(activity) = r.open.remove(&id) {
        activity.evict.notify_one();
    }
    stats.evicted.fetch_add(1, Ordering::Relaxed);
    true
}

async fn connection(
    tcp: TcpStream,
    router: Router,
    activity: Arc<Activity>,
    limits: Limits,
    keep_alive: bool,
    mut stopping: watch::Receiver<bool>,
    metrics: &Metrics,
) {
    let io = Guarded::new(tcp, activity.clone(), limits);
    let tracked = activity.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let mut router = router.clone();
        let activity = tracked.clone();
        activity.request_started();
        async move {
            let response = router
                .call(request.map(Body::new))
                .await
                .unwrap_or_else(|never| match never {});
            Ok::<_, std::convert::Infallible>(response.map(|inner| Tracked::new(inner, activity)))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .max_headers(HYPER_MAX_HEADERS)
        .keep_alive(keep_alive);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = activity.evict.notified() => return,
        () = async {
            // The borrow the wait returns must not live across the drain below.
            let _ = stopping.wait_for(|s| *s).await;
        } => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
    // Other errors are the client's (malformed, gone): hyper answered where it could.
    if activity.timed_out.load(Ordering::Relaxed) {
        metrics
            .connections
            .timed_out
            .fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_client_connections_have_nodelay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let _client = TcpStream::connect(addr).await.expect("connect");
        let (accepted, _) = listener.accept().await.expect("accept");
        prepare(&accepted);
        assert!(accepted.nodelay().expect("read TCP_NODELAY"));
    }
}
