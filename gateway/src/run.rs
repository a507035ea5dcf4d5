//! The process: load the models (a bad one stops startup naming it), connect to NATS and etcd,
//! watch the worker cards, serve HTTP until the shutdown signal, then drain: stop accepting,
//! let requests in flight finish (up to `--shutdown-timeout-ms`), and flush the lifecycle events
//! (up to 2 s: NATS may be unreachable).

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use kvroute_common::Names;
use kvroute_common::client::SelectClient;

use crate::app::{App, Settings, engine_client};
use crate::config::{GatewayArgs, parse_api_keys};
use crate::directory::Directory;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::reservations::Reservations;
use crate::tokenize_gate::TokenizeGate;

/// How long the last lifecycle events may take to reach NATS at shutdown.
const FLUSH: Duration = Duration::from_secs(2);

/// Startup checks that need no network: the flags, the models, the API keys.
pub fn prepare(
    args: &GatewayArgs,
) -> Result<(Models, Option<HashSet<String>>), kvroute_common::config::ConfigError> {
    args.validate()?;
    let models = Models::load(
        &args.model_specs()?,
        args.models_dir.as_deref(),
        args.tokenize_cache_mib << 20,
    )?;
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
            body_read_timeout: Duration::from_millis(args.body_read_timeout_ms),
            max_header_bytes: args.max_header_bytes,
            max_prompt_tokens: args.max_prompt_tokens,
            response_timeout: args.response_timeout(),
            upstream_idle_timeout: args.upstream_idle_timeout(),
            forward_token_ids: args.forward_token_ids,
            retry_after_secs: args.retry_after_secs,
            access_log: !args.no_access_log,
        },
        models,
        adapter_bases: args.adapter_bases()?,
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
        tokenize_gate: TokenizeGate::new(args.concurrent_tokenizations(), args.tokenize_queue),
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
    let drain = Duration::from_millis(args.shutdown_timeout_ms);
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let stop = async move {
        shutdown.await;
        tracing::info!("shutting down: no new connections; letting requests in flight finish");
        let _ = stopped_tx.send(());
    };
    crate::serve::serve(
        listener,
        crate::http::router(app.clone()),
        crate::http::health_router(app.clone()),
        args.serve_limits(),
        app.metrics.clone(),
        stop,
        drain,
    )
    .await;
    if stopped_rx.await.is_err() {
        return Err(anyhow::anyhow!("the HTTP server stopped on its own"));
    }
    expiry.abort();
    // Lifecycle events of the last requests, then everything NATS still buffers (bounded: NATS
    // may be unreachable, and a flush would wait for it forever).
    tokio::time::sleep(Duration::from_millis(50)).await;
    match tokio::time::timeout(FLUSH, nats.flush()).await {
        Ok(flushed) => flushed.context("flushing NATS")?,
        Err(_) => tracing::warn!(
            "NATS did not take the last lifecycle events within {FLUSH:?}; the routers' prediction age limit frees their load"
        ),
    }
    Ok(())
}
