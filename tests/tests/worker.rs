//! The worker-side library against real servers: registration under a lease (deregister,
//! crash, etcd outage), ordered event publishing, resync.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use kvroute_common::codec::decode;
use kvroute_common::messages::{
    KvEventBatch, KvEventData, StorageTier, StoredBlock, WorkerCard, WorkerRole,
};
use kvroute_common::worker::{
    EventPublisher, RegistrationConfig, ResyncSource, WorkerAgent, WorkerAgentConfig,
};
use kvroute_common::{Names, codec};
use kvroute_tests::TestEnv;

fn card(worker_id: u64, names: &Names) -> WorkerCard {
    WorkerCard {
        v: Default::default(),
        worker_id,
        model: "m".into(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        total_kv_blocks: 1000,
        max_num_batched_tokens: 8192,
        dp_start_rank: 0,
        dp_size: 1,
        taints: vec![],
        labels: Default::default(),
        request_subject: names.worker_requests(worker_id),
        software_version: "test".into(),
        http_url: None,
        kv_events: true,
        lora_adapters: None,
    }
}

fn config(ttl_secs: u64) -> WorkerAgentConfig {
    WorkerAgentConfig {
        registration: RegistrationConfig {
            lease_ttl: Duration::from_secs(ttl_secs),
            retry_interval: Duration::from_millis(100),
        },
        ..Default::default()
    }
}

/// A cache whose whole state is one stored block per entry.
#[derive(Default)]
struct FakeCache(Mutex<Vec<u64>>);

impl FakeCache {
    fn store(&self, publisher: &EventPublisher, hash: u64) {
        let mut held = self.0.lock().unwrap();
        held.push(hash);
        publisher.publish(0, vec![stored(hash)]);
    }
}

impl ResyncSource for FakeCache {
    fn resync(&self, publisher: &EventPublisher) {
        let held = self.0.lock().unwrap();
        let mut events = vec![KvEventData::Cleared];
        events.extend(held.iter().map(|h| stored(*h)));
        publisher.publish(0, events);
    }
}

fn stored(hash: u64) -> KvEventData {
    KvEventData::Stored {
        parent_hash: None,
        blocks: vec![StoredBlock {
            block_hash: hash,
            tokens_hash: hash,
        }],
        tier: StorageTier::Device,
    }
}

async fn ensure_stream(js: &jetstream::Context, names: &Names) -> stream::Stream {
    js.get_or_create_stream(stream::Config {
        name: names.events_stream(),
        subjects: names.events_stream_subjects(),
        ..Default::default()
    })
    .await
    .unwrap()
}

async fn read_events(stream: &stream::Stream, count: usize) -> Vec<(u64, KvEventData)> {
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::new();
    while out.len() < count {
        let msg = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("events arrive")
            .unwrap()
            .unwrap();
        let batch: KvEventBatch = decode(&msg.payload).unwrap();
        out.extend(batch.events.into_iter().map(|e| (e.event_id, e.data)));
    }
    out
}

async fn card_in_etcd(
    etcd: &mut etcd_client::Client,
    names: &Names,
    id: u64,
) -> Option<WorkerCard> {
    let resp = etcd.get(names.worker_key(id), None).await.ok()?;
    resp.kvs()
        .first()
        .map(|kv| codec::decode(kv.value()).unwrap())
}

/// Worker `id`'s agent (a 2 s lease), once its card is in etcd.
async fn registered_agent(
    nats: async_nats::Client,
    etcd: etcd_client::Client,
    names: &Names,
    id: u64,
) -> WorkerAgent {
    let mut agent = WorkerAgent::start(
        nats,
        etcd,
        names,
        card(id, names),
        config(2),
        Arc::new(FakeCache::default()),
    )
    .await
    .unwrap();
    agent.wait_registered().await;
    agent
}

async fn wait_for(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn publishes_in_order_and_answers_resync() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let js = jetstream::new(nats.clone());
    let stream = ensure_stream(&js, &names).await;
    let cache = Arc::new(FakeCache::default());
    let mut agent = WorkerAgent::start(
        nats.clone(),
        env.etcd.connect().await.unwrap(),
        &names,
        card(7, &names),
        config(10),
        cache.clone(),
    )
    .await
    .unwrap();
    agent.wait_registered().await;
    for h in 1..=300 {
        cache.store(agent.publisher(), h);
    }
    agent.publisher().flush().await;
    assert_eq!(
        agent
            .publisher()
            .stats()
            .events_published
            .load(std::sync::atomic::Ordering::Relaxed),
        301
    );

    // Resync: the worker publishes Cleared and its state, then replies.
    let reply = nats
        .request(names.worker_resync(7), "".into())
        .await
        .expect("resync answered");
    assert_eq!(&reply.payload[..], b"ok");

    let events = read_events(&stream, 1 + 300 + 1 + 300).await;
    let ids: Vec<u64> = events.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        ids,
        (0..602).collect::<Vec<_>>(),
        "consecutive event ids, in order"
    );
    assert_eq!(
        events[0].1,
        KvEventData::Cleared,
        "a fresh worker starts with Cleared"
    );
    assert_eq!(
        events[301].1,
        KvEventData::Cleared,
        "resync starts with Cleared"
    );
    let data =
        |r: std::ops::Range<usize>| events[r].iter().map(|(_, d)| d.clone()).collect::<Vec<_>>();
    assert!(
        data(302..602) == data(1..301),
        "resync republishes the held blocks"
    );
    agent.shutdown().await;
}

#[tokio::test]
async fn deregister_is_immediate_and_a_crash_expires_with_the_lease() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    ensure_stream(&jetstream::new(nats.clone()), &names).await;
    let mut etcd = env.etcd.connect().await.unwrap();
    let source = Arc::new(FakeCache::default());

    let mut a = WorkerAgent::start(
        nats.clone(),
        etcd.clone(),
        &names,
        card(1, &names),
        config(2),
        source.clone(),
    )
    .await
    .unwrap();
    let mut b = WorkerAgent::start(
        nats.clone(),
        etcd.clone(),
        &names,
        card(2, &names),
        config(2),
        source.clone(),
    )
    .await
    .unwrap();
    a.wait_registered().await;
    b.wait_registered().await;
    assert_eq!(
        card_in_etcd(&mut etcd, &names, 1).await.unwrap().worker_id,
        1
    );

    // Kept alive well past the TTL.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(card_in_etcd(&mut etcd, &names, 2).await.is_some());

    a.shutdown().await;
    assert!(
        card_in_etcd(&mut etcd, &names, 1).await.is_none(),
        "gone at once"
    );

    let crashed_at = tokio::time::Instant::now();
    b.abandon();
    assert!(
        card_in_etcd(&mut etcd, &names, 2).await.is_some(),
        "still there right after the crash"
    );
    wait_for(
        "crashed worker's card expires",
        Duration::from_secs(4),
        async || card_in_etcd(&mut etcd, &names, 2).await.is_none(),
    )
    .await;
    assert!(crashed_at.elapsed() >= Duration::from_millis(500));
}

#[tokio::test]
async fn registers_again_after_an_etcd_outage() {
    let mut env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    ensure_stream(&jetstream::new(nats.clone()), &names).await;
    let agent = registered_agent(nats, env.etcd.connect().await.unwrap(), &names, 3).await;

    // Down for longer than the TTL: when etcd returns, the old lease has expired.
    env.etcd.kill9().unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    env.etcd.restart().unwrap();
    let mut etcd = env.etcd.connect().await.unwrap();
    wait_for(
        "card registered again",
        Duration::from_secs(15),
        async || card_in_etcd(&mut etcd, &names, 3).await.is_some(),
    )
    .await;
    // And it stays (the new lease is kept alive).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(card_in_etcd(&mut etcd, &names, 3).await.is_some());
    agent.shutdown().await;
}

#[tokio::test]
async fn publishing_survives_a_nats_restart_without_loss_or_duplicates() {
    let mut env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let js = jetstream::new(nats.clone());
    ensure_stream(&js, &names).await;
    let cache = Arc::new(FakeCache::default());
    let agent = WorkerAgent::start(
        nats.clone(),
        env.etcd.connect().await.unwrap(),
        &names,
        card(4, &names),
        config(10),
        cache.clone(),
    )
    .await
    .unwrap();
    for h in 1..=50 {
        cache.store(agent.publisher(), h);
    }
    agent.publisher().flush().await;
    env.nats.kill9().unwrap();
    for h in 51..=100 {
        cache.store(agent.publisher(), h);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.nats.restart().unwrap();
    tokio::time::timeout(Duration::from_secs(20), agent.publisher().flush())
        .await
        .expect("flushed after the restart");

    let js = jetstream::new(env.nats.connect().await.unwrap());
    let stream = js.get_stream(names.events_stream()).await.unwrap();
    let events = read_events(&stream, 101).await;
    let ids: Vec<u64> = events.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, (0..101).collect::<Vec<_>>());
    let mut stream = stream;
    let total: u64 = stream.info().await.unwrap().state.messages;
    assert!(total >= 2, "batches landed");
}

/// The publisher keeps up to `max_in_flight` acks outstanding. NATS killed while the pipeline is
/// full, and restarted: every event reaches the stream exactly once, in order — or, when a
/// batch lost in the dead connection landed after later ones the client had queued, that is
/// counted (readers then see a gap and resync the worker).
#[tokio::test]
async fn a_full_pipeline_survives_a_nats_restart_exactly_once() {
    use kvroute_common::worker::PublisherConfig;
    let mut env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let js = jetstream::new(env.nats.connect().await.unwrap());
    ensure_stream(&js, &names).await;
    let publisher = EventPublisher::start(
        js,
        &names,
        5,
        PublisherConfig {
            max_batch_events: 4,
            max_in_flight: 16,
            ack_timeout: Duration::from_millis(500),
            retry_interval: Duration::from_millis(100),
            ..Default::default()
        },
    );
    let n = 4_000u64;
    for h in 0..n / 2 {
        publisher.publish(0, vec![stored(h)]);
    }
    // Some batches are acked by now, some in flight, most queued.
    tokio::time::sleep(Duration::from_millis(20)).await;
    env.nats.kill9().unwrap();
    for h in n / 2..n {
        publisher.publish(0, vec![stored(h)]);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    env.nats.restart().unwrap();
    tokio::time::timeout(Duration::from_secs(60), publisher.flush())
        .await
        .expect("flushed after the restart");
    let stats = publisher.stats();
    assert_eq!(stats.events_published.load(Ordering::Relaxed), n);
    assert_eq!(stats.events_queued.load(Ordering::Relaxed), 0);
    assert!(
        stats.publish_failures.load(Ordering::Relaxed) > 0,
        "the kill hit the pipeline"
    );

    let js = jetstream::new(env.nats.connect().await.unwrap());
    let stream = js.get_stream(names.events_stream()).await.unwrap();
    let ids: Vec<u64> = read_events(&stream, n as usize)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..n).collect::<Vec<_>>(),
        "every event exactly once"
    );
    let reordered = stats.publish_reordered.load(Ordering::Relaxed);
    eprintln!(
        "in order: {}; reordered batches counted: {reordered}",
        ids == sorted
    );
    assert!(
        ids == sorted || reordered > 0,
        "out of order and not counted"
    );
}

/// A card update (the engine's LoRA adapters changed) is written under the same lease: the
/// card stays in etcd throughout, and a crash still expires it with that lease.
#[tokio::test]
async fn an_updated_card_is_written_under_the_same_lease() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    ensure_stream(&jetstream::new(nats.clone()), &names).await;
    let mut etcd = env.etcd.connect().await.unwrap();
    let mut a = registered_agent(nats, etcd.clone(), &names, 1).await;
    let lease = |etcd: &mut etcd_client::Client| {
        let mut etcd = etcd.clone();
        let key = names.worker_key(1);
        async move { etcd.get(key, None).await.unwrap().kvs()[0].lease() }
    };
    let before = lease(&mut etcd).await;
    assert_eq!(
        card_in_etcd(&mut etcd, &names, 1)
            .await
            .unwrap()
            .lora_adapters,
        None
    );

    let mut updated = a.card().clone();
    updated.lora_adapters = Some(vec!["sql".into()]);
    a.update_card(updated.clone()).unwrap();
    wait_for("the updated card", Duration::from_secs(2), async || {
        card_in_etcd(&mut etcd, &names, 1).await == Some(updated.clone())
    })
    .await;
    assert_eq!(lease(&mut etcd).await, before, "the same lease");
    assert_eq!(a.card(), &updated);

    // An update may not turn the card into another worker's, nor an invalid one.
    let mut other = updated.clone();
    other.worker_id = 2;
    assert!(a.update_card(other).is_err());
    let mut invalid = updated.clone();
    invalid.lora_adapters = Some(vec![String::new()]);
    assert!(a.update_card(invalid).is_err());
    assert_eq!(a.card(), &updated);

    a.abandon();
    wait_for(
        "the updated card expires with the lease",
        Duration::from_secs(4),
        async || card_in_etcd(&mut etcd, &names, 1).await.is_none(),
    )
    .await;
}
