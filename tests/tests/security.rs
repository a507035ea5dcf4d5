//! Least privilege against real servers: nats-server and etcd with TLS and scripts/gen-auth's
//! per-role users (PROTOCOL.md "Security"). A worker cannot speak for another worker, a client
//! cannot speak for routers or indexers, a process without credentials or with the wrong CA
//! stops with a message naming the flag, and the whole system selects with every process
//! under its own identity.

use std::time::{Duration, Instant};

use kvroute_common::messages::{KvEvent, KvEventBatch, KvEventData, SelectResponse};
use kvroute_common::{Names, Namespace, encode};
use kvroute_tests::{
    IndexerProcess, RouterProcess, Secrets, SimWorker, Supervised, TestEnv, expect_worker,
    kvroute_bin, request, run_to_exit, select,
};
use tokio::sync::mpsc::UnboundedReceiver;

const MODEL: &str = "m";

/// Waits up to `limit` for a server error on the connection that says permissions were
/// violated; returns its text.
async fn permission_violation(
    events: &mut UnboundedReceiver<async_nats::Event>,
    limit: Duration,
) -> Option<String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .ok()??;
        let text = event.to_string();
        if text.to_lowercase().contains("permissions violation") {
            return Some(text);
        }
    }
}

/// Whether `sub` receives a message within `limit`.
async fn receives(sub: &mut async_nats::Subscriber, limit: Duration) -> bool {
    use futures::StreamExt;
    tokio::time::timeout(limit, sub.next()).await.is_ok()
}

fn batch(worker_id: u64, events: Vec<KvEventData>) -> bytes::Bytes {
    let batch = KvEventBatch {
        v: Default::default(),
        worker_id,
        dp_rank: 0,
        events: events
            .into_iter()
            .enumerate()
            .map(|(i, data)| KvEvent {
                event_id: i as u64,
                data,
            })
            .collect(),
        ts: 0,
    };
    encode(&batch).unwrap()
}

/// Polls `f` until it is true or `limit` passes.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_cannot_publish_another_workers_events() {
    let env = TestEnv::start_secure(&[("w1", &[1]), ("w2", &[2])]).unwrap();
    let names = Names::new(&env.namespace);
    let indexer = IndexerProcess::start(&env, "ix-1", &as_args(&env, "indexer-1")).unwrap();
    assert!(
        eventually(Duration::from_secs(30), || indexer.is_ready()),
        "{}",
        indexer.log()
    );

    // Worker 1 under its own identity: its events reach the indexer.
    let w1 = SimWorker::start_as(&env, Some("w1"), 1, MODEL, 10)
        .await
        .unwrap();
    w1.store(&[11, 12]);
    assert!(
        eventually(Duration::from_secs(20), || {
            indexer.position().is_ok_and(|(seq, _)| seq >= 2)
        }),
        "{}",
        indexer.log()
    );
    std::thread::sleep(Duration::from_millis(500));
    let before = indexer.position().unwrap();

    // The same identity speaking for worker 2: refused by the server.
    let operator = env
        .nats_args_as("operator-1")
        .connect("operator")
        .await
        .unwrap();
    let mut spy = operator.subscribe(names.kv_events(2)).await.unwrap();
    operator.flush().await.unwrap();
    let (rogue, mut events) = env
        .nats_args_as("w1")
        .connect_observed("rogue")
        .await
        .unwrap();
    rogue
        .publish(
            names.kv_events(2),
            batch(2, vec![KvEventData::Cleared, kvroute_tests::stored(99)]),
        )
        .await
        .unwrap();
    rogue.flush().await.unwrap();
    let refusal = permission_violation(&mut events, Duration::from_secs(5)).await;
    let refusal = refusal.expect("the server reports a permissions violation");
    assert!(refusal.contains(&names.kv_events(2)), "{refusal}");
    assert!(!receives(&mut spy, Duration::from_millis(500)).await);
    // Nor as a load report, a request subject of worker 2, or a control record.
    rogue.publish(names.load(2), "x".into()).await.unwrap();
    rogue.publish(names.kv_control(), "x".into()).await.unwrap();
    assert!(rogue.subscribe(names.worker_requests(2)).await.is_ok());
    rogue.flush().await.unwrap();
    for _ in 0..3 {
        assert!(
            permission_violation(&mut events, Duration::from_secs(5))
                .await
                .is_some()
        );
    }

    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        indexer.position().unwrap(),
        before,
        "the indexers' state is unchanged"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_cannot_publish_decisions_or_control_records() {
    let env = TestEnv::start_secure(&[("w1", &[1])]).unwrap();
    let names = Names::new(&env.namespace);
    let router = env.nats_args_as("router-1").connect("r").await.unwrap();
    // Indexers read control records from the stream; the operator listens for them here.
    let indexer = env.nats_args_as("operator-1").connect("o").await.unwrap();
    let mut decisions = router.subscribe(names.decisions()).await.unwrap();
    let mut control = indexer.subscribe(names.kv_control()).await.unwrap();
    router.flush().await.unwrap();
    indexer.flush().await.unwrap();

    let (client, mut events) = env
        .nats_args_as("client-1")
        .connect_observed("client")
        .await
        .unwrap();
    client
        .publish(names.decisions(), "forged".into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    assert!(
        permission_violation(&mut events, Duration::from_secs(5))
            .await
            .is_some()
    );
    client
        .publish(names.kv_control(), "forged".into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    assert!(
        permission_violation(&mut events, Duration::from_secs(5))
            .await
            .is_some()
    );
    // A client may not listen to decisions either, nor to another identity's replies.
    client.subscribe(names.decisions()).await.unwrap();
    client.subscribe("_INBOX.router-1.>").await.unwrap();
    client.flush().await.unwrap();
    for _ in 0..2 {
        assert!(
            permission_violation(&mut events, Duration::from_secs(5))
                .await
                .is_some()
        );
    }
    assert!(!receives(&mut decisions, Duration::from_millis(500)).await);
    assert!(!receives(&mut control, Duration::from_millis(100)).await);

    // The subscribers do hear their own roles (so the silence above means something).
    router
        .publish(names.decisions(), "real".into())
        .await
        .unwrap();
    let real_indexer = env.nats_args_as("indexer-1").connect("i").await.unwrap();
    real_indexer
        .publish(names.kv_control(), "real".into())
        .await
        .unwrap();
    real_indexer.flush().await.unwrap();
    assert!(receives(&mut decisions, Duration::from_secs(5)).await);
    assert!(receives(&mut control, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_cannot_delete_another_workers_card() {
    let env = TestEnv::start_secure(&[("w1", &[1]), ("w2", &[2])]).unwrap();
    let names = Names::new(&env.namespace);
    let _w1 = SimWorker::start_as(&env, Some("w1"), 1, MODEL, 10)
        .await
        .unwrap();
    let mut w2 = env.etcd_args_as("w2").connect().await.unwrap();
    let refused = w2.delete(names.worker_key(1), None).await.unwrap_err();
    assert!(
        refused.to_string().contains("permission denied"),
        "{refused}"
    );
    let refused = w2
        .put(names.worker_key(1), "forged", None)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("permission denied"),
        "{refused}"
    );
    // Its own key it may write; the router identity only reads.
    w2.put(names.worker_key(2), "x", None).await.unwrap();
    let mut router = env.etcd_args_as("router-1").connect().await.unwrap();
    let card = router.get(names.worker_key(1), None).await.unwrap();
    assert_eq!(card.kvs().len(), 1, "worker 1's card is still there");
    assert!(router.delete(names.worker_key(1), None).await.is_err());
}

/// The flags that make a process `user`, as `&str`s for the harness's `extra`.
fn as_args(env: &TestEnv, user: &str) -> Vec<&'static str> {
    env.identity_args(user)
        .into_iter()
        .map(|s| &*Box::leak(s.into_boxed_str()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn without_credentials_or_with_the_wrong_ca_startup_stops_naming_the_flag() {
    let env = TestEnv::start_secure(&[]).unwrap();
    let bin = kvroute_bin("kvroute-indexer", "kvroute-indexer").unwrap();
    let limit = Duration::from_secs(30);
    let base = env.server_args();
    let nats_ca = env.nats.args().tls.ca.unwrap().display().to_string();
    let etcd_ca = env.etcd.args().tls.ca.unwrap().display().to_string();

    // TLS but no user: NATS refuses; status BadConfig (2).
    let mut args = base.clone();
    args.extend(["--nats-tls-ca".into(), nats_ca.clone()]);
    let out = run_to_exit(&bin, &args, &[], limit).unwrap();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.last_line().contains("--nats-user"), "{}", out.stderr);

    // A CA of another deployment: the handshake fails, naming --nats-tls-ca.
    let other = Secrets::generate(&Namespace::new("other").unwrap(), &[]).unwrap();
    let wrong_ca = other.path("ca.pem").display().to_string();
    let mut args = base.clone();
    args.extend(env.identity_args("indexer-1"));
    args.extend(["--nats-tls-ca".into(), wrong_ca.clone()]);
    let out = run_to_exit(&bin, &args, &[], limit).unwrap();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.last_line().contains("--nats-tls-ca"), "{}", out.stderr);

    // Right NATS identity, wrong etcd CA.
    let mut args = base.clone();
    args.extend(env.identity_args("indexer-1"));
    args.extend(["--etcd-tls-ca".into(), wrong_ca]);
    let out = run_to_exit(&bin, &args, &[], limit).unwrap();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.last_line().contains("--etcd-tls-ca"), "{}", out.stderr);

    // etcd without a user: refused, naming the flag.
    let mut args = base;
    args.extend(env.identity_args("indexer-1"));
    args.extend(["--etcd-user".into(), "nobody".into()]);
    args.extend(["--etcd-password".into(), "wrong".into()]);
    args.extend(["--etcd-tls-ca".into(), etcd_ca]);
    let out = run_to_exit(&bin, &args, &[], limit).unwrap();
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.last_line().contains("--etcd-user"), "{}", out.stderr);
    let _ = nats_ca;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_whole_system_selects_with_every_process_under_its_own_identity() {
    let env = TestEnv::start_secure(&[("fleet", &[100, 101])]).unwrap();
    let names = Names::new(&env.namespace);
    let indexer = IndexerProcess::start(&env, "ix-1", &as_args(&env, "indexer-1")).unwrap();
    assert!(
        eventually(Duration::from_secs(30), || indexer.is_ready()),
        "{}",
        indexer.log()
    );
    let mut mocker_args = env.server_args();
    mocker_args.extend(env.identity_args("fleet"));
    mocker_args.extend(
        [
            "--workers",
            "2",
            "--worker-id-start",
            "100",
            "--model",
            MODEL,
            "--no-create-stream",
        ]
        .map(String::from),
    );
    let mocker = Supervised::new(
        kvroute_bin("kvroute-mocker", "kvroute-mocker").unwrap(),
        mocker_args,
        env.nats.data_dir().join("mocker.log"),
    );
    let _mocker = mocker.spawn().unwrap();
    let router = RouterProcess::start(&env, "r-1", &as_args(&env, "router-1")).unwrap();
    // A second replica with its own replica of the index (it reads the events stream), under
    // the same role.
    let mut local = as_args(&env, "router-1");
    local.extend(["--overlap-mode", "local"]);
    let router_local = RouterProcess::start(&env, "r-2", &local).unwrap();

    let client = env
        .nats_args_as("client-1")
        .connect("client")
        .await
        .unwrap();
    let tokens: Vec<u32> = (0..64).collect();
    let start = Instant::now();
    let reply = loop {
        match select(&client, &names, &request(MODEL, tokens.clone())).await {
            Ok(response @ SelectResponse::Ok(_)) => break expect_worker(response),
            other if start.elapsed() > Duration::from_secs(30) => panic!(
                "no selection: {other:?}\nrouter:\n{}\nmocker:\n{}",
                router.log(),
                std::fs::read_to_string(&mocker.log).unwrap_or_default()
            ),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    assert!([100, 101].contains(&reply.worker_id), "{reply:?}");
    // The events of the fleet's workers reach the indexer over its TLS connection.
    assert!(
        eventually(Duration::from_secs(20), || {
            indexer.position().is_ok_and(|(seq, _)| seq >= 2)
        }),
        "{}",
        indexer.log()
    );
    // Nothing any process did was refused: each role's permissions cover what it does.
    std::thread::sleep(Duration::from_secs(1));
    let mocker_log = std::fs::read_to_string(&mocker.log).unwrap_or_default();
    for (who, log) in [
        ("indexer", indexer.log()),
        ("router", router.log()),
        ("router-local", router_local.log()),
        ("mocker", mocker_log),
    ] {
        assert!(
            !log.contains("Permissions Violation"),
            "{who} was refused something:\n{log}"
        );
    }
}
