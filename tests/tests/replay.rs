//! kvroute-replay against a real mocker fleet on real servers: KV-aware selection beats
//! round-robin on a trace with shared prefixes, the report's JSON and chart are written, and a
//! worker dying mid-run costs counted errors while routing moves on.
//!
//! The first tests use the replay tool's in-process selector (`--selector local`); then the
//! same comparison runs through two `kvroute-router` replicas, and a run whose requests all
//! fail (no router) makes the binary exit 3.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use kvroute_common::Names;
use kvroute_lab::replay::{self, DEFAULT_FONT, ReplayArgs, RunReport};
use kvroute_mocker::fleet::{EngineArgs, Fleet, FleetConfig, StopMode};
use kvroute_tests::TestEnv;

/// A fleet of `workers` mocker workers in this process, registered in `env`.
async fn start_fleet(env: &TestEnv, names: &Names, workers: u32, speedup: f64) -> Fleet {
    Fleet::start(
        &fleet_config(workers, speedup),
        env.nats.connect().await.unwrap(),
        env.etcd.connect().await.unwrap(),
        names,
    )
    .await
    .unwrap()
}

fn fleet_config(workers: u32, speedup: f64) -> FleetConfig {
    FleetConfig {
        workers,
        worker_id_start: 1,
        model: "m".into(),
        engine: EngineArgs {
            block_size: 64,
            num_blocks: 1024,
            ..EngineArgs::default()
        },
        speedup,
        lease_ttl_secs: 2,
        load_interval_ms: 100,
        ..FleetConfig::default()
    }
}

/// `n` requests `spacing_ms` apart; request `i` reads document `i % docs` (a 4-block shared
/// prefix of 512-token trace blocks) and then a block of its own.
fn write_trace(dir: &Path, n: u64, docs: u64, spacing_ms: u64) -> PathBuf {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let d = i % docs;
            let ids: Vec<String> = (0..4)
                .map(|k| (d * 100 + k).to_string())
                .chain([(10_000 + i).to_string()])
                .collect();
            format!(
                r#"{{"timestamp": {}, "input_length": 2460, "output_length": 8, "hash_ids": [{}]}}"#,
                i * spacing_ms,
                ids.join(", ")
            )
        })
        .collect();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn args(env: &TestEnv, trace: &Path, extra: &[&str]) -> ReplayArgs {
    let mut all: Vec<String> = [
        "kvroute-replay",
        "--trace",
        &trace.display().to_string(),
        "--limit",
        "0",
        "--model",
        "m",
        "--quiet",
        "--namespace",
        env.namespace.as_str(),
        "--nats-url",
        &env.nats.url(),
        "--etcd-endpoints",
        &env.etcd.endpoint(),
    ]
    .map(str::to_owned)
    .to_vec();
    all.extend(extra.iter().map(|s| s.to_string()));
    ReplayArgs::try_parse_from(all).unwrap()
}

/// The `kvroute-replay` binary on `trace` against `env`'s servers (model `m`, settle 100 ms),
/// with `extra` flags.
fn replay_command(env: &TestEnv, trace: &Path, extra: &[&str]) -> std::process::Command {
    let bin = kvroute_tests::kvroute_bin("kvroute-lab", "kvroute-replay").unwrap();
    let mut command = std::process::Command::new(bin);
    command
        .args(env.server_args())
        .args(["--trace", &trace.display().to_string()])
        .args(["--limit", "0", "--model", "m", "--settle-ms", "100"])
        .args(extra);
    command
}

#[tokio::test]
async fn kv_selection_beats_round_robin_and_the_report_is_written() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let fleet = start_fleet(&env, &names, 3, 50.0).await;
    let dir = tempfile::tempdir().unwrap();
    let trace = write_trace(dir.path(), 48, 8, 200);
    let json_out = dir.path().join("report.json");
    let chart_out = dir.path().join("report.png");
    let json = json_out.display().to_string();
    let chart = chart_out.display().to_string();
    let mut extra = vec![
        "--settle-ms",
        "100",
        "--selector",
        "local",
        "--modes",
        "kv,round-robin",
        "--json-out",
        &json,
    ];
    let font = Path::new(DEFAULT_FONT).is_file();
    if font {
        extra.extend(["--chart-out", &chart]);
    }
    let args = args(&env, &trace, &extra);
    let report = replay::run(&args).await.unwrap();
    replay::emit(&report, &args.output).unwrap();
    fleet.shutdown().await;

    assert_eq!((report.requests, report.workers), (48, 3));
    assert_eq!(report.speedup, 50.0, "read from the workers' cards");
    let (kv, rr) = (&report.modes[0], &report.modes[1]);
    eprintln!("hit rate: kv {}, round-robin {}", kv.hit_rate, rr.hit_rate);
    assert_eq!((kv.mode.as_str(), rr.mode.as_str()), ("kv", "round-robin"));
    for m in [kv, rr] {
        assert_eq!((m.completed, m.errors), (48, 0), "{m:?}");
        assert!(m.ttft_ms.p50 > 0.0 && m.selection_latency_us.count == 48);
    }
    assert!(
        kv.hit_rate > rr.hit_rate + 0.1,
        "kv {} vs round-robin {}",
        kv.hit_rate,
        rr.hit_rate
    );
    assert!(rr.hit_rate > 0.0, "round-robin still reuses some prefixes");
    assert!(kv.hit_rate <= report.oracle.infinite + 1e-9);
    assert!(
        rr.load_cv_requests < 1e-9,
        "round-robin spreads evenly: {}",
        rr.load_cv_requests
    );

    let written: RunReport =
        serde_json::from_str(&std::fs::read_to_string(&json_out).unwrap()).unwrap();
    assert_eq!(written.modes.len(), 2);
    assert_eq!(written.modes[0].completed, 48);
    if font {
        let png = std::fs::read(&chart_out).unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }
}

#[tokio::test]
async fn a_worker_dying_mid_run_is_counted_and_routing_moves_on() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    // Real time (speedup 1): 80 requests over 8 s; worker 2 dies after about 1 s.
    let mut fleet = start_fleet(&env, &names, 3, 1.0).await;
    let dir = tempfile::tempdir().unwrap();
    let trace = write_trace(dir.path(), 80, 80, 100);
    let args = args(
        &env,
        &trace,
        &[
            "--settle-ms",
            "100",
            "--selector",
            "local",
            "--modes",
            "round-robin",
            "--request-timeout-secs",
            "3",
        ],
    );
    let run = tokio::spawn(async move { replay::run(&args).await });
    // Crash worker 2 once the run is under way (10 of the 80 requests received), whatever
    // the reset, the settle time and this machine's speed took before that.
    let started = std::time::Instant::now();
    while fleet.metrics().requests_received.get() < 10 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the replay sends its first requests"
        );
        assert!(!run.is_finished(), "the replay ended before the crash");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(fleet.stop_worker(2, StopMode::Crash).await);
    let report = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the replay finishes")
        .unwrap()
        .unwrap();
    fleet.shutdown().await;

    let m = &report.modes[0];
    eprintln!("errors {:?}, completed {}", m.errors_by_kind, m.completed);
    assert_eq!(m.completed + m.errors, 80, "every request is accounted for");
    assert!(m.errors > 0, "requests sent to the dead worker fail: {m:?}");
    for kind in m.errors_by_kind.keys() {
        assert!(
            ["worker_unreachable", "worker_timeout", "worker_cancelled"].contains(&kind.as_str()),
            "{kind}"
        );
    }
    // Round-robin would lose a third of the ~70 requests after the crash if routing stayed
    // on the dead worker; once its lease expires (2 s) it gets no more.
    assert!(m.errors < 20, "routing moved on: {:?}", m.errors_by_kind);
}

/// The same comparison through two `kvroute-router` replicas with remote overlap from an
/// indexer (the replay asks for each mode's policy with `SelectRequest.policy`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_router_every_mode_runs_and_kv_beats_round_robin() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = kvroute_tests::IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let fleet = start_fleet(&env, &names, 3, 50.0).await;
    let dir = tempfile::tempdir().unwrap();
    let routers: Vec<_> = ["r1", "r2"]
        .iter()
        .map(|id| kvroute_tests::RouterProcess::start(&env, id, &[]).unwrap())
        .collect();
    let trace = write_trace(dir.path(), 48, 8, 200);
    let args = args(&env, &trace, &["--settle-ms", "1000"]);
    let report = replay::run(&args).await.unwrap();
    drop(routers);
    fleet.shutdown().await;
    assert_eq!(report.modes.len(), 4);
    for m in &report.modes {
        assert_eq!((m.completed, m.errors), (48, 0), "{m:?}");
    }
    assert!(report.modes[0].hit_rate > report.modes[1].hit_rate);
}

/// A failed run fails: with workers registered but no router answering, every selection fails
/// and `kvroute-replay` exits 3 (its error threshold), saying how many requests failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_requests_fail_exits_non_zero() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let fleet = start_fleet(&env, &names, 1, 50.0).await;
    let dir = tempfile::tempdir().unwrap();
    let trace = write_trace(dir.path(), 20, 4, 10);
    let mut command = replay_command(
        &env,
        &trace,
        &[
            "--quiet",
            "--modes",
            "kv",
            "--select-attempts",
            "2",
            "--select-attempt-timeout-ms",
            "100",
        ],
    );
    let out = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    fleet.shutdown().await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("mode kv: 20 of 20 requests failed (select_no_router 20)"),
        "{stderr}"
    );
    assert!(stderr.contains("--max-error-fraction 0.01"), "{stderr}");
    // The report was printed all the same.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("kv"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// SIGTERM stops a run early: the binary sends no more requests, waits for those it sent,
/// prints its report (exit 0) with the rest counted as not sent, and runs no later mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_run_and_reports_what_ran() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    // Real time (speedup 1): 200 requests 100 ms apart, a 20-s run, stopped after ~10.
    let fleet = start_fleet(&env, &names, 2, 1.0).await;
    let dir = tempfile::tempdir().unwrap();
    let trace = write_trace(dir.path(), 200, 8, 100);
    let child = replay_command(
        &env,
        &trace,
        &["--json", "--selector", "local", "--modes", "kv,round-robin"],
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let started = std::time::Instant::now();
    while fleet.metrics().requests_received.get() < 10 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the replay sends its first requests"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let stopped = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let took = stopped.elapsed();
    let received = fleet.metrics().requests_received.get();
    fleet.shutdown().await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        took < Duration::from_secs(5),
        "it stops within a request's time, not the run's: {took:?}"
    );
    assert!(stderr.contains("stopping"), "{stderr}");
    let report: RunReport = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report.modes.len(), 1, "round-robin did not run: {report:?}");
    let m = &report.modes[0];
    assert_eq!(m.completed + m.errors + m.not_sent, 200, "{m:?}");
    assert_eq!(m.errors, 0, "{m:?}");
    assert_eq!(m.completed, received, "every request sent was waited for");
    assert!(m.not_sent > 100, "{m:?}");
}

/// A generated session trace through a `kvroute-router`: with sessions sent, every later turn
/// of a session lands on its first turn's worker (also under round-robin, whose picks the
/// binding overrides) and finds its conversation cached; without them, round-robin scatters
/// the turns — so the stickiness figure can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_sent_stick_to_one_worker_through_the_router() {
    use kvroute_lab::tracegen::{SessionTraceParams, TokenRange, generate, write_trace};

    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = kvroute_tests::IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let fleet = start_fleet(&env, &names, 3, 50.0).await;
    let router = kvroute_tests::RouterProcess::start(&env, "r1", &[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("sessions.jsonl");
    let params = SessionTraceParams {
        sessions: 16,
        turns: TokenRange::new(5, 6),
        templates: 3,
        template_blocks: TokenRange::new(2, 2),
        user_tokens: TokenRange::new(100, 400),
        reply_tokens: TokenRange::new(20, 60),
        session_rate: 4.0,
        think_time_secs: 2.0,
        ..SessionTraceParams::default()
    };
    let requests = generate(&params);
    write_trace(&requests, &trace).unwrap();
    let n = requests.len() as u64;
    let run = |extra: &[&str]| {
        let mut all = vec!["--settle-ms", "1000", "--modes"];
        all.extend_from_slice(extra);
        args(&env, &trace, &all)
    };
    let sent = replay::run(&run(&["kv,round-robin"])).await.unwrap();
    let unsent = replay::run(&run(&["round-robin", "--no-sessions"]))
        .await
        .unwrap();
    fleet.shutdown().await;
    // Each mode's sessions were new to the router (bindings outlive a mode; the replay scopes
    // the ids), and every later turn kept its binding.
    let binding = |state: &str| {
        router.metric(&kvroute_tests::labelled(
            kvroute_router::service::metrics::labels::SESSIONS,
            state,
        ))
    };
    // A first turn whose attempt expired after its binding was committed (a loaded machine)
    // is retried and then finds its binding kept: one "new" fewer per retry, never more.
    let retried = router.metric("kvroute_router_retries_received_total");
    let (new, kept) = (binding("new"), binding("kept"));
    assert_eq!(new + kept, 2.0 * n as f64, "new {new} kept {kept}");
    assert!(
        new <= 32.0 && new >= 32.0 - retried,
        "new {new}, retried {retried}: each mode's 16 sessions are new to the router"
    );

    let oracle = sent.session_oracle.clone().expect("the trace has sessions");
    let finite = oracle.finite.unwrap();
    let modes = sent.modes.iter().chain(&unsent.modes);
    for m in modes {
        assert_eq!((m.completed, m.errors), (n, 0), "{m:?}");
        eprintln!("{} {:?} (finite oracle {finite})", m.mode, m.sessions);
    }
    let (kv, rr) = (
        sent.modes[0].sessions.clone().unwrap(),
        sent.modes[1].sessions.clone().unwrap(),
    );
    let scattered = unsent.modes[0].sessions.clone().unwrap();
    assert_eq!(kv.sessions, 16);
    for s in [&kv, &rr] {
        assert!(s.sent);
        assert!(s.stickiness.unwrap() >= 0.98, "{s:?}");
        assert!(
            s.later_hit_rate.unwrap() >= 0.9 * finite,
            "{s:?} vs {oracle:?}"
        );
    }
    assert!(!scattered.sent);
    // Five or six turns on three workers, taken in turn with the other sessions' requests.
    assert!(scattered.stickiness.unwrap() < 0.75, "{scattered:?}");
    assert!(
        scattered.later_hit_rate.unwrap() < rr.later_hit_rate.unwrap(),
        "{scattered:?} vs {rr:?}"
    );
    assert!(
        replay::render_table(&sent).contains("sticky"),
        "{}",
        replay::render_table(&sent)
    );
}
