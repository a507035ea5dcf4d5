//! Worker cards in etcd that do not decode or validate: every router and indexer counts each
//! one by reason on `/metrics` (`kvroute_discovery_bad_cards_total`), through both the first
//! full read and the watch, and keeps routing to the good workers.

use std::time::{Duration, Instant};

use kvroute_common::Names;
use kvroute_common::codec::encode;
use kvroute_common::discovery::BAD_CARDS_METRIC;
use kvroute_common::messages::{SchemaVersion, SelectResponse, WorkerCard};
use kvroute_tests::{
    IndexerProcess, RouterProcess, TestEnv, http_get, prompt_workers, request, select, worker_card,
};

/// The value of the sample `name` (labels included) at `/metrics` on `port`.
fn sample(port: u16, name: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics")?;
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok())?
    })
}

/// One bad card of every reason: (key, value, reason label).
fn bad_cards(names: &Names) -> Vec<(String, Vec<u8>, &'static str)> {
    let card = |id: u64, f: fn(&mut WorkerCard)| {
        let mut c = worker_card(names, id, "m");
        f(&mut c);
        encode(&c).unwrap().to_vec()
    };
    let key = |id: u64| names.worker_key(id);
    vec![
        (
            format!("{}not-a-worker-id", names.workers_prefix()),
            card(10, |_| {}),
            "bad_key",
        ),
        (key(11), vec![], "empty"),
        (key(12), vec![0xc0; 64 * 1024 + 1], "too_large"),
        (
            key(13),
            br#"{"worker_id": 13, "model": "m"}"#.to_vec(),
            "malformed",
        ),
        (
            key(14),
            card(14, |c| c.v = SchemaVersion(u16::MAX)),
            "unsupported_version",
        ),
        (key(15), card(99, |_| {}), "worker_id_mismatch"),
        (
            key(16),
            card(16, |c| c.model = String::new()),
            "invalid_model",
        ),
        (
            key(17),
            card(17, |c| c.block_size = 0),
            "invalid_block_size",
        ),
        (
            key(18),
            card(18, |c| c.total_kv_blocks = 0),
            "invalid_total_kv_blocks",
        ),
        (
            key(19),
            card(19, |c| c.request_subject = "no subject".into()),
            "invalid_request_subject",
        ),
        (
            key(20),
            card(20, |c| c.lora_adapters = Some(vec!["x".repeat(129)])),
            "invalid_lora_adapters",
        ),
    ]
}

async fn put_all(etcd: &mut etcd_client::Client, cards: &[(String, Vec<u8>, &'static str)]) {
    for (key, value, _) in cards {
        etcd.put(key.as_str(), value.clone(), None).await.unwrap();
    }
}

/// Waits until every reason's count is `n` on `port` (a process's `/metrics`).
async fn wait_counts(what: &str, port: u16, reasons: &[&str], n: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let counts: Vec<Option<f64>> = reasons
            .iter()
            .map(|r| sample(port, &format!("{BAD_CARDS_METRIC}{{reason=\"{r}\"}}")))
            .collect();
        if counts.iter().all(|c| *c == Some(n)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: expected {n} of each of {reasons:?}, got {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_cards_are_counted_by_reason_on_routers_and_indexers_and_good_workers_route() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let _fleet = prompt_workers(&env, &[1, 2]).await;
    let mut etcd = env.etcd.connect().await.unwrap();
    let bad = bad_cards(&names);
    let reasons: Vec<&str> = bad.iter().map(|(_, _, r)| *r).collect();

    // Every reason is exposed from the start, at 0.
    wait_counts("indexer before", indexer.http_port, &reasons, 0.0).await;

    // The indexer sees these through its watch; the router, started after, in its first read.
    put_all(&mut etcd, &bad).await;
    wait_counts("indexer (watch)", indexer.http_port, &reasons, 1.0).await;
    let router = RouterProcess::start(&env, "r1", &[]).unwrap();
    wait_counts("router (first read)", router.http_port, &reasons, 1.0).await;

    // Written again: both see them through their watches.
    put_all(&mut etcd, &bad).await;
    wait_counts("indexer (watch again)", indexer.http_port, &reasons, 2.0).await;
    wait_counts("router (watch)", router.http_port, &reasons, 2.0).await;

    // The good workers are the only candidates, and selections still reach them.
    assert_eq!(
        sample(router.http_port, "kvroute_router_workers"),
        Some(2.0)
    );
    let nats = env.nats.connect().await.unwrap();
    for seed in 0..4u32 {
        let tokens: Vec<u32> = (0..64).map(|i| seed * 1000 + i).collect();
        match select(&nats, &names, &request("m", tokens)).await.unwrap() {
            SelectResponse::Ok(reply) => assert!(
                [1, 2].contains(&reply.worker_id),
                "selected {}",
                reply.worker_id
            ),
            SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
        }
    }
}
