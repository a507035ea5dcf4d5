//! Through real processes: a worker announcing a prompt in the shared tier earns every worker
//! the default cost model's shared-cache credit (when its multiplier is on), and a mixed fleet
//! of CPU and accelerator mocker workers under `device-aware-weighted` splits requests in the
//! ratio of the groups' capacities.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    GenerateRequest, IndexQuery, IndexQueryResponse, SelectReply, SelectRequest, SelectResponse,
    StorageTier,
};
use kvroute_mocker::fleet::{EngineArgs, Fleet, FleetConfig};
use kvroute_router::service::metrics as rm;
use kvroute_tests::series;
use kvroute_tests::{IndexerProcess, RouterProcess, TestEnv, prompt_workers, request, select};

fn yaml(env: &TestEnv, name: &str, text: &str) -> String {
    let path = env.nats.data_dir().join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn ok(response: SelectResponse) -> SelectReply {
    match response {
        SelectResponse::Ok(r) => r,
        SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
    }
}

const SHARED: &str = "worker_selection:
  aggregated: plain
  instances:
    - name: plain
      type: default
    - name: shared
      type: default
      parameters:
        shared_cache_multiplier: 1.0
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_tier_blocks_earn_every_worker_the_shared_cache_credit() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let fleet = prompt_workers(&env, &[1, 2]).await;
    let path = yaml(&env, "shared.yaml", SHARED);
    // Without predicted overlap, so that a decision for worker 2 does not count as its cache.
    let _router = RouterProcess::start(
        &env,
        "r1",
        &["--policy-config", &path, "--predicted-overlap-ttl-ms", "0"],
    )
    .unwrap();
    let nats = env.nats.connect().await.unwrap();
    // Worker 1 holds the first 8 blocks of a 10-block prompt on its device and wrote them to
    // the shared tier; it is busy, so worker 2 gets the request either way.
    // One token more than 10 blocks: an engine can reuse all 10 (it computes the last token).
    let tokens: Vec<u32> = (0..10 * 16 + 1).collect();
    fleet[0].store_prompt(&tokens[..8 * 16]).await;
    fleet[0]
        .store_prompt_in(&tokens[..8 * 16], StorageTier::Shared)
        .await;
    fleet[0].report_load(20, 50_000).await;
    // The indexer reports the shared prefix in every row (asked directly: a selection would
    // charge the router's load view).
    let query = IndexQuery {
        model: "m".into(),
        token_ids: Some(tokens.clone()),
        block_size: Some(16),
        ..IndexQuery::default()
    };
    let start = Instant::now();
    loop {
        let reply = nats
            .request(names.index_query(), encode(&query).unwrap())
            .await
            .map(|m| decode::<IndexQueryResponse>(&m.payload).unwrap());
        if let Ok(IndexQueryResponse::Ok(r)) = &reply
            && r.matches.iter().any(|m| m.shared == 8)
        {
            assert_eq!((r.matches[0].device, r.matches[0].shared), (8, 8));
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{reply:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let worker 1's load report reach the router.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let with = |policy: &str| SelectRequest {
        policy: Some(policy.into()),
        ..request("m", tokens.clone())
    };
    let shared = ok(select(&nats, &names, &with("shared")).await.unwrap());
    // 64 · max(10 − 1.0 · (8 − 0), 0): the 8 shared blocks beyond worker 2's empty device.
    assert_eq!(
        (shared.worker_id, shared.cost.terms["prefill"]),
        (2, 128.0),
        "{shared:?}"
    );
    assert!(
        shared.overlap_blocks.is_empty(),
        "worker 2 holds nothing itself"
    );
    // The default multiplier (0) gives no credit: 64 · (10 + 161 / 16), the first decision's
    // 161 tokens being queued on worker 2 now (the router charged it).
    let plain = ok(select(&nats, &names, &with("plain")).await.unwrap());
    assert_eq!(
        (plain.worker_id, plain.cost.terms["prefill"]),
        (2, 1284.0),
        "{plain:?}"
    );
    // Worker 1's own device prefix covers the shared one: no shared credit on top of it.
    let mut pinned = with("shared");
    pinned.pin = Some(kvroute_common::messages::Pin {
        worker_id: 1,
        dp_rank: None,
    });
    let on_1 = ok(select(&nats, &names, &pinned).await.unwrap());
    assert_eq!(on_1.overlap_blocks.get(&StorageTier::Device), Some(&8));
    // 64 · max(10 − 1 · 8, 0) = 128: the 2 blocks it must still compute, with or without the
    // multiplier (a credit above 1 offsets only queued prefill, and worker 1 has none).
    assert_eq!(on_1.cost.terms["prefill"], 128.0);
}

const DEVICE_AWARE: &str = "worker_selection:
  aggregated: devices
  instances:
    - name: devices
      type: device-aware-weighted
      parameters:
        accelerator_to_cpu_ratio: 3
";

fn fleet(first: u64, labels: &[&str], slowdown: u64) -> FleetConfig {
    let engine = EngineArgs::default();
    FleetConfig {
        workers: 2,
        worker_id_start: first,
        model: "m".into(),
        engine: EngineArgs {
            block_size: 16,
            num_blocks: 4096,
            step_overhead_us: engine.step_overhead_us * slowdown,
            prefill_ns_per_token: engine.prefill_ns_per_token * slowdown,
            decode_ns_per_seq: engine.decode_ns_per_seq * slowdown,
            ..engine
        },
        labels: labels.iter().map(|l| l.to_string()).collect(),
        lease_ttl_secs: 2,
        load_interval_ms: 100,
        ..FleetConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_splits_in_the_ratio_of_the_device_groups_capacities() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let start = |config: FleetConfig| {
        let env = &env;
        let names = &names;
        async move {
            Fleet::start(
                &config,
                env.nats.connect().await.unwrap(),
                env.etcd.connect().await.unwrap(),
                names,
            )
            .await
            .unwrap()
        }
    };
    // Workers 1, 2: accelerators; 11, 12: CPU workers, 4× slower.
    let accelerators = start(fleet(1, &[], 1)).await;
    let cpus = start(fleet(11, &["kvroute.io/device=cpu"], 4)).await;
    let path = yaml(&env, "devices.yaml", DEVICE_AWARE);
    let router = RouterProcess::start(&env, "r1", &["--policy-config", &path]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    // 16 requests that each run for seconds (10 s on an accelerator, 40 s on a CPU worker):
    // the split is the policy's, from the load view.
    let mut per_worker: BTreeMap<u64, u32> = BTreeMap::new();
    for i in 0..16u32 {
        let tokens: Vec<u32> = (0..64).map(|t| i * 1000 + t).collect();
        let r = ok(select(&nats, &names, &request("m", tokens.clone()))
            .await
            .unwrap());
        assert_eq!(r.policy, "devices");
        *per_worker.entry(r.worker_id).or_default() += 1;
        let generate = GenerateRequest {
            request_id: r.request_id,
            token_ids: Some(tokens),
            max_tokens: 1000,
            ..GenerateRequest::default()
        };
        nats.publish(r.request_subject, encode(&generate).unwrap())
            .await
            .unwrap();
        // Until the worker has taken it and reported (it reports on every change), a request
        // counts from the router's own charge; after, from the report.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let accelerator: u32 = per_worker.range(..10).map(|(_, n)| n).sum();
    let cpu: u32 = per_worker.range(10..).map(|(_, n)| n).sum();
    // Capacities 2 · 3 : 2 · 1 → 12 : 4 from the router's own charges alone (ties go to the
    // accelerators). The workers' reports replace those charges as they come, and a report
    // taken while a request still waits for its first step names it without counting it
    // active, so a request may land on the other side. Least-busy would split 8 : 8.
    assert!(
        (11..=13).contains(&accelerator) && accelerator + cpu == 16,
        "{per_worker:?}"
    );
    // Within each group the least-loaded rank: every rank serves.
    assert_eq!(per_worker.len(), 4, "{per_worker:?}");
    assert!(router.metric(&series(rm::names::DECISIONS, &[("worker", "11/0")])) >= 1.0);
    accelerators.shutdown().await;
    cpus.shutdown().await;
}
