//! Worker discovery: the worker cards under `/kvroute/<ns>/workers/` in etcd, as a stream of
//! changes. Used by indexers (worker lifecycle) and routers (candidates).
//!
//! etcd watches do not resume by themselves: after any error the watcher re-watches from the
//! last revision it saw + 1, so no delete is missed; only if that revision was compacted away
//! does it read the whole prefix again and report a full [`WorkerEvent::Snapshot`].

use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use tokio::sync::mpsc;

use crate::codec::decode;
use crate::ids::WorkerId;
use crate::messages::WorkerCard;
use crate::names::Names;

/// A change in the set of registered workers.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerEvent {
    /// Every registered worker, replacing whatever the receiver knew (at start, and after a
    /// watch had to restart from a full read).
    Snapshot {
        cards: Vec<WorkerCard>,
        revision: i64,
    },
    /// A worker registered or updated its card.
    Put { card: WorkerCard, revision: i64 },
    /// A worker's card is gone (lease expired or deregistered).
    Delete { worker_id: WorkerId, revision: i64 },
    /// A card under the prefix could not be decoded (counted and skipped).
    Invalid { key: String, error: String },
}

/// Starts watching; events arrive on the returned channel until it is dropped.
pub fn watch_workers(etcd: etcd_client::Client, names: &Names) -> mpsc::Receiver<WorkerEvent> {
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(run(etcd, names.clone(), tx));
    rx
}

async fn run(mut etcd: etcd_client::Client, names: Names, tx: mpsc::Sender<WorkerEvent>) {
    let prefix = names.workers_prefix();
    // The next revision to watch from; 0 = read everything first.
    let mut next_rev: i64 = 0;
    loop {
        if tx.is_closed() {
            return;
        }
        if next_rev == 0 {
            match read_all(&mut etcd, &names, &prefix).await {
                Ok((events, revision)) => {
                    for e in events {
                        if tx.send(e).await.is_err() {
                            return;
                        }
                    }
                    next_rev = revision + 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading workers from etcd failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            }
        }
        match watch_from(&mut etcd, &names, &prefix, next_rev, &tx).await {
            WatchEnd::ReceiverGone => return,
            WatchEnd::Compacted => next_rev = 0,
            WatchEnd::Broken { resume_at, error } => {
                tracing::warn!(error, resume_at, "etcd watch ended; re-watching");
                next_rev = resume_at;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn read_all(
    etcd: &mut etcd_client::Client,
    names: &Names,
    prefix: &str,
) -> anyhow::Result<(Vec<WorkerEvent>, i64)> {
    let resp = etcd
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let mut cards = Vec::new();
    let mut events = Vec::new();
    for kv in resp.kvs() {
        match decode_card(names, kv.key(), kv.value()) {
            Ok(card) => cards.push(card),
            Err(e) => events.push(*e),
        }
    }
    events.insert(0, WorkerEvent::Snapshot { cards, revision });
    Ok((events, revision))
}

/// Decodes one card; the error is the [`WorkerEvent::Invalid`] to report (boxed: it is large).
pub fn decode_card(
    names: &Names,
    key: &[u8],
    value: &[u8],
) -> Result<WorkerCard, Box<WorkerEvent>> {
    let key_str = String::from_utf8_lossy(key).into_owned();
    let invalid = |error: String| {
        Box::new(WorkerEvent::Invalid {
            key: key_str.clone(),
            error,
        })
    };
    let id = names
        .worker_id_of_key(key)
        .ok_or_else(|| invalid("key is not /kvroute/<ns>/workers/<id>".into()))?;
    let card: WorkerCard = decode(value).map_err(|e| invalid(e.to_string()))?;
    if card.worker_id != id {
        return Err(invalid(format!(
            "card names worker {} under key of {id}",
            card.worker_id
        )));
    }
    Ok(card)
}

enum WatchEnd {
    ReceiverGone,
    Compacted,
    Broken { resume_at: i64, error: String },
}

async fn watch_from(
    etcd: &mut etcd_client::Client,
    names: &Names,
    prefix: &str,
    start: i64,
    tx: &mpsc::Sender<WorkerEvent>,
) -> WatchEnd {
    let mut next = start;
    let opts = WatchOptions::new()
        .with_prefix()
        .with_start_revision(start)
        .with_progress_notify();
    let mut stream = match etcd.watch(prefix, Some(opts)).await {
        Ok(s) => s,
        Err(e) => {
            return WatchEnd::Broken {
                resume_at: next,
                error: e.to_string(),
            };
        }
    };
    loop {
        let resp = match stream.message().await {
            Ok(Some(resp)) => resp,
            Ok(None) => {
                return WatchEnd::Broken {
                    resume_at: next,
                    error: "watch stream closed".into(),
                };
            }
            Err(e) => {
                return WatchEnd::Broken {
                    resume_at: next,
                    error: e.to_string(),
                };
            }
        };
        if resp.compact_revision() > 0 && resp.compact_revision() >= next {
            return WatchEnd::Compacted;
        }
        if resp.canceled() {
            return WatchEnd::Broken {
                resume_at: next,
                error: format!("watch canceled: {}", resp.cancel_reason()),
            };
        }
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            let revision = kv.mod_revision();
            let out = match event.event_type() {
                EventType::Put => match decode_card(names, kv.key(), kv.value()) {
                    Ok(card) => WorkerEvent::Put { card, revision },
                    Err(invalid) => *invalid,
                },
                EventType::Delete => match names.worker_id_of_key(kv.key()) {
                    Some(worker_id) => WorkerEvent::Delete {
                        worker_id,
                        revision,
                    },
                    None => continue,
                },
            };
            if tx.send(out).await.is_err() {
                return WatchEnd::ReceiverGone;
            }
            next = next.max(revision + 1);
        }
        if let Some(h) = resp.header() {
            // Progress notifications move the resume point without events.
            if resp.events().is_empty() && h.revision() >= next {
                next = h.revision() + 1;
            }
        }
    }
}
