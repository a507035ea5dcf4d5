//! The admission queue through real processes: with every worker busy (a request's prefill
//! tokens above `--busy-prefill-tokens`), requests wait in the partition owner's queue, are
//! served in priority order one per freed slot as lifecycle events free capacity, time out
//! with `queue_timeout`, find a full queue `queue_full`; over two replicas the owner alone
//! dispatches; a replica stopped or killed with requests queued leaves its clients with an
//! answer or a retry, never silence.

use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::client::{RetryPolicy, SelectCallFailure, SelectClient};
use kvroute_common::messages::{ErrorCode, SelectRequest, SelectResponse, WorkerRole};
use kvroute_common::{RequestId, WorkerId};
use kvroute_router::decide::owner::owner;
use kvroute_router::service::metrics as rm;
use kvroute_tests::{
    IndexerProcess, RouterProcess, TestEnv, expect_worker, fleet_worker, prompt_workers, request,
    send_select, wait_routers_registered,
};
use kvroute_tests::{labelled, series};
use tokio::task::JoinHandle;
use uuid::Uuid;
const PARTITION: &[(&str, &str)] = &[("model", "m"), ("role", "aggregated")];
const CLASS_0: &[(&str, &str)] = &[("model", "m"), ("role", "aggregated"), ("class", "0")];

/// One request keeps a worker busy: 1,040 prompt tokens of prefill against a threshold of
/// 1,000.
const BUSY: &[&str] = &["--busy-prefill-tokens", "1000"];

fn prompt(i: u32) -> Vec<u32> {
    (0..1040).map(|t| i * 10_000 + t).collect()
}

fn queued_request(i: u32, priority: i32, queue_timeout_ms: u64) -> SelectRequest {
    let mut r = request("m", prompt(i));
    r.request_id = Some(Uuid::from_u128(u128::from(i)));
    r.priority = Some(priority);
    r.queue_timeout_ms = Some(queue_timeout_ms);
    r
}

fn code(response: &SelectResponse) -> Option<ErrorCode> {
    match response {
        SelectResponse::Ok(_) => None,
        SelectResponse::Error(e) => Some(e.code),
    }
}

/// Takes every answered request out of `pending`.
fn answered(pending: &[(u32, JoinHandle<SelectResponse>)]) -> Vec<u32> {
    pending
        .iter()
        .filter(|(_, h)| h.is_finished())
        .map(|(i, _)| *i)
        .collect()
}

async fn take(pending: &mut Vec<(u32, JoinHandle<SelectResponse>)>, i: u32) -> SelectResponse {
    let at = pending.iter().position(|(j, _)| *j == i).unwrap();
    pending.remove(at).1.await.unwrap()
}

/// Waits until exactly one more request is answered, checks it is `expected`, and that no
/// other follows within 300 ms (one freed slot serves one request).
async fn one_answer(
    pending: &mut Vec<(u32, JoinHandle<SelectResponse>)>,
    expected: u32,
) -> SelectResponse {
    for _ in 0..200 {
        if !answered(pending).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        answered(pending),
        vec![expected],
        "exactly one answer per freed slot"
    );
    take(pending, expected).await
}

/// Occupies the four workers with one request each (answered at once, each on its own
/// worker); returns request id → worker.
async fn saturate(nats: &async_nats::Client, names: &Names) -> Vec<(RequestId, WorkerId)> {
    let mut held = Vec::new();
    for i in 0..4 {
        let r = queued_request(1_000 + i, 0, 10_000);
        let reply = expect_worker(send_select(nats, names.select(), &r).await.unwrap());
        held.push((r.request_id.unwrap(), reply.worker_id));
    }
    let mut workers: Vec<WorkerId> = held.iter().map(|h| h.1).collect();
    workers.sort_unstable();
    workers.dedup();
    assert_eq!(workers.len(), 4, "one request per worker: {held:?}");
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_run_in_priority_order_one_per_freed_slot() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let router = RouterProcess::start(&env, "solo", BUSY).unwrap();
    wait_routers_registered(&env, &names, 1).await;
    let nats = env.nats.connect().await.unwrap();
    let held = saturate(&nats, &names).await;

    // Six more, in this arrival order, with these priorities: all wait.
    let priorities = [0, 5, 1, 5, -1, 3];
    let mut pending = Vec::new();
    for (i, p) in priorities.iter().enumerate() {
        let i = i as u32;
        pending.push((
            i,
            send_select(&nats, names.select(), &queued_request(i, *p, 20_000)),
        ));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        answered(&pending).is_empty(),
        "every worker is busy: they wait"
    );
    let depth = &series(rm::names::QUEUE_DEPTH, CLASS_0);
    assert_eq!(router.metric(depth), 6.0);

    // Free one slot at a time: larger priority first, FCFS among equals, each on the worker
    // that freed.
    let mut running = held.clone();
    for expected in [1, 3, 5, 2, 0, 4] {
        let (request_id, worker_id) = running.remove(0);
        fleet_worker(&fleet, worker_id).finish(request_id, 1).await;
        let reply = expect_worker(one_answer(&mut pending, expected).await);
        assert_eq!(reply.worker_id, worker_id, "served on the freed worker");
        running.push((reply.request_id, reply.worker_id));
    }
    let dispatched = &series(rm::names::QUEUE_DISPATCHED, CLASS_0);
    assert_eq!(router.metric(dispatched), 6.0);
    assert_eq!(router.metric(depth), 0.0);
    let waits = &series(&format!("{}_count", rm::names::QUEUE_WAIT_SECONDS), CLASS_0);
    assert_eq!(router.metric(waits), 6.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_expire_a_full_queue_refuses_and_a_stopped_router_answers_its_queue() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let mut args = BUSY.to_vec();
    args.extend(["--queue-max-len", "2"]);
    let mut router = RouterProcess::start(&env, "solo", &args).unwrap();
    wait_routers_registered(&env, &names, 1).await;
    let nats = env.nats.connect().await.unwrap();
    saturate(&nats, &names).await;

    // Two wait 600 ms and time out; a third finds the queue full at once.
    let started = std::time::Instant::now();
    let a = send_select(&nats, names.select(), &queued_request(1, 0, 600));
    let b = send_select(&nats, names.select(), &queued_request(2, 0, 600));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let full = send_select(&nats, names.select(), &queued_request(3, 0, 600))
        .await
        .unwrap();
    assert_eq!(code(&full), Some(ErrorCode::QueueFull), "{full:?}");
    assert!(started.elapsed() < Duration::from_millis(500));
    for h in [a, b] {
        let response = h.await.unwrap();
        assert_eq!(
            code(&response),
            Some(ErrorCode::QueueTimeout),
            "{response:?}"
        );
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(600) && waited < Duration::from_millis(2_000),
        "{waited:?}"
    );
    let timeouts = &series(rm::names::QUEUE_TIMEOUTS, CLASS_0);
    assert_eq!(router.metric(timeouts), 2.0);
    assert_eq!(
        router.metric(&series(rm::names::QUEUE_FULL, PARTITION)),
        1.0
    );

    // An attempt's own deadline bounds its wait too, and its answer comes before it.
    let mut short = queued_request(4, 0, 20_000);
    short.deadline_ms = Some(kvroute_common::messages::now_ms() + 400);
    let response = send_select(&nats, names.select(), &short).await.unwrap();
    assert_eq!(
        code(&response),
        Some(ErrorCode::QueueTimeout),
        "{response:?}"
    );

    // Stopped with requests queued: they are answered `unavailable` (clients retry elsewhere).
    let c = send_select(&nats, names.select(), &queued_request(5, 0, 20_000));
    let d = send_select(&nats, names.select(), &queued_request(6, 0, 20_000));
    tokio::time::sleep(Duration::from_millis(300)).await;
    router.stop().unwrap();
    for h in [c, d] {
        let response = h.await.unwrap();
        assert_eq!(
            code(&response),
            Some(ErrorCode::Unavailable),
            "{response:?}"
        );
    }
}

/// Four workers, an indexer and two router replicas (busy above one request), registered.
struct Replicas {
    env: TestEnv,
    names: Names,
    fleet: Vec<kvroute_tests::PromptWorker>,
    _indexer: IndexerProcess,
    routers: Vec<RouterProcess>,
    /// The replica owning model `m`'s aggregated partition.
    owner_id: &'static str,
}

async fn two_replicas() -> Replicas {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let fleet = prompt_workers(&env, &[1, 2, 3, 4]).await;
    let indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let ids = ["r-a", "r-b"];
    let routers: Vec<RouterProcess> = ids
        .iter()
        .map(|id| RouterProcess::start(&env, id, BUSY).unwrap())
        .collect();
    wait_routers_registered(&env, &names, 2).await;
    let owner_id = owner(ids, "m", WorkerRole::Aggregated).unwrap();
    Replicas {
        env,
        names,
        fleet,
        _indexer: indexer,
        routers,
        owner_id,
    }
}

/// Two replicas: requests reaching either wait in the owner's queue (the other forwards them
/// and the owner answers their clients), and each freed slot serves exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_never_dispatch_two_queued_requests_onto_one_freed_slot() {
    let Replicas {
        env,
        names,
        fleet,
        _indexer,
        routers,
        owner_id,
    } = two_replicas().await;
    let other = routers.iter().find(|r| r.router_id != owner_id).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let held = saturate(&nats, &names).await;

    // Six queued, alternately on each replica's own subject.
    let mut pending = Vec::new();
    for i in 0..6u32 {
        let subject = names.router_select(["r-a", "r-b"][i as usize % 2]);
        pending.push((
            i,
            send_select(&nats, subject, &queued_request(i, 0, 20_000)),
        ));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(answered(&pending).is_empty());
    assert_eq!(
        other.metric(&labelled(rm::labels::FORWARDS, rm::labels::FORWARD_QUEUED)),
        3.0,
        "the other replica's three went to the owner's queue"
    );

    let mut running = held.clone();
    for expected in 0..6u32 {
        let (request_id, worker_id) = running.remove(0);
        fleet_worker(&fleet, worker_id).finish(request_id, 1).await;
        let reply = expect_worker(one_answer(&mut pending, expected).await);
        assert_eq!(reply.worker_id, worker_id);
        assert_eq!(
            reply.router_id, owner_id,
            "the owner decides queued requests"
        );
        running.push((reply.request_id, reply.worker_id));
    }
}

/// The owner killed with requests queued: every client gets an answer (its retry reaches the
/// surviving replica, which owns the partition once the dead one's registration expires).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_leaves_its_queued_clients_a_retry_not_silence() {
    let Replicas {
        env,
        names,
        fleet,
        _indexer,
        routers,
        owner_id,
    } = two_replicas().await;
    let nats = env.nats.connect().await.unwrap();
    let held = saturate(&nats, &names).await;

    // Clients that let a selection wait 4 s in a queue, with retries.
    let policy = RetryPolicy {
        queue_wait: Duration::from_secs(4),
        ..RetryPolicy::SELECT
    };
    let client = std::sync::Arc::new(SelectClient::new(nats.clone(), &names, policy));
    let sends: Vec<_> = (0..6u32)
        .map(|i| {
            let client = client.clone();
            let mut r = request("m", prompt(i));
            r.request_id = Some(Uuid::from_u128(u128::from(i)));
            tokio::spawn(async move { client.select(r).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let victim = routers.iter().find(|r| r.router_id == owner_id).unwrap();
    victim.signal(nix::sys::signal::Signal::SIGKILL).unwrap();
    // Capacity frees while the clients retry: the survivor serves them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (request_id, worker_id) in &held {
        fleet_worker(&fleet, *worker_id)
            .finish(*request_id, 1)
            .await;
    }
    let mut served = 0;
    let mut timed_out = 0;
    for send in sends {
        match send.await.unwrap() {
            Ok(selected) => {
                assert!((1..=4).contains(&selected.reply.worker_id));
                assert_ne!(selected.reply.router_id, owner_id);
                served += 1;
            }
            Err(SelectCallFailure::Refused(e)) if e.code == ErrorCode::QueueTimeout => {
                timed_out += 1
            }
            Err(e) => panic!("a client was left without an answer: {e:?}"),
        }
    }
    eprintln!("served {served}, timed out in the queue {timed_out}");
    assert_eq!(served + timed_out, 6);
    assert!(served >= 4, "four slots freed: {served} served");
}
