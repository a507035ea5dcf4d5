//! Indexer replicas that stall or are not ready must not mislead routers: a stopped replica
//! costs remote-overlap routing only the fallbacks of the NATS ping deadline (retries go to
//! the replica that answered last), and a replica that bootstraps again after its log was
//! purged under it answers nothing until it is ready.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_common::client::{RetryPolicy, SelectClient};
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    IndexQuery, IndexQueryResponse, SelectResponse, StorageTier, WorkerCard,
};
use kvroute_common::ops::watchdog;
use kvroute_common::{Names, WorkerId};
use kvroute_indexer::service::metrics as im;
use kvroute_router::service::metrics::labels::OVERLAP_FALLBACKS;
use kvroute_router::service::overlap::Fallback;
use kvroute_tests::labelled;
use kvroute_tests::{
    IndexerProcess, LoadPlan, LoadReport, PromptWorker, RouterProcess, TestEnv, continuing,
    http_get, prompt_workers, request, select, select_until_overlap, steady_load, worker_card,
};
use nix::sys::signal::Signal;

const RATE: f64 = 20.0;
const BLOCKS: u32 = 8;
const PROMPTS_PER_WORKER: u32 = 10;

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| seed * 100_000 + i).collect()
}

/// Which worker (by index) holds prompt `p` of the load: worker `p % workers`.
fn holder(p: usize, workers: usize) -> usize {
    p % workers
}

fn hit_rate(run: &LoadReport, fleet: &[PromptWorker]) -> f64 {
    let hits = run
        .sent
        .iter()
        .filter(|s| {
            s.result.as_ref().is_ok_and(|sel| {
                sel.reply.worker_id == fleet[holder(s.prompt, fleet.len())].id()
                    && sel.reply.overlap_blocks.get(&StorageTier::Device) == Some(&BLOCKS)
            })
        })
        .count();
    hits as f64 / run.sent.len().max(1) as f64
}

async fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what} not reached in {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn fallbacks_total(router: &RouterProcess) -> f64 {
    Fallback::ALL
        .iter()
        .map(|r| router.metric(&labelled(OVERLAP_FALLBACKS, r.reason())))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_indexer_costs_only_the_ping_deadline_of_fallbacks() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let ix1 = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let ix2 = IndexerProcess::start(&env, "ix-2", &[]).unwrap();
    let fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
    let prompts: Vec<Vec<u32>> = (0..4 * PROMPTS_PER_WORKER)
        .map(|p| prompt(p + 1, BLOCKS))
        .collect();
    for (p, tokens) in prompts.iter().enumerate() {
        fleet[holder(p, fleet.len())].store_prompt(tokens).await;
    }
    let entries = u64::from(4 * PROMPTS_PER_WORKER * BLOCKS);
    wait_for(
        "both replicas indexed every prompt",
        Duration::from_secs(30),
        || {
            [&ix1, &ix2].iter().all(|ix| {
                ix.is_ready()
                    && ix
                        .status()
                        .is_ok_and(|s| s["entries"].as_u64() == Some(entries))
            })
        },
    )
    .await;
    // No predicted overlap: a reply's overlap then comes from the index alone, which is what
    // this test reads it for.
    let router = RouterProcess::start(&env, "r1", &["--predicted-overlap-ttl-ms", "0"]).unwrap();
    let fleet = Arc::new(fleet);
    // Sent one token longer than stored, so every stored block counts as overlap.
    let prompts = Arc::new(prompts.iter().map(|p| continuing(p)).collect::<Vec<_>>());
    let nats = env.nats.connect().await.unwrap();
    let client = Arc::new(SelectClient::new(nats, &names, RetryPolicy::SELECT));
    let plan = |secs| LoadPlan {
        rate_per_s: RATE,
        duration: Duration::from_secs(secs),
        run_time: Duration::from_millis(50),
    };

    let calm = steady_load(
        client.clone(),
        fleet.clone(),
        "m",
        prompts.clone(),
        plan(10),
    )
    .await;
    let calm_hits = hit_rate(&calm, &fleet);
    let before = fallbacks_total(&router);
    let stall = tokio::spawn(steady_load(
        client.clone(),
        fleet.clone(),
        "m",
        prompts.clone(),
        plan(40),
    ));
    tokio::time::sleep(Duration::from_secs(5)).await;
    ix2.signal(Signal::SIGSTOP).unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    ix2.signal(Signal::SIGCONT).unwrap();
    let run = stall.await.unwrap();
    let stalled_hits = hit_rate(&run, &fleet);
    let fell_back = fallbacks_total(&router) - before;
    let retries = router.metric("kvroute_router_overlap_retries_total");
    eprintln!(
        "hit rate {:.1} % unstalled, {:.1} % with one of two indexers stopped 30 s; {fell_back} of {} selections fell back to load only, {retries} overlap retries; selection success {:.2} %",
        calm_hits * 100.0,
        stalled_hits * 100.0,
        run.sent.len(),
        run.success() * 100.0
    );
    assert!(calm_hits >= 0.95, "the unstalled run hit {calm_hits:.3}");
    assert!(
        stalled_hits >= calm_hits - 0.05,
        "hit rate {stalled_hits:.3} vs {calm_hits:.3} unstalled"
    );
    // At most the requests of the NATS ping deadline (2 s x (2 + 1)) could meet the stopped
    // replica on their first attempt; a retry goes to the replica that answered last.
    assert!(
        fell_back <= RATE * 6.0 * 0.5,
        "{fell_back} fallbacks: more than the ping deadline's worth"
    );
    assert_eq!(run.success(), 1.0, "{:?}", run.failures());
    // The stopped replica noticed when it ran again, and serves again once caught up.
    wait_for("ix-2 serving again", Duration::from_secs(20), || {
        ix2.is_ready()
    })
    .await;
    let leaves = ix2.metric(&labelled(im::labels::GROUP_LEAVES, watchdog::LEFT_LAGGING));
    assert!(leaves >= 1.0, "ix-2's watchdog never stepped it out");
}

/// A worker card registered straight in etcd (no agent), whose resync the test answers.
async fn register_card(env: &TestEnv, card: &WorkerCard) -> etcd_client::Client {
    let names = Names::new(&env.namespace);
    let mut etcd = env.etcd.connect().await.unwrap();
    let lease = etcd.lease_grant(120, None).await.unwrap();
    etcd.put(
        names.worker_key(card.worker_id),
        encode(card).unwrap().to_vec(),
        Some(etcd_client::PutOptions::new().with_lease(lease.id())),
    )
    .await
    .unwrap();
    etcd
}

/// Whether a NATS client named `name` is connected (the server's monitoring endpoint).
fn connected(env: &TestEnv, name: &str) -> bool {
    let (_, body) = http_get(env.nats.monitor_port, "/connz?limit=1024").expect("nats monitor");
    let connz: serde_json::Value = serde_json::from_str(&body).expect("connz JSON");
    connz["connections"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["name"] == name))
}

/// Answers every resync request of `worker` 8 s late, so a bootstrap that waits for it lasts
/// that long.
async fn answer_resyncs_late(nats: &async_nats::Client, names: &Names, worker: WorkerId) {
    let mut resyncs = nats.subscribe(names.worker_resync(worker)).await.unwrap();
    let responder = nats.clone();
    tokio::spawn(async move {
        while let Some(msg) = resyncs.next().await {
            let nats = responder.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(8)).await;
                if let Some(reply) = msg.reply {
                    let _ = nats.publish(reply, "ok".into()).await;
                }
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indexer_bootstrapping_again_answers_nothing_until_it_is_ready() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    // No snapshots: after its log is purged the replica must ask every worker to resync.
    let ix = IndexerProcess::start(
        &env,
        "ix-1",
        &[
            "--snapshot-every-messages",
            "0",
            "--snapshot-interval-secs",
            "0",
        ],
    )
    .unwrap();
    let w1 = prompt_workers(&env, &[1]).await.remove(0);
    // Worker 99 answers its resync only after 8 s: the replica's bootstrap waits for it.
    const SLOW: WorkerId = 99;
    let _etcd = register_card(&env, &worker_card(&names, SLOW, "m")).await;
    let nats = env.nats.connect().await.unwrap();
    answer_resyncs_late(&nats, &names, SLOW).await;
    let first = prompt(1, BLOCKS);
    w1.store_prompt(&first).await;
    // No predicted overlap: a reply's overlap then comes from the index alone, which is what
    // this test reads it for.
    let router = RouterProcess::start(&env, "r1", &["--predicted-overlap-ttl-ms", "0"]).unwrap();
    let req = request("m", continuing(&first));
    select_until_overlap(&nats, &names, &req, BLOCKS, Duration::from_secs(30)).await;

    // Stop the replica until the server drops its connection (its consumer's pending pulls go
    // with it), then publish and purge under it: the log skips what it had not applied.
    ix.signal(Signal::SIGSTOP).unwrap();
    wait_for(
        "the server dropping the stopped replica",
        Duration::from_secs(15),
        || !connected(&env, "ix-1"),
    )
    .await;
    w1.store_prompt(&prompt(2, 4)).await;
    let js = async_nats::jetstream::new(nats.clone());
    js.get_stream(names.events_stream())
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    w1.store_prompt(&prompt(3, 4)).await;
    ix.signal(Signal::SIGCONT).unwrap();

    wait_for(
        "the replica noticing the gap",
        Duration::from_secs(15),
        || ix.log().contains("bootstrapping again"),
    )
    .await;
    let ok_before = ix.metric(&labelled(im::labels::QUERIES, im::labels::QUERY_OK));
    let query = IndexQuery {
        model: "m".into(),
        block_hashes: Some(kvroute_common::hashing::local_block_hashes(
            &first,
            16,
            kvroute_common::hashing::seed_for_lora(None),
        )),
        ..Default::default()
    };
    let mut checked = 0;
    let mut fallbacks = 0;
    while !ix.is_ready() {
        // Neither the group nor the replica's own subject gives an answer.
        for subject in [names.index_query(), names.indexer_query("ix-1")] {
            let asked = tokio::time::timeout(
                Duration::from_secs(2),
                nats.request(subject, encode(&query).unwrap()),
            )
            .await
            .expect("an answer or no responders, at once");
            if let Ok(msg) = asked {
                match decode::<IndexQueryResponse>(&msg.payload).unwrap() {
                    IndexQueryResponse::Error(e) => {
                        assert_eq!(e.code, kvroute_common::messages::IndexErrorCode::NotReady)
                    }
                    IndexQueryResponse::Ok(r) if !ix.is_ready() => {
                        panic!("a replica that is not ready answered: {r:?}")
                    }
                    IndexQueryResponse::Ok(_) => {}
                }
            }
        }
        // And the router scores on load alone instead of trusting a cold state.
        let answered = match select(&nats, &names, &req).await.unwrap() {
            SelectResponse::Ok(r) => r,
            SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
        };
        if answered
            .overlap_blocks
            .get(&StorageTier::Device)
            .is_none_or(|b| *b == 0)
        {
            fallbacks += 1;
        } else {
            assert!(ix.is_ready(), "the router used a replica that is not ready");
        }
        checked += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(checked < 200, "never ready again:\n{}", ix.log());
    }
    let ok_after = ix.metric(&labelled(im::labels::QUERIES, im::labels::QUERY_OK));
    eprintln!(
        "while bootstrapping again: {checked} rounds of queries, {fallbacks} router fallbacks, {} ok answers",
        ok_after - ok_before
    );
    assert!(
        checked >= 10,
        "the not-ready window was too short to test ({checked})"
    );
    assert!(fallbacks >= checked - 1);
    // Every load-only selection was counted as a fallback (no responders once the replica
    // left its group; timeouts or not_ready in the moments before it did).
    assert!(
        fallbacks_total(&router) >= f64::from(fallbacks),
        "{} fallbacks counted for {fallbacks} load-only selections",
        fallbacks_total(&router)
    );
    // Ready again with the workers' resynced state: overlap comes back.
    select_until_overlap(&nats, &names, &req, BLOCKS, Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_one_indexer_bootstraps_again_routers_use_the_ready_one() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let quiet = [
        "--snapshot-every-messages",
        "0",
        "--snapshot-interval-secs",
        "0",
    ];
    let ix1 = IndexerProcess::start(&env, "ix-1", &quiet).unwrap();
    let ix2 = IndexerProcess::start(&env, "ix-2", &quiet).unwrap();
    let w1 = prompt_workers(&env, &[1]).await.remove(0);
    // Worker 99 answers its resync only after 8 s, so ix-1's bootstrap takes that long.
    const SLOW: WorkerId = 99;
    let _etcd = register_card(&env, &worker_card(&names, SLOW, "m")).await;
    let nats = env.nats.connect().await.unwrap();
    answer_resyncs_late(&nats, &names, SLOW).await;
    let first = prompt(1, BLOCKS);
    w1.store_prompt(&first).await;
    // No predicted overlap: a reply's overlap then comes from the index alone, which is what
    // this test reads it for.
    let router = RouterProcess::start(&env, "r1", &["--predicted-overlap-ttl-ms", "0"]).unwrap();
    let req = request("m", continuing(&first));
    select_until_overlap(&nats, &names, &req, BLOCKS, Duration::from_secs(30)).await;

    // Only ix-1 misses the purged part of the log: ix-2 keeps consuming throughout.
    ix1.signal(Signal::SIGSTOP).unwrap();
    wait_for(
        "the server dropping the stopped replica",
        Duration::from_secs(15),
        || !connected(&env, "ix-1"),
    )
    .await;
    w1.store_prompt(&prompt(2, 4)).await;
    let js = async_nats::jetstream::new(nats.clone());
    let mut stream = js.get_stream(names.events_stream()).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence as f64;
    wait_for(
        "ix-2 applying the whole log",
        Duration::from_secs(10),
        || ix2.metric_if_up("kvroute_indexer_applied_sequence") == Some(last),
    )
    .await;
    stream.purge().await.unwrap();
    w1.store_prompt(&prompt(3, 4)).await;
    ix1.signal(Signal::SIGCONT).unwrap();
    wait_for("ix-1 noticing the gap", Duration::from_secs(15), || {
        ix1.log().contains("bootstrapping again")
    })
    .await;
    assert!(ix2.is_ready(), "ix-2 stays ready:\n{}", ix2.log());

    // Selections keep the overlap: the router's queries are answered by ix-2 alone. A query
    // already delivered to ix-1 as it turned not ready is answered `not_ready` and retried on
    // another replica within the same deadline.
    let ok2_before = ix2.metric(&labelled(im::labels::QUERIES, im::labels::QUERY_OK));
    let fallbacks_before = fallbacks_total(&router);
    let (mut rounds, mut load_only) = (0, 0);
    while !ix1.is_ready() {
        let answered = match select(&nats, &names, &req).await.unwrap() {
            SelectResponse::Ok(r) => r,
            SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
        };
        if answered.overlap_blocks.get(&StorageTier::Device) != Some(&BLOCKS) {
            load_only += 1;
        }
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(rounds < 200, "ix-1 never ready again:\n{}", ix1.log());
    }
    let ok2 = ix2.metric(&labelled(im::labels::QUERIES, im::labels::QUERY_OK)) - ok2_before;
    let fallbacks = fallbacks_total(&router) - fallbacks_before;
    eprintln!(
        "while ix-1 bootstrapped again: {rounds} selections, {load_only} on load alone, \
         {fallbacks} router fallbacks, {ok2} ok answers from ix-2"
    );
    assert!(
        rounds >= 10,
        "the not-ready window was too short to test ({rounds})"
    );
    // At most the selections in flight while ix-1 left its group go without overlap.
    assert!(
        load_only <= 1,
        "{load_only} of {rounds} selections scored on load alone while ix-2 was ready"
    );
    assert!(fallbacks <= 1.0, "{fallbacks} overlap fallbacks");
    assert!(
        ok2 >= f64::from(rounds - load_only),
        "ix-2 answered {ok2} of {rounds} selections' queries"
    );
}
