//! The harness against the real servers: JetStream round trip, lease expiry seen by a watch,
//! and a NATS restart on the same port and data dir keeping a stream's messages.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use etcd_client::{EventType, PutOptions, WatchOptions};
use futures::StreamExt;
use kvroute_common::Names;
use kvroute_tests::{EtcdServer, NatsServer, TestEnv};

const TIMEOUT: Duration = Duration::from_secs(10);

async fn events_stream(js: &jetstream::Context, names: &Names) -> stream::Stream {
    js.get_or_create_stream(stream::Config {
        name: names.events_stream(),
        subjects: names.events_stream_subjects(),
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("stream created")
}

async fn pull_all(stream: &stream::Stream, n: usize) -> Vec<bytes::Bytes> {
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut out = Vec::new();
    while out.len() < n {
        let msg = tokio::time::timeout(TIMEOUT, messages.next())
            .await
            .expect("message within timeout")
            .expect("stream open")
            .expect("message");
        msg.ack().await.expect("ack");
        out.push(msg.payload.clone());
    }
    out
}

#[tokio::test]
async fn jetstream_publish_then_pull_consume() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let client = env.nats.connect().await.unwrap();
    let js = jetstream::new(client);
    let stream = events_stream(&js, &names).await;
    for i in 0..5u8 {
        js.publish(names.kv_events(u64::from(i)), vec![i].into())
            .await
            .unwrap()
            .await
            .expect("publish acknowledged");
    }
    let got = pull_all(&stream, 5).await;
    assert_eq!(
        got,
        (0..5u8)
            .map(|i| bytes::Bytes::from(vec![i]))
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn etcd_lease_key_is_deleted_after_keepalive_stops() {
    let etcd = EtcdServer::start().unwrap();
    let mut client = etcd.connect().await.unwrap();
    let key = "/kvroute/harness/workers/1";
    let lease = client.lease_grant(2, None).await.unwrap().id();
    let (mut keeper, mut acks) = client.lease_keep_alive(lease).await.unwrap();
    client
        .put(key, "card", Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
    let mut watch = client.watch(key, Some(WatchOptions::new())).await.unwrap();

    // While kept alive for 3 s (longer than the 2 s TTL) the key stays.
    for _ in 0..6 {
        keeper.keep_alive().await.unwrap();
        acks.message().await.unwrap().expect("keep-alive ack");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(client.get(key, None).await.unwrap().kvs().len(), 1);

    // Stop keeping it alive: the watch sees the delete within TTL + slack.
    drop(keeper);
    drop(acks);
    let deleted = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(resp) = watch.message().await.unwrap() {
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return true;
            }
        }
        false
    })
    .await
    .expect("delete seen within 5 s");
    assert!(deleted);
    assert!(client.get(key, None).await.unwrap().kvs().is_empty());
}

#[tokio::test]
async fn nats_restart_on_same_port_keeps_stream_messages() {
    let mut nats = NatsServer::start().unwrap();
    let ns = kvroute_common::Namespace::new("restart").unwrap();
    let names = Names::new(&ns);
    let port = nats.port;
    {
        let js = jetstream::new(nats.connect().await.unwrap());
        events_stream(&js, &names).await;
        for i in 0..3u8 {
            js.publish(names.kv_events(1), vec![i].into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }
    nats.kill9().unwrap();
    let mut quick = nats.args();
    quick.connect_timeout_ms = 300;
    assert!(
        quick.connect("kvroute-test").await.is_err(),
        "server is down"
    );
    nats.restart().unwrap();
    assert_eq!(nats.port, port);

    let js = jetstream::new(nats.connect().await.unwrap());
    let mut stream = js.get_stream(names.events_stream()).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 3);
    let got = pull_all(&stream, 3).await;
    assert_eq!(
        got,
        (0..3u8)
            .map(|i| bytes::Bytes::from(vec![i]))
            .collect::<Vec<_>>()
    );
}

#[test]
fn servers_never_use_default_ports_and_clean_up() {
    let env = TestEnv::start().unwrap();
    for port in [env.nats.port, env.etcd.client_port, env.etcd.peer_port] {
        assert!(![4222, 2379, 2380].contains(&port));
    }
    let dir = env.nats.data_dir().to_owned();
    assert!(dir.exists());
    drop(env);
    assert!(!dir.exists(), "data dir removed with the server");
}
