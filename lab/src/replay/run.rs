//! The whole replay: read and plan the trace, find the fleet, compute the oracles, then for
//! each mode reset the fleet's caches, drive the trace through the selector and collect a
//! [`ModeReport`]; finally print / write the [`RunReport`].
//!
//! Fair comparison: before each mode every worker's cache is reset (kvroute-mocker's reset
//! subject publishes `Cleared`, so indexers and routers forget the old blocks too), and the
//! tool waits `--settle-ms` before sending.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kvroute_common::Names;
use kvroute_common::trace::read_trace;
use tokio::sync::watch;

use super::chart::write_chart;
use super::config::{OutputArgs, ReplayArgs, SelectorKind};
use super::driver::{DriveSettings, drive};
use super::gateway::{GatewayTarget, drive_gateway};
use super::local::LocalSelector;
use super::oracle::{oracle_with_hits, ttft_floor};
use super::plan::Plan;
use super::progress::Progress;
use super::report::{ModeReport, RunReport};
use super::selector::{RouterSelector, Selector};
use super::sessions::session_oracle;
use super::table::render_table;
use super::workers::{
    engine_of, read_cards, reset_workers, speedup_of, wait_for_workers, watch_cards,
};

/// How long a worker may take to answer a reset.
const RESET_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs every mode of `args` against the fleet and returns the report (prints nothing on
/// stdout; see [`emit`]).
pub async fn run(args: &ReplayArgs) -> anyhow::Result<RunReport> {
    let (_never, stop) = watch::channel(false);
    run_until(args, stop).await
}

/// [`run`], stopped early once `stop` turns true: the mode being driven sends no more
/// requests, waits for those it sent and reports the rest as not sent; later modes do not run.
pub async fn run_until(
    args: &ReplayArgs,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<RunReport> {
    args.validate()?;
    let trace = read_trace(&args.trace)?;
    let plan = Plan::new(
        trace,
        args.limit,
        args.time_scale,
        args.target_duration_secs.map(Duration::from_secs_f64),
    );
    anyhow::ensure!(
        !plan.is_empty(),
        "the trace {} is empty",
        args.trace.display()
    );
    anyhow::ensure!(
        args.selector != SelectorKind::Gateway
            || plan.requests.iter().all(|r| r.lora_name.is_none()),
        "the trace names LoRA adapters (lora_name), which --selector gateway does not send: \
         replay it through the routers"
    );
    let names = Names::new(&args.namespace.namespace);
    let nats = args.nats.connect("kvroute-replay").await?;
    let mut etcd = args.etcd.connect().await?;
    let limit = Duration::from_secs_f64(args.wait_workers_secs);
    let cards = wait_for_workers(&mut etcd, &names, &args.model, limit).await?;
    let speedup = args.speedup.or_else(|| speedup_of(&cards)).unwrap_or(1.0);
    let block_size = cards[0].block_size;
    let blocks_per_worker = cards.iter().map(|c| c.total_kv_blocks).min().unwrap_or(0);
    let capacity: u64 = cards.iter().map(|c| c.total_kv_blocks).sum();
    tracing::info!(
        requests = plan.len(),
        workers = cards.len(),
        block_size,
        speedup,
        time_scale = plan.time_scale,
        last_arrival_s = plan.arrivals.last().map_or(0.0, Duration::as_secs_f64),
        "replay planned"
    );
    let engine = engine_of(&cards);
    let (oracle, ttft_floor_ms, session_oracle) = {
        let requests = plan.requests.clone();
        let sessions = plan.sessions.clone();
        tokio::task::spawn_blocking(move || {
            let (oracle, hits) = oracle_with_hits(&requests, block_size, capacity);
            let floor = engine.map(|e| ttft_floor(&requests, &hits, &e));
            let later = sessions.map(|k| session_oracle(&k, &requests, &hits, block_size));
            (oracle, floor, later)
        })
        .await?
    };
    // Session ids are sent as `<run>-<mode>/<id>`: the routers' bindings outlive a mode and a
    // run (their idle TTL), and the workers' caches are reset between modes.
    let run_id = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let mut modes = Vec::new();
    for (i, &mode) in args.modes.iter().enumerate() {
        if *stop.borrow() {
            let left: Vec<String> = args.modes[i..].iter().map(ToString::to_string).collect();
            tracing::warn!(modes = %left.join(","), "stopped: these modes did not run");
            break;
        }
        let cards = read_cards(&mut etcd, &names, &args.model).await?;
        anyhow::ensure!(
            !cards.is_empty(),
            "no worker serves {:?} any more",
            args.model
        );
        let workers: Vec<_> = cards.iter().map(|c| c.worker_id).collect();
        // A gateway's fleet is engines behind kvroute-bridge: nothing to reset.
        if !args.no_reset && args.selector != SelectorKind::Gateway {
            reset_workers(&nats, &names, &workers, RESET_TIMEOUT).await?;
            tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;
        }
        let settings = DriveSettings {
            mode,
            model: args.model.clone(),
            speedup,
            request_timeout: args.request_timeout(),
            workers,
            send_sessions: !args.no_sessions,
            session_scope: format!("replay-{run_id}-{mode}/"),
        };
        let report = match args.selector {
            SelectorKind::Router => {
                let selector = RouterSelector::new(nats.clone(), &names, args.select.policy());
                run_mode(
                    &plan,
                    &settings,
                    Arc::new(selector),
                    &nats,
                    &names,
                    args,
                    &stop,
                )
                .await
            }
            SelectorKind::Local => {
                let selector = Arc::new(LocalSelector::new(mode, &cards, args.seed));
                let watched = selector.clone();
                let watch = watch_cards(etcd.clone(), &names, args.model.clone(), move |c| {
                    watched.workers_changed(c)
                });
                let report = run_mode(&plan, &settings, selector, &nats, &names, args, &stop).await;
                watch.abort();
                report
            }
            SelectorKind::Gateway => {
                let target = GatewayTarget {
                    url: args.gateway_url.clone().context("--gateway-url")?,
                    api_key: args.gateway_api_key.clone(),
                };
                let progress = Progress::new(
                    settings.mode.as_str(),
                    plan.len() as u64,
                    args.output.interactive(),
                );
                let report = drive_gateway(&plan, &settings, &target, &cards, &stop, |t| {
                    progress.update(t)
                })
                .await?;
                progress.finish();
                report
            }
        };
        tracing::info!(
            mode = %mode,
            completed = report.completed,
            errors = report.errors,
            hit_rate = report.hit_rate,
            ttft_p50_ms = report.ttft_ms.p50,
            "mode done"
        );
        modes.push(report);
    }
    Ok(RunReport {
        trace: args.trace.display().to_string(),
        requests: plan.len() as u64,
        workers: cards.len() as u32,
        block_size,
        blocks_per_worker,
        speedup,
        oracle,
        ttft_floor_ms,
        session_oracle,
        selection_measured: match args.selector {
            SelectorKind::Gateway => super::report::SelectionMeasured::InGateway,
            SelectorKind::Router | SelectorKind::Local => {
                super::report::SelectionMeasured::NatsRoundTrip
            }
        },
        modes,
    })
}

async fn run_mode<S: Selector>(
    plan: &Plan,
    settings: &DriveSettings,
    selector: Arc<S>,
    nats: &async_nats::Client,
    names: &Names,
    args: &ReplayArgs,
    stop: &watch::Receiver<bool>,
) -> ModeReport {
    let progress = Progress::new(
        settings.mode.as_str(),
        plan.len() as u64,
        args.output.interactive(),
    );
    let report = drive(plan, settings, selector, nats.clone(), names, stop, |t| {
        progress.update(t)
    })
    .await;
    progress.finish();
    report
}

/// Prints the report (a table, or only JSON with `--json`) and writes `--json-out` and
/// `--chart-out`.
pub fn emit(report: &RunReport, args: &OutputArgs) -> anyhow::Result<()> {
    let json = report.to_json();
    if let Some(path) = &args.json_out {
        std::fs::write(path, &json).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{}", render_table(report));
    }
    if let Some(path) = &args.chart_out {
        write_chart(report, path, &args.font)?;
    }
    Ok(())
}
