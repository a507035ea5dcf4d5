//! Policy configuration of the router binaries: the example custom policy selected through
//! YAML changes the outcome, and bad YAML stops startup with a message naming the problem.

use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::messages::{ErrorCode, SelectResponse, StorageTier};
use kvroute_tests::{
    IndexerProcess, PromptWorker, RouterProcess, TestEnv, request, router_exit, router_exit_with,
    select, worker_card,
};

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| seed * 100_000 + i).collect()
}

fn yaml(env: &TestEnv, name: &str, text: &str) -> String {
    let path = env.nats.data_dir().join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

const STICKY: &str = "worker_selection:
  aggregated: sticky
  instances:
    - name: sticky
      type: sticky-until-busy
      parameters:
        busy_threshold: 4
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_policy_selected_through_yaml_changes_the_outcome() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix", &[]).unwrap();
    let mut workers = Vec::new();
    for id in [1, 2] {
        workers.push(
            PromptWorker::start(&env, worker_card(&names, id, "m"), 10)
                .await
                .unwrap(),
        );
    }
    let tokens = prompt(1, 8);
    workers[1].store_prompt(&tokens).await;
    // Asked one token longer than stored: all 8 stored blocks count as overlap.
    let tokens = kvroute_tests::continuing(&tokens);
    let nats = env.nats.connect().await.unwrap();

    // The built-in default follows the cache: worker 2.
    let mut stock = RouterProcess::start(&env, "stock", &[]).unwrap();
    let start = std::time::Instant::now();
    loop {
        let SelectResponse::Ok(r) = select(&nats, &names, &request("m", tokens.clone()))
            .await
            .unwrap()
        else {
            panic!("selection failed");
        };
        if r.overlap_blocks.get(&StorageTier::Device) == Some(&8) {
            assert_eq!(r.worker_id, 2);
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stock.stop().unwrap();

    // sticky-until-busy ignores the cache: fewest active requests, ties to the lowest id.
    let path = yaml(&env, "sticky.yaml", STICKY);
    let _custom = RouterProcess::start_bin(
        &env,
        "kvroute-router-custom",
        "custom",
        &["--policy-config", &path],
    )
    .unwrap();
    let SelectResponse::Ok(r) = select(&nats, &names, &request("m", tokens.clone()))
        .await
        .unwrap()
    else {
        panic!("selection failed");
    };
    assert_eq!((r.worker_id, r.policy.as_str()), (1, "sticky"));

    // A request naming the type itself is told which parameter it lacks.
    let mut by_type = request("m", tokens);
    by_type.policy = Some("sticky-until-busy".into());
    let SelectResponse::Error(e) = select(&nats, &names, &by_type).await.unwrap() else {
        panic!("a type that needs parameters cannot be selected by name");
    };
    assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
    assert!(
        e.message.contains("parameter `busy_threshold` is required"),
        "{e:?}"
    );
}

#[tokio::test]
async fn bad_policy_configuration_stops_startup_with_a_clear_message() {
    let env = TestEnv::start().unwrap();
    let cases = [
        // The stock binary does not link the example's type.
        (
            "kvroute-router",
            "unknown.yaml",
            STICKY,
            "unknown type \"sticky-until-busy\"",
        ),
        (
            "kvroute-router",
            "dup.yaml",
            "worker_selection:\n  instances:\n    - {name: a, type: random}\n    - {name: a, type: least-busy}\n",
            "\"a\" is configured more than once",
        ),
        (
            "kvroute-router-custom",
            "param.yaml",
            "worker_selection:\n  instances:\n    - name: s\n      type: sticky-until-busy\n      parameters: {busy_threshold: 5, max_active_requests: 2}\n",
            "max_active_requests (2) must be above busy_threshold (5)",
        ),
        (
            "kvroute-router",
            "typo.yaml",
            "worker_selection:\n  agregated: random\n",
            "agregated",
        ),
        // Request classifiers: an unknown type, a bad parameter of the example's, and of a
        // built-in's.
        (
            "kvroute-router",
            "classifier-type.yaml",
            "request_classifier:\n  type: session-serial\n",
            "session-serial",
        ),
        (
            "kvroute-router-custom",
            "classifier-param.yaml",
            "request_classifier:\n  type: session-serial\n  parameters: {max_in_flight_per_session: 0}\n",
            "max_in_flight_per_session",
        ),
        (
            "kvroute-router",
            "classifier-builtin.yaml",
            "request_classifier:\n  type: max-in-flight\n  parameters: {per_model: -1}\n",
            "per_model",
        ),
    ];
    for (bin, file, text, expected) in cases {
        let path = yaml(&env, file, text);
        let (code, stderr) = router_exit(&env, bin, &["--policy-config", &path]).unwrap();
        assert_eq!(code, 2, "{bin} {file}: {stderr}");
        assert!(stderr.contains(expected), "{bin} {file}: {stderr}");
    }
    let (code, stderr) =
        router_exit(&env, "kvroute-router", &["--decode-policy", "nonexistent"]).unwrap();
    assert_eq!(code, 2);
    assert!(stderr.contains("nonexistent"), "{stderr}");

    // Each selection error names exactly where its value came from.
    let (code, stderr) = router_exit(
        &env,
        "kvroute-router",
        &["--worker-selection-policy", "bogus"],
    )
    .unwrap();
    assert_eq!(code, 2);
    assert!(
        stderr.contains("(from --worker-selection-policy)"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("--policy-config") && !stderr.contains("KVROUTE_"),
        "{stderr}"
    );
    let (code, stderr) = router_exit_with(
        &env,
        "kvroute-router",
        &[],
        &[("KVROUTE_DECODE_POLICY", "bogus")],
    )
    .unwrap();
    assert_eq!(code, 2);
    assert!(stderr.contains("(from KVROUTE_DECODE_POLICY)"), "{stderr}");
    // Selecting a type that needs parameters names the flag and the parameter.
    let (code, stderr) = router_exit(
        &env,
        "kvroute-router-custom",
        &["--prefill-policy", "sticky-until-busy"],
    )
    .unwrap();
    assert_eq!(code, 2);
    assert!(stderr.contains("(from --prefill-policy)"), "{stderr}");
    assert!(
        stderr.contains("parameter `busy_threshold` is required"),
        "{stderr}"
    );
    let (code, stderr) =
        router_exit(&env, "kvroute-router", &["--index-query-timeout-ms", "0"]).unwrap();
    assert_eq!(code, 2);
    assert!(stderr.contains("--index-query-timeout-ms"), "{stderr}");
}
