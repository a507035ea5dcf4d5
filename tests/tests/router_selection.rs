//! The router service end to end through NATS: cache affinity (remote and local overlap),
//! load spreading, eligibility rules, built-in policies per role, error replies, and the
//! load-only fallback when no indexer answers.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::codec::encode;
use kvroute_common::messages::{
    ErrorCode, Pin, SelectReply, SelectRequest, SelectResponse, WorkerRole,
};
use kvroute_common::ops::watchdog;
use kvroute_router::service::metrics as rm;
use kvroute_router::service::overlap::Fallback;
use kvroute_tests::{
    IndexerProcess, PromptWorker, RouterProcess, TestEnv, continuing, prompt_workers, request,
    select, select_raw, worker_card,
};
use kvroute_tests::{labelled, series};

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| seed * 100_000 + i).collect()
}

fn ok(response: SelectResponse) -> SelectReply {
    match response {
        SelectResponse::Ok(r) => r,
        SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
    }
}

fn err(response: SelectResponse) -> ErrorCode {
    match response {
        SelectResponse::Error(e) => e.code,
        SelectResponse::Ok(r) => panic!("expected an error, got {r:?}"),
    }
}

async fn workers(env: &TestEnv, ids: &[u64]) -> Vec<PromptWorker> {
    prompt_workers(env, ids).await
}

/// Selects until the reply shows `blocks` device blocks of overlap (the index caught up).
async fn select_until_overlap(
    nats: &async_nats::Client,
    names: &Names,
    req: &SelectRequest,
    blocks: u32,
) -> SelectReply {
    kvroute_tests::select_until_overlap(nats, names, req, blocks, Duration::from_secs(30)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_overlap_sends_a_prompt_to_the_worker_holding_it() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let fleet = workers(&env, &[1, 2, 3]).await;
    let router = RouterProcess::start(&env, "r1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let tokens = prompt(1, 8);
    fleet[1].store_prompt(&tokens).await;
    let reply = select_until_overlap(&nats, &names, &request("m", continuing(&tokens)), 8).await;
    assert_eq!(reply.worker_id, 2);
    assert_eq!(reply.request_blocks, 8);
    assert_eq!(reply.router_id, "r1");
    assert_eq!(reply.policy, "default");
    assert_eq!(reply.request_subject, names.worker_requests(2));
    assert!(reply.cost.total.is_finite() && !reply.cost.terms.is_empty());
    assert!(router.metric("kvroute_router_overlap_blocks_total") >= 8.0);
    assert!(router.metric(&series(rm::names::DECISIONS, &[("worker", "2/0")])) >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_overlap_follows_the_log_without_an_indexer() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    // The indexer creates the events stream (and would write snapshots); then it goes away.
    let mut indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let fleet = workers(&env, &[1, 2, 3]).await;
    let first = prompt(1, 6);
    fleet[2].store_prompt(&first).await;
    indexer.stop().unwrap();
    let router = RouterProcess::start(&env, "r1", &["--overlap-mode", "local"]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let reply = select_until_overlap(&nats, &names, &request("m", continuing(&first)), 6).await;
    assert_eq!(reply.worker_id, 3);
    // Events published after startup arrive through the replica's consumer.
    let second = prompt(2, 5);
    fleet[0].store_prompt(&second).await;
    let reply = select_until_overlap(&nats, &names, &request("m", continuing(&second)), 5).await;
    assert_eq!(reply.worker_id, 1);
    // The local replica applied the whole log: its sequence is the stream's last.
    let last_seq = async_nats::jetstream::new(nats.clone())
        .get_stream(names.events_stream())
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .last_sequence;
    assert!(last_seq >= 2, "both prompts' events are in the log");
    // The gauge follows the replica on the router's 1 s tick.
    let started = std::time::Instant::now();
    while router.metric("kvroute_router_local_applied_seq") != last_seq as f64 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "local applied seq {} never reached the log's last, {last_seq}",
            router.metric("kvroute_router_local_applied_seq")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        router.metric(&labelled(
            rm::labels::OVERLAP_FALLBACKS,
            Fallback::NoResponders.reason()
        )),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_replica_reports_the_indexers_applied_seq_and_digest() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let fleet = workers(&env, &[1, 2]).await;
    let router = RouterProcess::start(&env, "r1", &["--overlap-mode", "local"]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let tokens = prompt(3, 4);
    fleet[1].store_prompt(&tokens).await;
    select_until_overlap(&nats, &names, &request("m", continuing(&tokens)), 4).await;
    // The log is quiet now: the replica and the indexer applied the same prefix of it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ix = indexer.status().unwrap();
        let (code, body) = kvroute_tests::http_get(router.http_port, "/status").unwrap();
        assert_eq!(code, 200, "{body}");
        let local =
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["local_index"].clone();
        assert!(local["applied_seq"].as_u64().unwrap() > 0, "{local}");
        if local["applied_seq"] == ix["applied_seq"] && local["digest"] == ix["digest"] {
            let digest = local["digest"].as_str().unwrap();
            assert!(digest.starts_with("0x") && digest.len() == 18, "{digest}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "router {local}, indexer {ix}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A router that asks the indexers keeps no replica and shows none.
    let remote = RouterProcess::start(&env, "r2", &[]).unwrap();
    let (_, body) = kvroute_tests::http_get(remote.http_port, "/status").unwrap();
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(status.get("local_index").is_none(), "{status}");
}

/// Selections per worker.
fn tally(replies: impl IntoIterator<Item = SelectResponse>) -> BTreeMap<u64, u32> {
    let mut counts = BTreeMap::new();
    for reply in replies {
        *counts.entry(ok(reply).worker_id).or_default() += 1;
    }
    counts
}

/// `n` selections of distinct 4-block prompts, one after another.
async fn spread(nats: &async_nats::Client, names: &Names, n: u32) -> BTreeMap<u64, u32> {
    let mut replies = Vec::new();
    for i in 0..n {
        replies.push(
            select(nats, names, &request("m", prompt(1000 + i, 4)))
                .await
                .unwrap(),
        );
    }
    tally(replies)
}

fn imbalance(counts: &BTreeMap<u64, u32>, workers: usize) -> u32 {
    assert_eq!(
        counts.len(),
        workers,
        "every worker got requests: {counts:?}"
    );
    counts.values().max().unwrap() - counts.values().min().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_overlap_spreads_by_load_through_one_replica_or_two() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = workers(&env, &[1, 2, 3, 4]).await;
    let nats = env.nats.connect().await.unwrap();
    // No indexer: overlap falls back to none, so only predicted load separates the workers.
    let mut one = RouterProcess::start(&env, "solo", &[]).unwrap();
    let single = spread(&nats, &names, 40).await;
    assert!(imbalance(&single, 4) <= 1, "{single:?}");
    one.stop().unwrap();

    // Without partition owners (with them, one replica decides a partition: tests/router_replicas),
    // both replicas decide, and each sees the other's decisions, so the spread stays as even.
    let a = RouterProcess::start(&env, "a", &["--no-partition-owner"]).unwrap();
    let b = RouterProcess::start(&env, "b", &["--no-partition-owner"]).unwrap();
    let both = spread(&nats, &names, 40).await;
    assert!(
        imbalance(&both, 4) <= imbalance(&single, 4) + 2,
        "{both:?} vs {single:?}"
    );
    let answered_a = a.metric("kvroute_router_request_blocks_total");
    let answered_b = b.metric("kvroute_router_request_blocks_total");
    let leaves =
        |r: &RouterProcess| r.metric(&labelled(rm::labels::GROUP_LEAVES, watchdog::LEFT_LAGGING));
    assert!(
        answered_a > 0.0 && answered_b > 0.0,
        "both replicas answered: blocks {answered_a} and {answered_b}, queue-group leaves {} and {}\n{}\n{}",
        leaves(&a),
        leaves(&b),
        a.log(),
        b.log()
    );
    assert!(a.metric("kvroute_router_decisions_applied_total") >= 40.0);
    assert!(
        a.metric(&labelled(
            rm::labels::OVERLAP_FALLBACKS,
            Fallback::NoResponders.reason()
        )) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_concurrent_selections_does_not_herd() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = workers(&env, &[1, 2, 3, 4]).await;
    let nats = env.nats.connect().await.unwrap();
    let router = RouterProcess::start(&env, "burst", &[]).unwrap();
    let before = router.metric("kvroute_router_decisions_applied_total");
    // 16 selections in flight at once: each must see the load the earlier ones charged.
    let requests: Vec<SelectRequest> = (0..16).map(|i| request("m", prompt(2000 + i, 4))).collect();
    let replies =
        futures::future::join_all(requests.iter().map(|r| select(&nats, &names, r))).await;
    let counts = tally(replies.into_iter().map(Result::unwrap));
    assert!(imbalance(&counts, 4) <= 1, "{counts:?}");
    assert!(router.metric("kvroute_router_decisions_applied_total") >= before + 16.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eligibility_rules_apply_through_nats() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let mut fleet = workers(&env, &[1, 2]).await;
    let mut tainted = worker_card(&names, 3, "m");
    tainted.taints = vec!["gpu-a100".into()];
    fleet.push(PromptWorker::start(&env, tainted, 10).await.unwrap());
    let _router = RouterProcess::start(&env, "r1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();

    let mut pinned = request("m", prompt(1, 2));
    pinned.pin = Some(Pin {
        worker_id: 2,
        dp_rank: None,
    });
    assert_eq!(
        ok(select(&nats, &names, &pinned).await.unwrap()).worker_id,
        2
    );
    pinned.pin = Some(Pin {
        worker_id: 9,
        dp_rank: None,
    });
    assert_eq!(
        err(select(&nats, &names, &pinned).await.unwrap()),
        ErrorCode::PinnedUnavailable
    );

    let mut allowed = request("m", prompt(2, 2));
    allowed.allowed_workers = Some(vec![1]);
    for _ in 0..3 {
        assert_eq!(
            ok(select(&nats, &names, &allowed).await.unwrap()).worker_id,
            1
        );
    }

    let mut required = request("m", prompt(3, 2));
    required.required_taints = vec!["gpu-a100".into()];
    assert_eq!(
        ok(select(&nats, &names, &required).await.unwrap()).worker_id,
        3
    );
    // Untolerated taint: worker 3 is never chosen otherwise.
    for i in 0..6 {
        let r = ok(select(&nats, &names, &request("m", prompt(10 + i, 2)))
            .await
            .unwrap());
        assert_ne!(r.worker_id, 3);
    }
    required.required_taints = vec!["tpu".into()];
    let SelectResponse::Error(e) = select(&nats, &names, &required).await.unwrap() else {
        panic!("expected all_filtered");
    };
    assert_eq!(e.code, ErrorCode::AllFiltered);
    assert_eq!(e.reasons.len(), 3, "{e:?}");

    assert_eq!(
        err(select(&nats, &names, &request("other-model", prompt(1, 2)))
            .await
            .unwrap()),
        ErrorCode::NoWorkers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn built_in_policies_per_role() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let mut fleet = Vec::new();
    for id in 1..=3 {
        let mut card = worker_card(&names, id, "m");
        card.role = WorkerRole::Prefill;
        fleet.push(PromptWorker::start(&env, card, 10).await.unwrap());
        let mut card = worker_card(&names, 10 + id, "m");
        card.role = WorkerRole::Decode;
        fleet.push(PromptWorker::start(&env, card, 10).await.unwrap());
    }
    let router = RouterProcess::start(
        &env,
        "r1",
        &[
            "--worker-selection-policy",
            "round-robin",
            "--decode-policy",
            "least-busy",
        ],
    )
    .unwrap();
    let nats = env.nats.connect().await.unwrap();

    // Prefill: round-robin (the all-roles selection) visits every worker in turn.
    let mut seen = Vec::new();
    for i in 0..6 {
        let mut r = request("m", prompt(i, 2));
        r.role = WorkerRole::Prefill;
        let reply = ok(select(&nats, &names, &r).await.unwrap());
        assert_eq!(reply.policy, "round-robin");
        seen.push(reply.worker_id);
    }
    assert_eq!(seen[..3], seen[3..], "{seen:?}");
    let mut distinct = seen[..3].to_vec();
    distinct.sort();
    assert_eq!(distinct, vec![1, 2, 3]);

    // Decode: least-busy (the role flag) avoids the workers reporting load.
    fleet[1].report_load(50, 500).await; // worker 11
    fleet[5].report_load(40, 400).await; // worker 13
    let start = std::time::Instant::now();
    while router.metric("kvroute_router_load_reports_total") < 2.0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "load reports arrive"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut r = request("m", prompt(99, 2));
    r.role = WorkerRole::Decode;
    let reply = ok(select(&nats, &names, &r).await.unwrap());
    assert_eq!((reply.worker_id, reply.policy.as_str()), (12, "least-busy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversize_requests_get_error_replies() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = workers(&env, &[1]).await;
    let router = RouterProcess::start(&env, "r1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let code = |r: SelectResponse| err(r);
    assert_eq!(
        code(
            select_raw(&nats, &names, b"not msgpack".to_vec())
                .await
                .unwrap()
        ),
        ErrorCode::BadRequest
    );
    assert_eq!(
        code(select_raw(&nats, &names, vec![]).await.unwrap()),
        ErrorCode::BadRequest
    );
    let missing_prompt = SelectRequest {
        model: "m".into(),
        ..Default::default()
    };
    assert_eq!(
        code(select(&nats, &names, &missing_prompt).await.unwrap()),
        ErrorCode::BadRequest
    );
    // An empty prompt is no prompt: refused, naming the field.
    for (empty, field) in [
        (request("m", vec![]), "token_ids"),
        (
            SelectRequest {
                model: "m".into(),
                block_hashes: Some(vec![]),
                ..Default::default()
            },
            "block_hashes",
        ),
    ] {
        match select(&nats, &names, &empty).await.unwrap() {
            SelectResponse::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
                assert!(e.message.contains(field), "{e:?}");
            }
            SelectResponse::Ok(r) => panic!("an empty {field} was accepted: {r:?}"),
        }
    }
    let mut newer = request("m", prompt(1, 1));
    newer.v.0 = 42;
    assert_eq!(
        code(
            select_raw(&nats, &names, encode(&newer).unwrap().to_vec())
                .await
                .unwrap()
        ),
        ErrorCode::UnsupportedVersion
    );
    // Above the 4 MiB limit (the test server allows 8 MiB payloads).
    let huge = request("m", vec![7; 1_200_000]);
    let bytes = rmp_like_encode(&huge);
    assert!(bytes.len() > 4 * 1024 * 1024);
    assert_eq!(
        code(select_raw(&nats, &names, bytes).await.unwrap()),
        ErrorCode::TooLarge
    );
    assert!(
        router.metric(&labelled(
            rm::labels::ERRORS,
            ErrorCode::BadRequest.as_str()
        )) >= 5.0
    );
    assert_eq!(
        router.metric(&labelled(rm::labels::ERRORS, ErrorCode::TooLarge.as_str())),
        1.0
    );
    // A good request still works afterwards.
    ok(select(&nats, &names, &request("m", prompt(2, 2)))
        .await
        .unwrap());
}

/// Encodes above kvroute's own limit (its encoder refuses): token ids as a msgpack map by hand.
fn rmp_like_encode(request: &SelectRequest) -> Vec<u8> {
    let tokens = request.token_ids.as_ref().unwrap();
    let mut out = vec![0x82]; // map of 2
    out.push(0xa5);
    out.extend_from_slice(b"model");
    out.push(0xa0 | request.model.len() as u8);
    out.extend_from_slice(request.model.as_bytes());
    out.push(0xa9);
    out.extend_from_slice(b"token_ids");
    out.push(0xdd); // array 32
    out.extend_from_slice(&(tokens.len() as u32).to_be_bytes());
    for t in tokens {
        out.push(0xce); // uint 32
        out.extend_from_slice(&t.to_be_bytes());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_may_ask_for_a_policy_by_name() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = workers(&env, &[1, 2, 3]).await;
    let _router = RouterProcess::start(&env, "r1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    // round-robin visits every worker in turn whatever the cache holds.
    let mut seen = BTreeMap::new();
    for i in 0..6 {
        let mut req = request("m", prompt(9, 2));
        req.policy = Some("round-robin".into());
        let reply = ok(select(&nats, &names, &req).await.unwrap());
        assert_eq!(reply.policy, "round-robin", "request {i}");
        *seen.entry(reply.worker_id).or_insert(0) += 1;
    }
    assert_eq!(seen, BTreeMap::from([(1, 2), (2, 2), (3, 2)]));
    // Without the field the role's policy answers.
    let reply = ok(select(&nats, &names, &request("m", prompt(9, 2)))
        .await
        .unwrap());
    assert_eq!(reply.policy, "default");
    // An unknown name is a bad request, not a silent fallback.
    let mut req = request("m", prompt(9, 2));
    req.policy = Some("no-such-policy".into());
    assert_eq!(
        err(select(&nats, &names, &req).await.unwrap()),
        ErrorCode::BadRequest
    );
}
