//! Fencing the indexer leader: a leader cut off from etcd (a TCP proxy the test black-holes)
//! steps down before its lease can expire on the server, so before another replica wins a
//! newer term, and the log never shows a record of the old term after the new term's first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{ControlRecord, KvEvent, KvEventBatch, KvEventData, SchemaVersion};
use kvroute_common::{Names, WorkerId};
use kvroute_tests::{IndexerProcess, TestEnv, stored};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(2);

/// A TCP proxy to `target`. While cut, it forwards nothing in either direction but keeps the
/// connections open (a partition, not a refusal); connections that saw a cut are closed when
/// it heals, so clients reconnect cleanly.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pump(ri, wo, flag.clone()));
                tokio::spawn(pump(ro, wi, flag.clone()));
            }
        });
        Self { port, cut }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut saw_cut = false;
    loop {
        let n = match tokio::time::timeout(Duration::from_millis(100), from.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => n,
            Err(_) => 0,
        };
        if cut.load(Ordering::SeqCst) {
            saw_cut = true;
            continue;
        }
        if saw_cut {
            return;
        }
        if n > 0 && to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Events of a worker that never registers: the leader removes it after the grace period.
async fn publish_unregistered(env: &TestEnv, worker_id: WorkerId) {
    let names = Names::new(&env.namespace);
    let js = jetstream::new(env.nats.connect().await.unwrap());
    let batch = KvEventBatch {
        v: SchemaVersion::CURRENT,
        worker_id,
        dp_rank: 0,
        events: vec![
            KvEvent {
                event_id: 0,
                data: KvEventData::Cleared,
            },
            KvEvent {
                event_id: 1,
                data: stored(worker_id * 10),
            },
        ],
        ts: 0,
    };
    js.publish(names.kv_events(worker_id), encode(&batch).unwrap())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Every control record in the log, in order: (stream sequence, record).
async fn control_records(env: &TestEnv) -> Vec<(u64, ControlRecord)> {
    let names = Names::new(&env.namespace);
    let js = jetstream::new(env.nats.connect().await.unwrap());
    let stream = js.get_stream(names.events_stream()).await.unwrap();
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: names.kv_control(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::new();
    while let Ok(Some(Ok(msg))) =
        tokio::time::timeout(Duration::from_secs(2), messages.next()).await
    {
        let seq = msg.info().unwrap().stream_sequence;
        out.push((seq, decode::<ControlRecord>(&msg.payload).unwrap()));
    }
    out
}

/// The first log line containing `needle`, and the term it names.
fn log_line(log: &str, needle: &str) -> Option<(String, u64)> {
    let line = log.lines().find(|l| l.contains(needle))?;
    let term = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("term="))?
        .parse()
        .ok()?;
    Some((line.to_owned(), term))
}

/// The RFC 3339 timestamp that opens a log line (same format and zone in every process, so
/// the strings order like the times).
fn timestamp(line: &str) -> &str {
    line.split_whitespace().next().unwrap_or_default()
}

async fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what} not reached in {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_etcd_steps_down_before_the_next_term_begins() {
    let env = TestEnv::start().unwrap();
    let etcd_port: u16 = env
        .etcd
        .endpoint()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let proxy = Proxy::start(etcd_port).await;
    let flags = ["--unregistered-grace-secs", "1"];
    // `a` reaches etcd through the proxy and starts first, so it leads.
    let a = IndexerProcess::start_with_etcd(&env, "a", &proxy.endpoint(), &flags).unwrap();
    wait_for("a leads", Duration::from_secs(30), || {
        a.metric("kvroute_indexer_leader") == 1.0
    })
    .await;
    let b = IndexerProcess::start(&env, "b", &flags).unwrap();
    // A record in a's term: an unregistered worker's removal.
    publish_unregistered(&env, 101).await;
    wait_for("a removes worker 101", Duration::from_secs(30), || {
        b.metric("kvroute_indexer_workers_removed_total") == 1.0
    })
    .await;

    // Partition a from etcd; it goes on publishing to NATS.
    proxy.set_cut(true);
    let cut = Instant::now();
    publish_unregistered(&env, 102).await;
    wait_for("a steps down", TTL + Duration::from_secs(1), || {
        a.metric("kvroute_indexer_leader") == 0.0
    })
    .await;
    // The last acknowledged keep-alive was sent before the cut: a stepped down within the TTL
    // after it (the poll adds at most ~20 ms and an HTTP round trip).
    let stepped_down_after = cut.elapsed();
    assert!(
        stepped_down_after < TTL,
        "stepped down {stepped_down_after:?} after the cut"
    );
    wait_for("b takes over", Duration::from_secs(15), || {
        b.metric("kvroute_indexer_leader") == 1.0
    })
    .await;
    // A record in b's term, then heal the partition: a must not act in its old term again.
    publish_unregistered(&env, 103).await;
    wait_for("b removes worker 103", Duration::from_secs(30), || {
        b.metric("kvroute_indexer_workers_removed_total") >= 3.0
    })
    .await;
    proxy.set_cut(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    publish_unregistered(&env, 104).await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The logs: a stepped down in its term before b became leader in a newer one.
    let (a_log, b_log) = (a.log(), b.log());
    let (a_became, a_term) = log_line(&a_log, "became snapshot leader").expect("a became leader");
    let (a_down, down_term) = log_line(&a_log, "stepped down").expect("a stepped down");
    let (b_became, b_term) = log_line(&b_log, "became snapshot leader").expect("b became leader");
    eprintln!(
        "cut -> a stepped down (observed): {stepped_down_after:?}\n{a_became}\n{a_down}\n{b_became}"
    );
    assert_eq!(down_term, a_term, "{a_down}");
    assert!(
        a_down.contains("reason=lease_deadline") || a_down.contains("reason=lease_lost"),
        "{a_down}"
    );
    assert!(b_term > a_term, "terms {a_term} then {b_term}");
    assert!(timestamp(&a_became) < timestamp(&a_down));
    assert!(
        timestamp(&a_down) < timestamp(&b_became),
        "a: {a_down}\nb: {b_became}"
    );
    // b holds the key from then on: a never acts as leader again, in any term.
    assert_eq!(
        a_log.matches("became snapshot leader").count(),
        1,
        "a led again:\n{a_log}"
    );
    assert_eq!(a.metric("kvroute_indexer_leader"), 0.0);
    assert_eq!(b.metric("kvroute_indexer_leader_term"), b_term as f64);

    // The log: terms never go back once the new term has written.
    let records = control_records(&env).await;
    let terms: Vec<(u64, u64, String)> = records
        .iter()
        .map(|(seq, r)| (*seq, r.term, r.replica_id.clone()))
        .collect();
    assert!(
        terms.iter().any(|(_, t, id)| *t == a_term && id == "a"),
        "{terms:?}"
    );
    let first_new = terms
        .iter()
        .position(|(_, t, _)| *t == b_term)
        .unwrap_or_else(|| panic!("no record of b's term: {terms:?}"));
    assert!(
        terms[first_new..].iter().all(|(_, t, _)| *t >= b_term),
        "a record of an older term after the new term's first: {terms:?}"
    );
    eprintln!("control records (seq, term, replica): {terms:?}");
    assert!(terms.iter().all(|(_, t, _)| *t == a_term || *t == b_term));
    // Both replicas applied the same log and ignored nothing as stale (nothing was stale).
    assert_eq!(a.metric("kvroute_indexer_stale_term_records_total"), 0.0);
    wait_for(
        "replicas agree",
        Duration::from_secs(30),
        || matches!((a.position(), b.position()), (Ok(p), Ok(q)) if p == q),
    )
    .await;
}
