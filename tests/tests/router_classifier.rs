//! Request classifiers through real processes: `kvroute-router-custom` with the example's
//! `sticky-serial.yaml` (the `sticky-until-busy` policy and the `session-serial` classifier).
//! A session's second request, sent while its first runs, is deferred (it waits in the
//! admission queue, not answered); when the first finishes it is admitted with the worker the
//! classifier learned from `Sent` as its selection target, and the policy's picker honours it
//! although that worker is no longer the least loaded. The built-in `max-in-flight` holds a
//! partition at its limit.

use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::messages::{Pin, SelectRequest, SessionContext};
use kvroute_router::service::metrics as rm;
use kvroute_tests::series;
use kvroute_tests::{
    IndexerProcess, RouterProcess, TestEnv, expect_worker, fleet_worker, prompt_workers, request,
    send_select, workspace_root,
};
use uuid::Uuid;
const PARTITION: &[(&str, &str)] = &[("model", "m"), ("role", "aggregated")];
const CLASS_0: &[(&str, &str)] = &[("model", "m"), ("role", "aggregated"), ("class", "0")];

fn prompt(i: u32) -> Vec<u32> {
    (0..64).map(|t| i * 1_000 + t).collect()
}

fn in_session(i: u32, session: &str) -> SelectRequest {
    let mut r = request("m", prompt(i));
    r.request_id = Some(Uuid::from_u128(u128::from(i)));
    r.session = Some(SessionContext {
        id: session.into(),
        ..SessionContext::default()
    });
    r.queue_timeout_ms = Some(15_000);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_serial_defers_a_sessions_second_request_and_steers_it_to_its_worker() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let config = workspace_root().join("examples/custom-policy/sticky-serial.yaml");
    let router = RouterProcess::start_bin(
        &env,
        "kvroute-router-custom",
        "classified",
        // Bindings expire after 1 s idle, so by the time the second request is admitted the
        // session has none: only the classifier's target can bring it back to W.
        &[
            "--policy-config",
            config.to_str().unwrap(),
            "--session-affinity",
            "soft",
            "--session-idle-ttl-secs",
            "1",
        ],
    )
    .unwrap();
    let nats = env.nats.connect().await.unwrap();

    // The session's first request runs on some worker W.
    let first = expect_worker(
        send_select(&nats, names.select(), &in_session(1, "chat-1"))
            .await
            .unwrap(),
    );
    let w = first.worker_id;

    // Its second, sent while the first runs, is deferred: no answer.
    let second = send_select(&nats, names.select(), &in_session(2, "chat-1"));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        !second.is_finished(),
        "deferred while the session's first request runs"
    );
    assert_eq!(
        router.metric(&series(rm::names::QUEUE_DEFERRED, PARTITION)),
        1.0
    );

    // Make W the most loaded worker (two other requests pinned to it, below the policy's
    // busy threshold of 3): least-loaded alone would now pick another worker.
    for i in [10, 11] {
        let mut r = request("m", prompt(i));
        r.pin = Some(Pin {
            worker_id: w,
            dp_rank: None,
        });
        assert_eq!(
            expect_worker(send_select(&nats, names.select(), &r).await.unwrap()).worker_id,
            w
        );
    }
    // An unrelated request goes elsewhere (W is the busiest).
    let other = expect_worker(
        send_select(&nats, names.select(), &request("m", prompt(20)))
            .await
            .unwrap(),
    );
    assert_ne!(other.worker_id, w);

    // The first finishes: the second is admitted and sent where its session ran.
    fleet_worker(&fleet, w).finish(first.request_id, 8).await;
    let second = expect_worker(
        tokio::time::timeout(Duration::from_secs(10), second)
            .await
            .expect("admitted after the first finished")
            .unwrap(),
    );
    assert_eq!(
        second.worker_id, w,
        "the classifier's target (learned from Sent) was honoured"
    );
    assert_eq!(
        router.metric(&series(rm::names::QUEUE_DISPATCHED, CLASS_0)),
        1.0
    );
    // Another session is not held back by this one.
    let third = expect_worker(
        send_select(&nats, names.select(), &in_session(3, "chat-2"))
            .await
            .unwrap(),
    );
    assert!((1..=4).contains(&third.worker_id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_holds_a_model_at_its_limit() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let fleet = prompt_workers(&env, &[1, 2]).await;
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let config = env.nats.data_dir().join("max-in-flight.yaml");
    std::fs::write(
        &config,
        "request_classifier:\n  type: max-in-flight\n  parameters: {per_model: 2}\n",
    )
    .unwrap();
    let _router = RouterProcess::start(
        &env,
        "limited",
        &["--policy-config", config.to_str().unwrap()],
    )
    .unwrap();
    let nats = env.nats.connect().await.unwrap();
    let a = expect_worker(
        send_select(&nats, names.select(), &in_session(1, "a"))
            .await
            .unwrap(),
    );
    let _b = expect_worker(
        send_select(&nats, names.select(), &in_session(2, "b"))
            .await
            .unwrap(),
    );
    let c = send_select(&nats, names.select(), &in_session(3, "c"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!c.is_finished(), "a third request waits at the limit of 2");
    fleet_worker(&fleet, a.worker_id)
        .finish(a.request_id, 8)
        .await;
    let c = tokio::time::timeout(Duration::from_secs(10), c)
        .await
        .expect("admitted once one finished")
        .unwrap();
    expect_worker(c);
}
