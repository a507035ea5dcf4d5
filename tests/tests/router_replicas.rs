//! Router replicas that behave like one router: a burst sharing a long prefix, spread over 4
//! replicas, lands as it does on one replica (each (model, role) partition is decided by its
//! owning replica, the others forward to it, and the rest of the burst sees where its first
//! request went through the predicted overlap); and with the owner killed mid-burst every
//! request is still answered.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::client::{RetryPolicy, SelectClient};
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    SelectReply, SelectRequest, SelectResponse, StorageTier, WorkerRole,
};
use kvroute_router::decide::owner::owner;
use kvroute_router::service::metrics as rm;
use kvroute_tests::labelled;
use kvroute_tests::{
    IndexerProcess, RouterProcess, TestEnv, prompt_workers, request, wait_routers_registered,
};

const BURST: usize = 64;
/// Blocks every prompt of the burst shares, then one of its own.
const SHARED_BLOCKS: u32 = 32;

fn prompt(i: usize) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..SHARED_BLOCKS * 16).collect();
    tokens.extend((0..16).map(|t| 1_000_000 + i as u32 * 16 + t));
    tokens
}

/// What a burst did: requests per worker (sorted, largest first) and the device blocks the
/// replies report as cached, over all prompt blocks.
#[derive(Debug)]
struct Outcome {
    spread: Vec<usize>,
    hit: f64,
}

fn outcome(replies: &[SelectReply]) -> Outcome {
    let mut per_worker = BTreeMap::<u64, usize>::new();
    let (mut cached, mut blocks) = (0u64, 0u64);
    for r in replies {
        *per_worker.entry(r.worker_id).or_default() += 1;
        cached += u64::from(
            r.overlap_blocks
                .get(&StorageTier::Device)
                .copied()
                .unwrap_or(0),
        );
        blocks += u64::from(r.request_blocks);
    }
    let mut spread: Vec<usize> = per_worker.into_values().collect();
    spread.sort_unstable_by(|a, b| b.cmp(a));
    Outcome {
        spread,
        hit: cached as f64 / blocks as f64,
    }
}

/// Sends the burst at once, request `i` to replica `i % replicas.len()`'s own subject (an
/// exact spread), and returns the replies in request order.
async fn burst(
    nats: &async_nats::Client,
    names: &Names,
    replicas: &[&str],
    first_id: u128,
) -> Vec<SelectReply> {
    let sends = (0..BURST).map(|i| {
        let subject = names.router_select(replicas[i % replicas.len()]);
        let mut r: SelectRequest = request("m", prompt(i));
        r.request_id = Some(uuid::Uuid::from_u128(first_id + i as u128));
        async move {
            let reply = tokio::time::timeout(
                Duration::from_secs(20),
                nats.request(subject, encode(&r).unwrap()),
            )
            .await
            .expect("answered in time")
            .expect("a responder");
            match decode::<SelectResponse>(&reply.payload).unwrap() {
                SelectResponse::Ok(reply) => reply,
                SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
            }
        }
    });
    futures::future::join_all(sends).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_four_replicas_lands_as_on_one_and_survives_its_owner() {
    // One replica.
    let single = {
        let env = TestEnv::start().unwrap();
        let names = Names::new(&env.namespace);
        let _fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
        let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
        let _router = RouterProcess::start(&env, "solo", &[]).unwrap();
        wait_routers_registered(&env, &names, 1).await;
        let nats = env.nats.connect().await.unwrap();
        outcome(&burst(&nats, &names, &["solo"], 1).await)
    };

    // Four replicas, the same burst spread over them.
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let ids = ["r-a", "r-b", "r-c", "r-d"];
    let routers: Vec<RouterProcess> = ids
        .iter()
        .map(|id| RouterProcess::start(&env, id, &[]).unwrap())
        .collect();
    wait_routers_registered(&env, &names, 4).await;
    let nats = env.nats.connect().await.unwrap();
    let four = outcome(&burst(&nats, &names, &ids, 1).await);
    eprintln!("one replica: {single:?}; four replicas: {four:?}");
    assert_eq!(
        four.spread.len(),
        single.spread.len(),
        "{four:?} vs {single:?}"
    );
    for (a, b) in four.spread.iter().zip(&single.spread) {
        assert!(a.abs_diff(*b) <= 1, "{four:?} vs {single:?}");
    }
    // Within one request's cached blocks of the burst's total.
    let one_request = f64::from(SHARED_BLOCKS) / (BURST as f64 * f64::from(SHARED_BLOCKS + 1));
    assert!(
        (four.hit - single.hit).abs() <= one_request + 1e-9,
        "{four:?} vs {single:?}"
    );
    // The owner made every decision; the others forwarded.
    let owner_id = owner(ids, "m", WorkerRole::Aggregated).unwrap();
    let forwarded: f64 = routers
        .iter()
        .map(|r| {
            r.metric(&labelled(
                rm::labels::FORWARDS,
                rm::labels::FORWARD_ANSWERED,
            ))
        })
        .sum();
    assert_eq!(forwarded, (BURST - BURST / 4) as f64);

    // The owner killed mid-burst: every request is still answered (forwards to it find no
    // responder and are decided where they arrived; its own are retried by the client).
    let client = Arc::new(SelectClient::new(nats.clone(), &names, RetryPolicy::SELECT));
    let sends: Vec<_> = (0..BURST)
        .map(|i| {
            let client = client.clone();
            let mut r = request("m", prompt(1_000 + i));
            r.request_id = Some(uuid::Uuid::from_u128(10_000 + i as u128));
            tokio::spawn(async move { client.select(r).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(2)).await;
    let victim = routers
        .iter()
        .position(|r| r.router_id == owner_id)
        .unwrap();
    routers[victim]
        .signal(nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let mut answered = 0;
    for send in sends {
        match send.await.unwrap() {
            Ok(selected) => {
                assert!((1..=4).contains(&selected.reply.worker_id));
                answered += 1;
            }
            Err(e) => panic!("a request was not answered: {e:?}"),
        }
    }
    assert_eq!(answered, BURST);
    // And afterwards the partition has a new owner among the survivors, which the others
    // forward to.
    let survivors: Vec<&str> = ids.iter().copied().filter(|id| *id != owner_id).collect();
    wait_routers_registered(&env, &names, 3).await;
    let next = owner(survivors.iter().copied(), "m", WorkerRole::Aggregated).unwrap();
    let before: f64 = routers
        .iter()
        .filter(|r| r.router_id != owner_id)
        .map(|r| {
            r.metric(&labelled(
                rm::labels::FORWARDS,
                rm::labels::FORWARD_ANSWERED,
            ))
        })
        .sum();
    let replies = burst(&nats, &names, &survivors, 20_000).await;
    assert_eq!(replies.len(), BURST);
    assert!(replies.iter().all(|r| r.router_id == next), "{next}");
    let after: f64 = routers
        .iter()
        .filter(|r| r.router_id != owner_id)
        .map(|r| {
            r.metric(&labelled(
                rm::labels::FORWARDS,
                rm::labels::FORWARD_ANSWERED,
            ))
        })
        .sum();
    let position = survivors.iter().position(|id| *id == next).unwrap();
    let decided_by_next = (0..BURST).filter(|i| i % 3 == position).count();
    assert_eq!(after - before, (BURST - decided_by_next) as f64);
}
