//! The process: load the models (a bad one stops startup naming it), connect to NATS and etcd,
//! watch the worker cards, serve HTTP until the shutdown signal, then drain: stop accepting,
//! let requests in flight finish (up to 30 s), and flush the lifecycle events.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use axum::serve::ListenerExt as _;
use kvroute_common::Names;
use kvroute_common::client::SelectClient;

use crate::app::{App, Settings, engine_client};
use crate::config::{GatewayArgs, parse_api_keys};
use crate::directory::Directory;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::reservations::Reservations;

/// How long requests in flight may finish after the shutdown signal.
const DRAIN: Duration = Duration::from_secs(30);

/// Startup checks that need no network: the flags, the models, the API keys.
pub fn prepare(
    args: &GatewayArgs,
) -> Result<(Models, Option<HashSet<String>>), kvroute_common::config::ConfigError> {
    args.validate()?;
    let models = Models::load(&args.model_specs()?, args.models_dir.as_deref())?;
    let keys = match &args.api_keys_file {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                kvroute_common::config::ConfigError::new(
                    "api-keys-file",
                    format!("{}: {e}", path.display()),
                )
            })?;
            Some(parse_api_keys(&text)?.into_iter().collect())
        }
    };
    Ok((models, keys))
}

/// The client side of the gateway: every accepted connection with TCP_NODELAY, so a streamed
/// token goes out at once instead of waiting for the client's delayed ACK of the one before
/// (about 40 ms on Linux).
pub fn client_listener(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::warn!(%error, "setting TCP_NODELAY on a client connection");
        }
    })
}

/// Runs the gateway until `shutdown` resolves.
pub async fn run(
    args: GatewayArgs,
    models: Models,
    api_keys: Option<HashSet<String>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let names = Names::new(&args.namespace.namespace);
    let nats = args.nats.connect("kvroute-gateway").await?;
    let etcd = args.etcd.connect().await?;
    let metrics = Arc::new(Metrics::default());
    let directory = Directory::default();
    let mut cards = kvroute_common::discovery::watch_workers(etcd, &names);
    let feed = directory.clone();
    tokio::spawn(async move {
        while let Some(event) = cards.recv().await {
            feed.apply(event);
        }
    });
    let app = Arc::new(App {
        settings: Settings {
            max_body_bytes: args.max_body_bytes,
            max_prompt_tokens: args.max_prompt_tokens,
            response_timeout: args.response_timeout(),
            upstream_idle_timeout: args.upstream_idle_timeout(),
            forward_token_ids: args.forward_token_ids,
            retry_after_secs: args.retry_after_secs,
            access_log: !args.no_access_log,
        },
        models,
        directory,
        select: SelectClient::new(nats.clone(), &names, args.select.policy()),
        http: engine_client(args.connect_timeout()).context("building the HTTP client")?,
        lifecycle: Lifecycle::start(nats.clone(), names.clone(), metrics.clone()),
        metrics,
        reservations: Mutex::new(Reservations::new(
            args.reservation_ttl_ms,
            args.max_reservations,
        )),
        api_keys,
        nats: nats.clone(),
    });
    let expiry = tokio::spawn(crate::select_api::expire_loop(app.clone()));
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|error| kvroute_common::ops::ListenError {
            flag: "http-addr",
            addr: args.http_addr,
            error,
        })?;
    let bound = listener.local_addr().context("reading the bound address")?;
    let mut models: Vec<&str> = app.models.names().collect();
    models.sort_unstable();
    if models.is_empty() {
        tracing::warn!(
            "no model to tokenize (--model NAME=DIR): only prompts given as token ids can be routed"
        );
    }
    tracing::info!(%bound, ?models, auth = app.api_keys.is_some(), "serving the OpenAI API and the selection API");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(
        client_listener(listener),
        crate::http::router(app.clone()).into_make_service(),
    )
    .with_graceful_shutdown(async move {
        let _ = stop_rx.await;
    });
    let mut serving = tokio::spawn(async move { server.await });
    tokio::select! {
        _ = shutdown => {}
        r = &mut serving => {
            return Err(anyhow::anyhow!("the HTTP server stopped: {:?}", r));
        }
    }
    tracing::info!("shutting down: no new requests; letting those in flight finish");
    let _ = stop_tx.send(());
    if tokio::time::timeout(DRAIN, &mut serving).await.is_err() {
        tracing::warn!("requests still in flight after {DRAIN:?}; stopping anyway");
        serving.abort();
    }
    expiry.abort();
    // Lifecycle events of the last requests, then everything NATS still buffers.
    tokio::time::sleep(Duration::from_millis(50)).await;
    nats.flush().await.context("flushing NATS")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener as _;

    #[tokio::test]
    async fn accepted_client_connections_have_nodelay() {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = tcp.local_addr().expect("addr");
        let mut listener = super::client_listener(tcp);
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (accepted, _) = listener.accept().await;
        assert!(accepted.nodelay().expect("read TCP_NODELAY"));
    }
}
