//! The indexer service against real servers: replicas agree, recover from kill -9 through
//! snapshots, drop departed workers, heal gaps by resync, skip bad input, survive a NATS
//! restart, and hand snapshot leadership over.

use std::time::Duration;

use async_nats::jetstream;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    IndexQuery, IndexQueryResponse, KvEvent, KvEventBatch, SchemaVersion,
};
use kvroute_common::{Names, WorkerId};
use kvroute_tests::{IndexerProcess, SimWorker, TestEnv, expected_index, labelled, stored};
use rand::SeedableRng;
use rand::rngs::StdRng;

const LONG: Duration = Duration::from_secs(30);

async fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !check() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn eventually_or(
    what: &str,
    limit: Duration,
    context: impl Fn() -> String,
    mut check: impl FnMut() -> bool,
) {
    let start = tokio::time::Instant::now();
    while !check() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}\n{}",
            context()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn stream_last_seq(env: &TestEnv) -> u64 {
    let js = jetstream::new(env.nats.connect().await.unwrap());
    let names = Names::new(&env.namespace);
    let mut stream = js.get_stream(names.events_stream()).await.unwrap();
    stream.info().await.unwrap().state.last_sequence
}

/// Waits until every replica applied the whole stream, then returns their common position.
async fn converged(env: &TestEnv, replicas: &[&IndexerProcess]) -> (u64, u64) {
    let last = stream_last_seq(env).await;
    let mut position = (0, 0);
    eventually("replicas applied the whole stream and agree", LONG, || {
        let positions: Vec<_> = replicas.iter().map(|r| r.position().ok()).collect();
        match positions.first() {
            Some(Some(p)) if p.0 >= last && positions.iter().all(|q| q == &Some(*p)) => {
                position = *p;
                true
            }
            _ => false,
        }
    })
    .await;
    position
}

async fn query_workers(env: &TestEnv, hashes: &[u64]) -> Vec<WorkerId> {
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let q = IndexQuery {
        model: "m".into(),
        block_hashes: Some(hashes.to_vec()),
        ..Default::default()
    };
    let reply = nats
        .request(names.index_query(), encode(&q).unwrap())
        .await
        .unwrap();
    match decode::<IndexQueryResponse>(&reply.payload).unwrap() {
        IndexQueryResponse::Ok(r) => r.matches.iter().map(|m| m.worker_id).collect(),
        IndexQueryResponse::Error(e) => panic!("query failed: {e:?}"),
    }
}

fn replicas(env: &TestEnv, extra: &[&str]) -> (IndexerProcess, IndexerProcess) {
    (
        IndexerProcess::start(env, "a", extra).unwrap(),
        IndexerProcess::start(env, "b", extra).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_reach_the_same_sequence_and_digest() {
    let env = TestEnv::start().unwrap();
    let (a, b) = replicas(&env, &[]);
    let mut rng = StdRng::seed_from_u64(1);
    let workers = [
        SimWorker::start(&env, 1, "m", 10).await.unwrap(),
        SimWorker::start(&env, 2, "m", 10).await.unwrap(),
        SimWorker::start(&env, 3, "m", 10).await.unwrap(),
    ];
    for round in 0..10 {
        for w in &workers {
            w.churn(&mut rng, 100, 300);
        }
        if round % 3 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for w in &workers {
        w.flush().await;
    }
    let (_, digest) = converged(&env, &[&a, &b]).await;
    let expected = expected_index(&workers.iter().collect::<Vec<_>>());
    assert_eq!(digest, expected.digest());
    assert!(a.metric("kvroute_indexer_events_applied_total") > 1000.0);
    // The tree's gauges, refreshed on the replica's tick: blocks in the tree are the prefixes
    // held (independent of history); runs depend on history but are at least one per chain.
    let stats = expected.stats();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let nodes = a.metric("kvroute_indexer_index_nodes");
        let runs = a.metric("kvroute_indexer_index_runs");
        if nodes == stats.nodes as f64 && runs >= 1.0 && runs <= stats.nodes as f64 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "index gauges: nodes {nodes:?} runs {runs:?} (expected nodes {})",
            stats.nodes
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_restarts_from_a_snapshot_and_catches_up() {
    let env = TestEnv::start().unwrap();
    let flags = [
        "--snapshot-every-messages",
        "20",
        "--snapshot-interval-secs",
        "1",
        "--ready-max-lag",
        "0",
    ];
    let (a, mut b) = replicas(&env, &flags);
    let worker = SimWorker::start(&env, 1, "m", 10).await.unwrap();
    let mut rng = StdRng::seed_from_u64(2);
    for _ in 0..20 {
        worker.churn(&mut rng, 20, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker.flush().await;
    converged(&env, &[&a, &b]).await;
    eventually("a snapshot was written", LONG, || {
        a.metric("kvroute_indexer_snapshots_written_total")
            + b.metric("kvroute_indexer_snapshots_written_total")
            >= 1.0
    })
    .await;

    b.kill9().unwrap();
    // Events keep flowing while b is dead and while it restarts.
    for _ in 0..20 {
        worker.churn(&mut rng, 50, 200);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.flush().await;
    let backlog_end = stream_last_seq(&env).await;
    b.restart().unwrap();
    // Never ready before it applied everything published while it was down.
    let mut samples = 0;
    eventually("the restarted replica is ready", LONG, || {
        let Ok(s) = b.status() else { return false };
        samples += 1;
        let ready = s["ready"] == true;
        if ready {
            let applied = s["applied_seq"].as_u64().unwrap();
            assert!(
                applied >= backlog_end,
                "ready at {applied} before reaching {backlog_end}"
            );
        }
        ready
    })
    .await;
    assert!(samples >= 1);
    for _ in 0..10 {
        worker.churn(&mut rng, 50, 200);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.flush().await;
    let (_, digest) = converged(&env, &[&a, &b]).await;
    assert_eq!(digest, expected_index(&[&worker]).digest());
    assert!(
        b.log().contains("loaded snapshot"),
        "b bootstrapped from a snapshot:\n{}",
        b.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_workers_leave_every_replica() {
    let env = TestEnv::start().unwrap();
    let (a, b) = replicas(&env, &[]);
    let mut crashing = SimWorker::start(&env, 1, "m", 2).await.unwrap();
    let mut leaving = SimWorker::start(&env, 2, "m", 10).await.unwrap();
    let staying = SimWorker::start(&env, 3, "m", 10).await.unwrap();
    for w in [&crashing, &leaving, &staying] {
        w.store(&[100, 200 + w.worker_id]);
        w.flush().await;
    }
    converged(&env, &[&a, &b]).await;
    eventually("replicas are serving", LONG, || {
        a.is_ready() && b.is_ready()
    })
    .await;
    assert_eq!(query_workers(&env, &[100]).await, vec![1, 2, 3]);

    // A crash: gone from the answers within TTL (2 s) + 1 s.
    crashing.crash();
    let crashed = tokio::time::Instant::now();
    loop {
        let answers = [
            query_workers(&env, &[100]).await,
            query_workers(&env, &[100]).await,
        ];
        if answers.iter().all(|a| !a.contains(&1)) {
            break;
        }
        assert!(
            crashed.elapsed() < Duration::from_secs(3),
            "crashed worker still answered: {answers:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A clean deregistration: gone at once (well within a second).
    leaving.shutdown().await;
    let left = tokio::time::Instant::now();
    while query_workers(&env, &[100]).await.contains(&2) {
        assert!(
            left.elapsed() < Duration::from_secs(1),
            "deregistered worker still answered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Both replicas dropped both workers' blocks from their state, at the same log position.
    let expected = expected_index(&[&staying]).digest();
    eventually("replicas removed both workers", LONG, || {
        [a.position().ok(), b.position().ok()]
            .iter()
            .all(|p| p.is_some_and(|(_, d)| d == expected))
    })
    .await;
    converged(&env, &[&a, &b]).await;
    assert_eq!(query_workers(&env, &[100]).await, vec![3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_gap_triggers_a_resync_and_replicas_converge() {
    let env = TestEnv::start().unwrap();
    let (a, b) = replicas(&env, &[]);
    let worker = SimWorker::start(&env, 1, "m", 10).await.unwrap();
    worker.store(&[1, 2, 3]);
    worker.flush().await;
    converged(&env, &[&a, &b]).await;
    eventually("replicas are ready", LONG, || a.is_ready() && b.is_ready()).await;

    // The worker evicts block 2 but the event is lost; its next event reveals the gap.
    worker.remove_and_lose_event(&[2]);
    worker.store(&[4]);
    worker.flush().await;

    let truth = expected_index(&[&worker]).digest();
    let logs = || format!("a:\n{}\nb:\n{}", a.log(), b.log());
    eventually_or(
        "the resync restored the worker's true state",
        LONG,
        logs,
        || {
            [a.position().ok(), b.position().ok()]
                .iter()
                .all(|p| p.is_some_and(|(_, d)| d == truth))
        },
    )
    .await;
    converged(&env, &[&a, &b]).await;
    for r in [&a, &b] {
        assert_eq!(r.metric("kvroute_indexer_event_gaps_total"), 1.0);
    }
    let requests = a.metric("kvroute_indexer_resync_requests_total")
        + b.metric("kvroute_indexer_resync_requests_total");
    assert!(requests >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_oversize_messages_are_counted_and_change_nothing() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let a = IndexerProcess::start(&env, "a", &[]).unwrap();
    let worker = SimWorker::start(&env, 1, "m", 10).await.unwrap();
    worker.store(&[1, 2, 3]);
    worker.flush().await;
    let (seq, digest) = converged(&env, &[&a]).await;

    let js = jetstream::new(env.nats.connect().await.unwrap());
    let subject = names.kv_events(1);
    let future_version = KvEventBatch {
        v: SchemaVersion(9),
        worker_id: 1,
        dp_rank: 0,
        events: vec![KvEvent {
            event_id: 100,
            data: stored(7),
        }],
        ts: 0,
    };
    let forged_worker = KvEventBatch {
        v: SchemaVersion::CURRENT,
        worker_id: 2,
        ..future_version.clone()
    };
    for payload in [
        b"\xc1 definitely not msgpack".to_vec(),
        vec![0x92; 2 * 1024 * 1024],
        encode_unchecked(&future_version),
        encode_unchecked(&forged_worker),
        Vec::new(),
    ] {
        js.publish(subject.clone(), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    eventually("the bad messages were consumed", LONG, || {
        a.position().is_ok_and(|(s, _)| s == seq + 5)
    })
    .await;
    assert_eq!(
        a.position().unwrap(),
        (seq + 5, digest),
        "bad input changed the state"
    );
    let text = kvroute_tests::http_get(a.http_port, "/metrics").unwrap().1;
    for reason in [
        "malformed",
        "too_large",
        "unsupported_version",
        "worker_mismatch",
        "empty",
    ] {
        assert!(
            text.contains(&format!(
                "{} 1\n",
                labelled(
                    kvroute_indexer::service::metrics::labels::BAD_MESSAGES,
                    reason
                )
            )),
            "{reason} not counted:\n{text}"
        );
    }
    // Still healthy and still applying.
    worker.store(&[4]);
    worker.flush().await;
    let (_, after) = converged(&env, &[&a]).await;
    assert_eq!(after, expected_index(&[&worker]).digest());
}

/// Encodes without the size and version checks of `encode` (to forge bad input).
fn encode_unchecked(batch: &KvEventBatch) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut ser = rmp_serde::Serializer::new(&mut buf)
        .with_struct_map()
        .with_human_readable();
    serde::Serialize::serialize(batch, &mut ser).unwrap();
    buf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_mid_ingest_loses_nothing() {
    let mut env = TestEnv::start().unwrap();
    let (a, b) = replicas(&env, &[]);
    let w1 = SimWorker::start(&env, 1, "m", 10).await.unwrap();
    let w2 = SimWorker::start(&env, 2, "m", 10).await.unwrap();
    let mut rng = StdRng::seed_from_u64(6);
    for _ in 0..10 {
        w1.churn(&mut rng, 30, 200);
        w2.churn(&mut rng, 30, 200);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    env.nats.kill9().unwrap();
    // Workers keep changing their caches while NATS is down.
    for _ in 0..10 {
        w1.churn(&mut rng, 30, 200);
        w2.churn(&mut rng, 30, 200);
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    env.nats.restart().unwrap();
    for _ in 0..10 {
        w1.churn(&mut rng, 30, 200);
        w2.churn(&mut rng, 30, 200);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::timeout(LONG, async {
        w1.flush().await;
        w2.flush().await;
    })
    .await
    .expect("workers flushed after the restart");
    let (_, digest) = converged(&env, &[&a, &b]).await;
    assert_eq!(digest, expected_index(&[&w1, &w2]).digest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_continue_after_leader_failover() {
    let env = TestEnv::start().unwrap();
    let flags = [
        "--snapshot-every-messages",
        "10",
        "--snapshot-interval-secs",
        "1",
    ];
    let (a, b) = replicas(&env, &flags);
    let worker = SimWorker::start(&env, 1, "m", 10).await.unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let leader_of = || -> Option<String> {
        [&a, &b]
            .iter()
            .find(|r| r.status().is_ok_and(|s| s["leader"] == true))
            .map(|r| r.replica_id.clone())
    };
    let mut first = None;
    eventually("a leader is elected", LONG, || {
        first = leader_of();
        first.is_some()
    })
    .await;
    let (mut leader, follower) = if first.as_deref() == Some("a") {
        (a, b)
    } else {
        (b, a)
    };
    worker.churn(&mut rng, 100, 100);
    worker.flush().await;
    eventually("the leader writes snapshots", LONG, || {
        leader.metric("kvroute_indexer_snapshots_written_total") >= 1.0
    })
    .await;
    assert_eq!(
        follower.metric("kvroute_indexer_snapshots_written_total"),
        0.0
    );

    leader.kill9().unwrap();
    let killed = tokio::time::Instant::now();
    eventually("the follower takes over", Duration::from_secs(10), || {
        follower.status().is_ok_and(|s| s["leader"] == true)
    })
    .await;
    // Within one lease TTL (2 s) plus the campaign's retry and our polling.
    assert!(
        killed.elapsed() < Duration::from_secs(4),
        "takeover took {:?}",
        killed.elapsed()
    );
    worker.churn(&mut rng, 100, 100);
    worker.flush().await;
    eventually("the new leader writes snapshots", LONG, || {
        follower.metric("kvroute_indexer_snapshots_written_total") >= 1.0
    })
    .await;
}
