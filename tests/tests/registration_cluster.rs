//! Worker registrations against a three-member etcd cluster: while any one member is killed
//! (SIGKILL; the leader among them), every card stays in etcd, past twice the lease TTL, and no
//! card is ever deleted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use kvroute_common::worker::{Registration, RegistrationConfig};
use kvroute_common::{Names, Namespace};
use kvroute_tests::{EtcdCluster, worker_card};
use tokio::time::Instant;

/// etcd's minimum: the tightest budget for retrying on another member.
const TTL: Duration = Duration::from_secs(2);
const WORKERS: u64 = 6;

/// Registers `WORKERS` cards through one client of every member (as a mocker does), then,
/// member by member: SIGKILL, 2 × TTL + 1 s with the member down, the member restarted. Through
/// the other members, the cards are read every 100 ms and every change is watched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_keep_their_cards_while_any_one_of_three_etcd_members_is_killed() {
    let mut cluster = EtcdCluster::start(3).unwrap();
    let namespace = Namespace::new(format!(
        "c{:08x}",
        std::process::id() ^ rand::random::<u32>()
    ))
    .unwrap();
    let names = Names::new(&namespace);
    let prefix = names.workers_prefix();
    let etcd = cluster.args().connect().await.unwrap();
    let mut registrations = Vec::new();
    for id in 1..=WORKERS {
        let mut r = Registration::start(
            etcd.clone(),
            &names,
            worker_card(&names, id, "m"),
            RegistrationConfig {
                lease_ttl: TTL,
                retry_interval: Duration::from_millis(100),
            },
        )
        .unwrap();
        r.wait_registered().await;
        registrations.push(r);
    }

    for victim in 0..cluster.members.len() {
        let others: Vec<usize> = (0..cluster.members.len())
            .filter(|&i| i != victim)
            .collect();
        let mut observer = cluster.args_of(&others).connect().await.unwrap();
        let all = GetOptions::new().with_prefix();
        let before = observer
            .get(prefix.as_str(), Some(all.clone()))
            .await
            .unwrap();
        assert_eq!(
            before.count(),
            WORKERS as i64,
            "member {victim}: cards before"
        );
        let revision = before.header().unwrap().revision();
        // Every change from before the fault on.
        let mut stream = observer
            .watch(
                prefix.as_str(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            )
            .await
            .unwrap();
        let changes = Arc::new(Mutex::new(Vec::new()));
        let collector = {
            let changes = changes.clone();
            tokio::spawn(async move {
                while let Ok(Some(resp)) = stream.message().await {
                    for event in resp.events() {
                        let key = event
                            .kv()
                            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned());
                        changes.lock().unwrap().push((event.event_type(), key));
                    }
                }
            })
        };

        cluster.members[victim].kill9().unwrap();
        let since = Instant::now();
        let mut reads = 0;
        while since.elapsed() < 2 * TTL + Duration::from_secs(1) {
            let read = tokio::time::timeout(
                Duration::from_secs(1),
                observer.get(prefix.as_str(), Some(all.clone().with_count_only())),
            )
            .await;
            if let Ok(Ok(resp)) = read {
                reads += 1;
                assert_eq!(
                    resp.count(),
                    WORKERS as i64,
                    "member {victim}: cards present {:?} after the fault",
                    since.elapsed()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(reads > 20, "member {victim}: only {reads} reads answered");
        for (i, r) in registrations.iter().enumerate() {
            assert!(
                r.is_registered(),
                "member {victim}: worker {} not registered",
                i + 1
            );
        }
        // Changes arrive within milliseconds; give them time, then look.
        tokio::time::sleep(Duration::from_millis(300)).await;
        collector.abort();
        let changes = changes.lock().unwrap().clone();
        let deleted: Vec<_> = changes
            .iter()
            .filter(|(kind, _)| *kind == EventType::Delete)
            .collect();
        assert!(
            deleted.is_empty(),
            "member {victim}: cards deleted: {deleted:?}"
        );
        eprintln!(
            "member {victim}: {} cards kept for {:?}, put again {} times ({reads} reads)",
            WORKERS,
            since.elapsed(),
            changes.len()
        );

        cluster.members[victim].restart().unwrap();
    }

    let mut observer = cluster.args().connect().await.unwrap();
    for r in registrations {
        r.deregister().await;
    }
    let after = observer
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(after.count(), 0, "cards left after deregistering");
}
