//! The custom-policy walkthrough run the way its README says: a mocker fleet with its default
//! load reports, `kvroute-router-custom` with `sticky.yaml` and soft session affinity, and one
//! session whose requests keep running on their worker. The session stays while its worker
//! runs at most `busy_threshold` (3) requests and moves at the fourth — which needs the router
//! to count each running request once, whatever the workers' report interval.

use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::codec::encode;
use kvroute_common::messages::{GenerateRequest, SelectRequest, SelectResponse, SessionContext};
use kvroute_tests::{
    RouterProcess, Supervised, TestEnv, free_port, http_get, kvroute_bin, select, workspace_root,
};
use uuid::Uuid;

fn start_mocker(env: &TestEnv, workers: u32) -> kvroute_tests::ChildGuard {
    let bin = kvroute_bin("kvroute-mocker", "kvroute-mocker").unwrap();
    let http_port = free_port();
    let mut args = env.server_args();
    args.extend([
        "--workers".to_owned(),
        workers.to_string(),
        "--http-addr".to_owned(),
        format!("127.0.0.1:{http_port}"),
    ]);
    let spec = Supervised::new(bin, args, env.nats.data_dir().join("mocker.log"));
    let child = spec.spawn().unwrap();
    let start = std::time::Instant::now();
    while !matches!(http_get(http_port, "/readyz"), Some((200, _))) {
        assert!(start.elapsed() < Duration::from_secs(30), "mocker ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

/// The walkthrough's processes: 2 mocker workers, and `kvroute-router-custom` with `sticky.yaml`
/// and soft affinity, once it knows both workers. Default flags otherwise: the router assumes
/// 1 s report intervals, the mocker reports every 200 ms and on change.
async fn start_walkthrough(env: &TestEnv) -> (kvroute_tests::ChildGuard, RouterProcess) {
    let mocker = start_mocker(env, 2);
    let yaml = workspace_root().join("examples/custom-policy/sticky.yaml");
    let router = RouterProcess::start_bin(
        env,
        "kvroute-router-custom",
        "walkthrough",
        &[
            "--policy-config",
            yaml.to_str().unwrap(),
            "--session-affinity",
            "soft",
        ],
    )
    .unwrap();
    let start = std::time::Instant::now();
    while router.metric("kvroute_router_workers") < 2.0 {
        assert!(start.elapsed() < Duration::from_secs(20), "workers seen");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (mocker, router)
}

#[tokio::test]
async fn a_soft_session_stays_until_its_worker_runs_more_than_busy_threshold() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = start_walkthrough(&env).await;
    let nats = env.nats.connect().await.unwrap();
    let mut seen = Vec::new();
    for i in 0..5u32 {
        let tokens: Vec<u32> = (0..64).map(|t| i * 1_000 + t).collect();
        let request = SelectRequest {
            request_id: Some(Uuid::new_v4()),
            model: "mock-model".into(),
            token_ids: Some(tokens.clone()),
            session: Some(SessionContext {
                id: "chat-1".into(),
                ..SessionContext::default()
            }),
            ..SelectRequest::default()
        };
        let SelectResponse::Ok(reply) = select(&nats, &names, &request).await.unwrap() else {
            panic!("selection {i} failed");
        };
        seen.push((
            reply.worker_id,
            reply.cost.terms.get("active_requests").copied(),
        ));
        // The request runs (a long answer at real speed) on the chosen worker; its reply is
        // not awaited.
        let generate = GenerateRequest {
            request_id: request.request_id.unwrap(),
            token_ids: Some(tokens),
            max_tokens: 100_000,
            ..GenerateRequest::default()
        };
        let inbox = nats.new_inbox();
        nats.publish_with_reply(
            reply.request_subject.clone(),
            inbox,
            encode(&generate).unwrap(),
        )
        .await
        .unwrap();
        nats.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let first = seen[0].0;
    let expected: Vec<_> = (0..4).map(|n| (first, Some(f64::from(n)))).collect();
    assert_eq!(
        &seen[..4],
        &expected[..],
        "one worker, costs 0, 1, 2, 3: {seen:?}"
    );
    assert_ne!(seen[4].0, first, "the fifth request moves: {seen:?}");
}

/// `kvroute-sim-custom` runs the same YAML offline (the stock simulator cannot: it does not
/// link the type), and both custom binaries name their policy types in `--help`.
#[test]
fn the_custom_catalog_runs_offline_and_is_named_in_help() {
    let yaml = workspace_root().join("examples/custom-policy/sticky.yaml");
    let trace = workspace_root().join("../shared/traces/conversation_trace.jsonl");
    let sim = |bin: &str, yaml: Option<&std::path::Path>| {
        let program = kvroute_bin("kvroute-example-custom-policy", bin).unwrap();
        let mut cmd = std::process::Command::new(program);
        cmd.args(["--modes", "kv", "--limit", "1000", "--json", "--trace"])
            .arg(&trace);
        if let Some(yaml) = yaml {
            cmd.arg("--policy-config").arg(yaml);
        }
        cmd.output().unwrap()
    };
    let hit_rate = |out: &std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        report["modes"][0]["hit_rate"].as_f64().unwrap()
    };
    let sticky = hit_rate(&sim("kvroute-sim-custom", Some(&yaml)));
    let default = hit_rate(&sim("kvroute-sim-custom", None));
    assert!(
        default > sticky * 2.0,
        "sticky-until-busy ignores the cache: hit {sticky} against the default's {default}"
    );
    let stock = kvroute_bin("kvroute-lab", "kvroute-sim").unwrap();
    let refused = std::process::Command::new(stock)
        .args(["--modes", "kv", "--limit", "10", "--policy-config"])
        .arg(&yaml)
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("unknown type \"sticky-until-busy\""),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    for bin in ["kvroute-router-custom", "kvroute-sim-custom"] {
        let program = kvroute_bin("kvroute-example-custom-policy", bin).unwrap();
        let help = std::process::Command::new(program)
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        assert!(help.contains(&format!("Usage: {bin}")), "{help}");
        assert!(
            help.contains("sticky-until-busy"),
            "{bin} --help names its policy:\n{help}"
        );
    }
}

/// The walkthrough's "Run it" commands as written: the Python client runs five requests of one
/// session, 0.6 s apart, on the workers the router picks.
#[tokio::test]
async fn the_walkthrough_commands_show_the_session_move() {
    let env = TestEnv::start().unwrap();
    let _fleet = start_walkthrough(&env).await;
    let script = workspace_root().join("examples/python/kvroute_client.py");
    let args = [
        "--nats-url".to_owned(),
        env.nats.url(),
        "--namespace".to_owned(),
        env.namespace.to_string(),
        "--session-id".to_owned(),
        "chat-1".to_owned(),
        "--count".to_owned(),
        "5".to_owned(),
        "--interval".to_owned(),
        "0.6".to_owned(),
        "--run".to_owned(),
        "100000".to_owned(),
        "--json".to_owned(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let workers: Vec<u64> = summary["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_u64().unwrap())
        .collect();
    assert_eq!(workers.len(), 5, "{summary}");
    assert!(
        workers[..4].iter().all(|w| *w == workers[0]) && workers[4] != workers[0],
        "four on one worker, the fifth moves: {summary}"
    );
}
