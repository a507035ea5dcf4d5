//! Retries through the router service: a request past its deadline is dropped without a
//! decision or a charge, a retry of a decided request gets the same decision from any
//! replica, a replica's own decisions echoed back are no duplicates (another replica's seen
//! twice is one), and a replica only takes requests while it is in the queue group.

use std::time::Duration;

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::events_stream::{StreamArgs, ensure_events_stream};
use kvroute_common::messages::{
    Decision, SchemaVersion, SelectReply, SelectRequest, SelectResponse, now_ms,
};
use kvroute_router::service::metrics as rm;
use kvroute_tests::labelled;
use kvroute_tests::{RouterProcess, TestEnv, prompt_workers, request};
use uuid::Uuid;

async fn ask(
    nats: &async_nats::Client,
    subject: String,
    req: &SelectRequest,
    timeout: Duration,
) -> Option<SelectResponse> {
    let sent = nats.request(subject, encode(req).unwrap());
    match tokio::time::timeout(timeout, sent).await {
        Ok(Ok(msg)) => Some(decode(&msg.payload).unwrap()),
        Ok(Err(e)) => panic!("request failed: {e}"),
        Err(_) => None,
    }
}

fn ok(r: Option<SelectResponse>) -> SelectReply {
    match r {
        Some(SelectResponse::Ok(r)) => r,
        other => panic!("expected a selection, got {other:?}"),
    }
}

/// Decisions published from now on.
async fn decisions(nats: &async_nats::Client, names: &Names) -> async_nats::Subscriber {
    let sub = nats.subscribe(names.decisions()).await.unwrap();
    nats.flush().await.unwrap();
    sub
}

async fn drain(sub: &mut async_nats::Subscriber, wait: Duration) -> Vec<Decision> {
    let mut out = Vec::new();
    while let Ok(Some(msg)) = tokio::time::timeout(wait, sub.next()).await {
        out.push(decode(&msg.payload).unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_is_dropped_without_a_decision() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = prompt_workers(&env, &[1, 2]).await;
    let router = RouterProcess::start(&env, "r1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let mut seen = decisions(&nats, &names).await;
    let late = SelectRequest {
        request_id: Some(Uuid::new_v4()),
        deadline_ms: Some(now_ms() - 1),
        ..request("m", (0..64).collect())
    };
    let answer = ask(&nats, names.select(), &late, Duration::from_secs(1)).await;
    assert!(answer.is_none(), "a late request was answered: {answer:?}");
    assert!(
        drain(&mut seen, Duration::from_millis(500))
            .await
            .is_empty()
    );
    assert_eq!(
        router.metric(&labelled(rm::labels::EXPIRED, rm::labels::EXPIRED_INTAKE)),
        1.0
    );
    // One with time left is served as usual.
    let timely = SelectRequest {
        request_id: Some(Uuid::new_v4()),
        deadline_ms: Some(now_ms() + 5_000),
        ..request("m", (0..64).collect())
    };
    ok(ask(&nats, names.select(), &timely, Duration::from_secs(5)).await);
    assert_eq!(drain(&mut seen, Duration::from_millis(500)).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_decision_already_made_by_any_replica() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = prompt_workers(&env, &[1, 2, 3]).await;
    // Each replica decides what it receives (as while a partition changes owner): a retry
    // reaching the other replica still gets the first decision.
    let independent = ["--no-partition-owner"];
    let r1 = RouterProcess::start(&env, "r1", &independent).unwrap();
    let r2 = RouterProcess::start(&env, "r2", &independent).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let mut seen = decisions(&nats, &names).await;
    let first = SelectRequest {
        request_id: Some(Uuid::new_v4()),
        ..request("m", (0..64).collect())
    };
    let wait = Duration::from_secs(5);
    let original = ok(ask(&nats, names.router_select("r1"), &first, wait).await);
    assert_eq!(original.router_id, "r1");
    // The retry (a later attempt) to the other replica, and again to the first.
    let retry = SelectRequest {
        attempt: 1,
        ..first.clone()
    };
    let again = ok(ask(&nats, names.router_select("r2"), &retry, wait).await);
    let same = ok(ask(&nats, names.router_select("r1"), &retry, wait).await);
    for reply in [&again, &same] {
        assert_eq!(reply.decision_id, original.decision_id);
        assert_eq!(
            (reply.worker_id, reply.dp_rank),
            (original.worker_id, original.dp_rank)
        );
        assert_eq!(reply.request_subject, original.request_subject);
        assert_eq!(reply.router_id, "r1");
    }
    let published = drain(&mut seen, Duration::from_millis(500)).await;
    assert_eq!(
        published.len(),
        1,
        "one decision for one request: {published:?}"
    );
    assert_eq!(r2.metric("kvroute_router_repeated_requests_total"), 1.0);
    assert_eq!(r1.metric("kvroute_router_repeated_requests_total"), 1.0);
    assert_eq!(r2.metric("kvroute_router_retries_received_total"), 1.0);
    // Both views charge the request once.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for r in [&r1, &r2] {
        assert_eq!(r.metric("kvroute_router_predicted_requests"), 1.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_is_not_ready_stays_out_of_the_queue_group() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let fleet = prompt_workers(&env, &[1]).await;
    // A log that no longer starts at 1 and no snapshot: a local replica can never catch up,
    // so a router in local overlap mode is never ready.
    let js = async_nats::jetstream::new(nats.clone());
    let (stream, _) = ensure_events_stream(&js, &names, &StreamArgs::default())
        .await
        .unwrap();
    fleet[0].store_prompt(&(0..64).collect::<Vec<_>>()).await;
    stream.purge().await.unwrap();
    let router = RouterProcess::spawn(&env, "r1", &["--overlap-mode", "local"]).unwrap();
    let start = std::time::Instant::now();
    while !router.log().contains("router started") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}",
            router.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!router.is_ready());
    assert_eq!(router.metric("kvroute_router_serving"), 0.0);
    // Nobody answers, at once: clients try elsewhere instead of waiting for a timeout.
    let req = request("m", (0..64).collect());
    for subject in [names.select(), names.router_select("r1")] {
        let err = nats
            .request(subject, encode(&req).unwrap())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
    }
    // A ready replica next to it takes the traffic.
    let _ready = RouterProcess::start(&env, "r2", &[]).unwrap();
    let reply = ok(ask(&nats, names.select(), &req, Duration::from_secs(5)).await);
    assert_eq!(reply.router_id, "r2");
}

/// A router's own decisions come back on the decisions subject: applied, not counted as
/// duplicates. Another replica's decision delivered twice still counts once as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_decisions_echoed_back_are_not_duplicates() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = prompt_workers(&env, &[1, 2]).await;
    let router = RouterProcess::start(&env, "r1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let wait = Duration::from_secs(5);
    for i in 0..5u32 {
        let req = request("m", (i * 1000..i * 1000 + 64).collect());
        ok(ask(&nats, names.select(), &req, wait).await);
    }
    // Another replica's decision, delivered twice.
    let foreign = Decision {
        v: SchemaVersion::CURRENT,
        decision_id: Uuid::new_v4(),
        request_id: Uuid::new_v4(),
        router_id: "r-other".into(),
        model: "m".into(),
        role: Default::default(),
        worker_id: 1,
        dp_rank: 0,
        session_id: None,
        request_blocks: 4,
        overlap_blocks: 0,
        prefill_tokens: 64,
        expected_output_tokens: None,
        block_size: 16,
        cost: Default::default(),
        policy: "default".into(),
        binding: None,
        ts: now_ms(),
        attempt: 0,
        prefix_hashes: Vec::new(),
        decode: None,
        lora_name: None,
    };
    for _ in 0..2 {
        nats.publish(names.decisions(), encode(&foreign).unwrap())
            .await
            .unwrap();
    }
    nats.flush().await.unwrap();
    // The router's five echoes were published before the foreign decision: once the second
    // copy of that is counted, the echoes were seen too.
    let start = std::time::Instant::now();
    while router.metric("kvroute_router_decisions_duplicate_total") < 1.0 {
        assert!(
            start.elapsed() < wait,
            "the foreign duplicate was never counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(router.metric("kvroute_router_decisions_applied_total"), 6.0);
    assert_eq!(
        router.metric("kvroute_router_decisions_duplicate_total"),
        1.0,
        "own echoes counted as duplicates"
    );
}
