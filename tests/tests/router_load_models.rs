//! The load view's optional models through the real processes: a kvroute-mocker fleet whose
//! workers send no load reports (so the router's view goes by its predictions and the workers'
//! lifecycle events, as with engines that report nothing) and a `kvroute-router`, whose
//! `/status` shows each rank's load as its view sees it.

use std::time::{Duration, Instant};

use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{GenerateRequest, GenerateResponse, SelectRequest, SelectResponse};
use kvroute_common::{Names, WorkerId};
use kvroute_mocker::fleet::{EngineArgs, Fleet, FleetConfig};
use kvroute_tests::{RouterProcess, TestEnv, http_get, select};
use serde_json::Value;
use uuid::Uuid;

const BLOCK: u32 = 16;
const WORKER: WorkerId = 1;

/// One worker, 16-token blocks, real time (a decode step takes about 10 ms), no load reports.
fn fleet_config() -> FleetConfig {
    FleetConfig {
        workers: 1,
        worker_id_start: WORKER,
        model: "m".into(),
        engine: EngineArgs {
            block_size: BLOCK,
            num_blocks: 4096,
            ..EngineArgs::default()
        },
        speedup: 1.0,
        lease_ttl_secs: 2,
        no_load_reports: true,
        ..FleetConfig::default()
    }
}

fn prompt(seed: u32, tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| seed * 100_000 + i).collect()
}

/// Selects `tokens` for a request of id `request_id`; returns the chosen worker.
async fn select_for(
    nats: &async_nats::Client,
    names: &Names,
    request_id: Uuid,
    tokens: &[u32],
    expected_output_tokens: Option<u32>,
) -> WorkerId {
    let request = SelectRequest {
        request_id: Some(request_id),
        model: "m".into(),
        token_ids: Some(tokens.to_vec()),
        expected_output_tokens,
        ..SelectRequest::default()
    };
    match select(nats, names, &request).await.expect("select") {
        SelectResponse::Ok(reply) => reply.worker_id,
        SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
    }
}

/// Runs request `request_id` on the worker (in the background); the handle ends with its
/// reply.
fn generate(
    nats: &async_nats::Client,
    names: &Names,
    request_id: Uuid,
    tokens: &[u32],
    max_tokens: u32,
) -> tokio::task::JoinHandle<GenerateResponse> {
    let request = GenerateRequest {
        request_id,
        token_ids: Some(tokens.to_vec()),
        max_tokens,
        ..GenerateRequest::default()
    };
    let (nats, subject) = (nats.clone(), names.worker_requests(WORKER));
    tokio::spawn(async move {
        let reply = tokio::time::timeout(
            Duration::from_secs(30),
            nats.request(subject, encode(&request).unwrap()),
        )
        .await
        .expect("the worker answers in time")
        .expect("request delivered");
        decode(&reply.payload).expect("a GenerateResponse")
    })
}

/// The worker's entry in the router's `/status` `load` list, if the view knows its load.
fn rank_load(router: &RouterProcess) -> Option<Value> {
    let (status, body) = http_get(router.http_port, "/status").expect("/status answers");
    assert_eq!(status, 200, "{body}");
    let status: Value = serde_json::from_str(&body).expect("JSON");
    status["load"]
        .as_array()
        .expect("a load list")
        .iter()
        .find(|r| r["worker_id"] == WORKER && r["dp_rank"] == 0)
        .cloned()
}

/// Whether the view knows the rank's load (else the entry only has its prefill rate).
fn known(load: &Option<Value>) -> bool {
    load.as_ref()
        .is_some_and(|l| l.get("active_requests").is_some())
}

fn field(load: &Option<Value>, name: &str) -> f64 {
    load.as_ref()
        .and_then(|l| l[name].as_f64())
        .unwrap_or_else(|| panic!("no {name} in {load:?}"))
}

/// Polls the worker's load until `done` says so (or 20 s pass); returns every value seen.
async fn watch(
    router: &RouterProcess,
    mut done: impl FnMut(&Option<Value>) -> bool,
) -> Vec<Option<Value>> {
    let start = Instant::now();
    let mut seen = Vec::new();
    loop {
        let load = rank_load(router);
        let stop = done(&load);
        seen.push(load);
        if stop {
            return seen;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "gave up; seen {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_blocks_count_as_a_request_generates() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let etcd = env.etcd.connect().await.unwrap();
    let _fleet = Fleet::start(&fleet_config(), nats.clone(), etcd, &names)
        .await
        .unwrap();
    let router = RouterProcess::start(&env, "r1", &["--track-output-blocks"]).unwrap();
    // 192 output tokens: the worker sends `progress` at 16, 32, …, 176 (11 blocks).
    // Without an expected length each block counts in full; with 192 expected, block k of
    // output counts k · (1 − 16k/192), at most 3 (k = 6).
    for (seed, expected, bounds) in [(1, None, (8.0, 11.0)), (2, Some(192), (2.0, 3.0))] {
        let tokens = prompt(seed, 4 * BLOCK);
        let id = Uuid::new_v4();
        assert_eq!(
            select_for(&nats, &names, id, &tokens, expected).await,
            WORKER
        );
        let reply = generate(&nats, &names, id, &tokens, 192);
        let seen = watch(&router, |_| reply.is_finished()).await;
        assert!(matches!(reply.await.unwrap(), GenerateResponse::Ok(_)));
        let most = seen
            .iter()
            .filter(|l| known(l))
            .map(|l| field(l, "output_blocks"))
            .fold(0.0, f64::max);
        assert!(
            most >= bounds.0 && most <= bounds.1,
            "expected {expected:?}: at most {most} output blocks seen, want {bounds:?}: {seen:?}"
        );
        // `finished` takes everything the view predicted for it away.
        watch(&router, |l| {
            !known(l) || field(l, "active_requests") == 0.0 && field(l, "output_blocks") == 0.0
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_prefill_decays_and_the_rate_is_learned() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let etcd = env.etcd.connect().await.unwrap();
    let _fleet = Fleet::start(&fleet_config(), nats.clone(), etcd, &names)
        .await
        .unwrap();

    // At 1,000 tokens/s a 2,048-token prompt's prefill is predicted to take 2 s: selected but
    // never sent to the worker, it falls to 0 over those 2 s and stays charged as a request.
    let mut fixed = RouterProcess::start(
        &env,
        "fixed",
        &[
            "--prefill-load-model",
            "decay",
            "--prefill-tokens-per-sec",
            "1000",
        ],
    )
    .unwrap();
    let tokens = prompt(1, 128 * BLOCK);
    let selected = Instant::now();
    select_for(&nats, &names, Uuid::new_v4(), &tokens, None).await;
    let seen = watch(&fixed, |l| field(l, "active_prefill_tokens") == 0.0).await;
    let elapsed = selected.elapsed();
    let prefill: Vec<f64> = seen
        .iter()
        .map(|l| field(l, "active_prefill_tokens"))
        .collect();
    assert!(prefill[0] > 1_000.0 && prefill[0] <= 2_048.0, "{prefill:?}");
    assert!(prefill.windows(2).all(|w| w[1] <= w[0]), "{prefill:?}");
    assert!(
        prefill.iter().any(|&p| p > 0.0 && p < 1_000.0),
        "{prefill:?}"
    );
    assert!(elapsed >= Duration::from_millis(1_900), "{elapsed:?}");
    assert_eq!(field(&seen[seen.len() - 1], "active_requests"), 1.0);
    assert_eq!(field(&seen[0], "prefill_tokens_per_sec"), 1_000.0);
    fixed.stop().unwrap();

    // Without a configured rate, a rank assumes 10,000 tokens/s until its first prefill_done,
    // then uses the rate it observed (a 2,048-token prompt takes about 90 ms here).
    let fitted = RouterProcess::start(&env, "fitted", &["--prefill-load-model", "decay"]).unwrap();
    let id = Uuid::new_v4();
    let tokens = prompt(2, 128 * BLOCK);
    select_for(&nats, &names, id, &tokens, None).await;
    assert_eq!(
        field(&rank_load(&fitted), "prefill_tokens_per_sec"),
        10_000.0
    );
    let reply = generate(&nats, &names, id, &tokens, 1);
    assert!(matches!(reply.await.unwrap(), GenerateResponse::Ok(_)));
    let seen = watch(&fitted, |l| {
        l.is_some() && field(l, "prefill_tokens_per_sec") != 10_000.0
    })
    .await;
    let rate = field(&seen[seen.len() - 1], "prefill_tokens_per_sec");
    assert!((100.0..=10_000_000.0).contains(&rate), "{rate}");
}
