//! Session affinity across two router replicas sharing the sessions bucket: hard bindings hold
//! whichever replica answers (also when a session's first two requests race), soft mode lets
//! the policy move a session, and a departed worker's sessions rebind.

use std::collections::BTreeSet;
use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    BindingState, IndexQuery, IndexQueryResponse, SelectReply, SelectRequest, SelectResponse,
    SessionContext,
};
use kvroute_router::service::metrics as rm;
use kvroute_tests::labelled;
use kvroute_tests::{
    IndexerProcess, PromptWorker, RouterProcess, TestEnv, request, select, worker_card,
};

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| seed * 100_000 + i).collect()
}

fn ok(response: SelectResponse) -> SelectReply {
    match response {
        SelectResponse::Ok(r) => r,
        SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
    }
}

fn in_session(mut r: SelectRequest, id: &str) -> SelectRequest {
    r.session = Some(SessionContext {
        id: id.into(),
        ..Default::default()
    });
    r
}

async fn fleet(env: &TestEnv, n: u64) -> Vec<PromptWorker> {
    let names = Names::new(&env.namespace);
    let mut out = Vec::new();
    for id in 1..=n {
        out.push(
            PromptWorker::start(env, worker_card(&names, id, "m"), 10)
                .await
                .unwrap(),
        );
    }
    out
}

/// Waits until the indexer reports `blocks` leading blocks of `tokens` on some worker (asked
/// directly, so no selection adds predicted load meanwhile).
async fn indexed(nats: &async_nats::Client, names: &Names, tokens: &[u32], blocks: u32) {
    let query = IndexQuery {
        model: "m".into(),
        token_ids: Some(tokens.to_vec()),
        block_size: Some(16),
        ..Default::default()
    };
    let start = std::time::Instant::now();
    loop {
        if let Ok(reply) = nats
            .request(names.index_query(), encode(&query).unwrap())
            .await
            && let Ok(IndexQueryResponse::Ok(r)) = decode::<IndexQueryResponse>(&reply.payload)
            && r.matches.iter().any(|m| m.device == blocks)
        {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "indexed in time");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_sessions_stay_on_one_worker_across_replicas() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _workers = fleet(&env, 3).await;
    let _a = RouterProcess::start(&env, "a", &[]).unwrap();
    let _b = RouterProcess::start(&env, "b", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let mut routers = BTreeSet::new();
    let mut bound = BTreeSet::new();
    let mut i = 0;
    // Different prompts each turn, so without the binding the load would spread them.
    while routers.len() < 2 || i < 12 {
        let reply = ok(select(
            &nats,
            &names,
            &in_session(request("m", prompt(i, 3)), "chat-1"),
        )
        .await
        .unwrap());
        let expected = if i == 0 {
            BindingState::New
        } else {
            BindingState::Kept
        };
        assert_eq!(reply.binding, Some(expected));
        routers.insert(reply.router_id);
        bound.insert(reply.worker_id);
        i += 1;
        assert!(i < 200, "both replicas answer eventually");
    }
    assert_eq!(bound.len(), 1, "one worker whichever replica answered");
    // The final request releases the binding; the next one binds anew.
    let mut last = in_session(request("m", prompt(500, 3)), "chat-1");
    last.session.as_mut().unwrap().is_final = true;
    let reply = ok(select(&nats, &names, &last).await.unwrap());
    assert_eq!(reply.binding, Some(BindingState::Released));
    let reply = ok(select(
        &nats,
        &names,
        &in_session(request("m", prompt(501, 3)), "chat-1"),
    )
    .await
    .unwrap());
    assert_eq!(reply.binding, Some(BindingState::New));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_requests_of_a_session_land_on_one_worker() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix", &[]).unwrap();
    let workers = fleet(&env, 2).await;
    // Each replica decides what it receives (as while a partition changes owner), so first
    // requests of one session race across replicas on the sessions bucket.
    let independent = ["--no-partition-owner"];
    let a = RouterProcess::start(&env, "a", &independent).unwrap();
    let b = RouterProcess::start(&env, "b", &independent).unwrap();
    let nats = env.nats.connect().await.unwrap();
    // Two prompts held by different workers: alone, each request goes elsewhere.
    let (p1, p2) = (prompt(1, 8), prompt(2, 8));
    workers[0].store_prompt(&p1).await;
    workers[1].store_prompt(&p2).await;
    indexed(&nats, &names, &p1, 8).await;
    indexed(&nats, &names, &p2, 8).await;
    let mut across_replicas = 0;
    for s in 0..20 {
        let id = format!("race-{s}");
        let r1 = in_session(request("m", p1.clone()), &id);
        let r2 = in_session(request("m", p2.clone()), &id);
        let (x, y) = tokio::join!(select(&nats, &names, &r1), select(&nats, &names, &r2));
        let (x, y) = (ok(x.unwrap()), ok(y.unwrap()));
        assert_eq!(x.worker_id, y.worker_id, "session {id}: {x:?} vs {y:?}");
        let states = [x.binding, y.binding];
        assert!(states.contains(&Some(BindingState::New)), "{states:?}");
        if x.router_id != y.router_id {
            across_replicas += 1;
        }
    }
    assert!(across_replicas > 0, "some races spanned both replicas");
    let kept = a.metric(&labelled(rm::labels::SESSIONS, BindingState::Kept.as_str()))
        + b.metric(&labelled(rm::labels::SESSIONS, BindingState::Kept.as_str()));
    assert_eq!(kept, 20.0, "every race had one winner and one adopter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_sessions_follow_the_policy_and_departed_workers_rebind() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix", &[]).unwrap();
    let mut workers = fleet(&env, 3).await;
    let nats = env.nats.connect().await.unwrap();
    let (p1, p2) = (prompt(1, 8), prompt(2, 8));
    workers[0].store_prompt(&p1).await;
    workers[1].store_prompt(&p2).await;

    // Soft: the binding is a hint the default policy does not follow; the cache wins.
    let mut soft = RouterProcess::start(&env, "soft", &["--session-affinity", "soft"]).unwrap();
    indexed(&nats, &names, &p1, 8).await;
    indexed(&nats, &names, &p2, 8).await;
    let first = ok(
        select(&nats, &names, &in_session(request("m", p1.clone()), "s"))
            .await
            .unwrap(),
    );
    assert_eq!(
        (first.worker_id, first.binding),
        (1, Some(BindingState::New))
    );
    let moved = ok(
        select(&nats, &names, &in_session(request("m", p2.clone()), "s"))
            .await
            .unwrap(),
    );
    assert_eq!(
        (moved.worker_id, moved.binding),
        (2, Some(BindingState::Rebound))
    );
    soft.stop().unwrap();

    // Hard: the binding holds against the cache...
    let hard = RouterProcess::start(&env, "hard", &[]).unwrap();
    let held = ok(
        select(&nats, &names, &in_session(request("m", p1.clone()), "s"))
            .await
            .unwrap(),
    );
    assert_eq!(
        (held.worker_id, held.binding),
        (2, Some(BindingState::Kept))
    );
    // ...until its worker leaves: the session rebinds.
    let departed = workers.remove(1);
    departed.shutdown().await;
    let start = std::time::Instant::now();
    let rebound = loop {
        let r = ok(
            select(&nats, &names, &in_session(request("m", p1.clone()), "s"))
                .await
                .unwrap(),
        );
        if r.worker_id != 2 {
            break r;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the router saw the departure"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (rebound.worker_id, rebound.binding),
        (1, Some(BindingState::Rebound))
    );
    assert!(
        hard.metric(&labelled(
            rm::labels::SESSIONS,
            BindingState::Rebound.as_str()
        )) >= 1.0
    );
}
