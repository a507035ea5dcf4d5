//! Worker discovery: the worker cards under `/kvroute/<ns>/workers/` in etcd, as a stream of
//! changes. Used by indexers (worker lifecycle) and routers (candidates).
//!
//! etcd watches do not resume by themselves: after any error the watcher re-watches from the
//! last revision it saw + 1, so no delete is missed; only if that revision was compacted away
//! does it read the whole prefix again and report a full [`WorkerEvent::Snapshot`].

use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use tokio::sync::mpsc;

use crate::codec::{DecodeError, decode};
use crate::ids::WorkerId;
use crate::messages::{CardField, WorkerCard};
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
    /// A card under the prefix could not be decoded or is not valid (counted by `reason` and
    /// skipped).
    Invalid {
        key: String,
        reason: BadCard,
        error: String,
    },
}

/// Why a worker card was skipped: the `reason` label of `kvroute_discovery_bad_cards_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BadCard {
    /// The key is not `/kvroute/<ns>/workers/<worker id>`.
    BadKey,
    /// The value is empty.
    Empty,
    /// The value exceeds the card's size limit.
    TooLarge,
    /// The value is not a MessagePack card (wrong encoding, missing or mistyped field).
    Malformed,
    /// The card's schema version is newer than this process reads.
    UnsupportedVersion,
    /// The card names another worker than its key.
    WorkerIdMismatch,
    /// A field holds a value no worker can have ([`CardField`]).
    Invalid(CardField),
}

impl BadCard {
    /// Every reason, for pre-registering the series at 0.
    pub const ALL: [BadCard; 11] = [
        BadCard::BadKey,
        BadCard::Empty,
        BadCard::TooLarge,
        BadCard::Malformed,
        BadCard::UnsupportedVersion,
        BadCard::WorkerIdMismatch,
        BadCard::Invalid(CardField::Model),
        BadCard::Invalid(CardField::BlockSize),
        BadCard::Invalid(CardField::TotalKvBlocks),
        BadCard::Invalid(CardField::RequestSubject),
        BadCard::Invalid(CardField::LoraAdapters),
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            BadCard::BadKey => "bad_key",
            BadCard::Empty => "empty",
            BadCard::TooLarge => "too_large",
            BadCard::Malformed => "malformed",
            BadCard::UnsupportedVersion => "unsupported_version",
            BadCard::WorkerIdMismatch => "worker_id_mismatch",
            BadCard::Invalid(CardField::Model) => "invalid_model",
            BadCard::Invalid(CardField::BlockSize) => "invalid_block_size",
            BadCard::Invalid(CardField::TotalKvBlocks) => "invalid_total_kv_blocks",
            BadCard::Invalid(CardField::RequestSubject) => "invalid_request_subject",
            BadCard::Invalid(CardField::LoraAdapters) => "invalid_lora_adapters",
        }
    }
}

/// The metric every router and indexer keeps of skipped cards.
pub const BAD_CARDS_METRIC: &str = "kvroute_discovery_bad_cards_total";

/// [`BAD_CARDS_METRIC`]'s label and its values.
pub const BAD_CARDS: crate::ops::OneOf = crate::ops::OneOf {
    family: BAD_CARDS_METRIC,
    label: "reason",
    values: || BadCard::ALL.map(BadCard::label).to_vec(),
};

/// Registers [`BAD_CARDS`] on `r`, every reason present at 0 from the start: the one
/// registration routers and indexers share.
pub fn bad_cards_metric(r: &crate::ops::Registry) -> std::sync::Arc<crate::ops::CounterVec> {
    r.counter_one_of(
        BAD_CARDS,
        "Worker cards in etcd skipped (undecodable or invalid), by reason.",
    )
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

/// Decodes and validates one card; the error is the [`WorkerEvent::Invalid`] to report
/// (boxed: it is large).
pub fn decode_card(
    names: &Names,
    key: &[u8],
    value: &[u8],
) -> Result<WorkerCard, Box<WorkerEvent>> {
    let key_str = String::from_utf8_lossy(key).into_owned();
    let invalid = |reason: BadCard, error: String| {
        Box::new(WorkerEvent::Invalid {
            key: key_str.clone(),
            reason,
            error,
        })
    };
    let id = names.worker_id_of_key(key).ok_or_else(|| {
        invalid(
            BadCard::BadKey,
            "key is not /kvroute/<ns>/workers/<id>".into(),
        )
    })?;
    let card: WorkerCard = decode(value).map_err(|e| {
        let reason = match e {
            DecodeError::Empty { .. } => BadCard::Empty,
            DecodeError::TooLarge { .. } => BadCard::TooLarge,
            DecodeError::Malformed { .. } => BadCard::Malformed,
            DecodeError::UnsupportedVersion { .. } => BadCard::UnsupportedVersion,
        };
        invalid(reason, e.to_string())
    })?;
    if card.worker_id != id {
        return Err(invalid(
            BadCard::WorkerIdMismatch,
            format!("card names worker {} under key of {id}", card.worker_id),
        ));
    }
    card.validate()
        .map_err(|e| invalid(BadCard::Invalid(e.field), e.to_string()))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encode;
    use crate::ids::Namespace;
    use crate::messages::{SchemaVersion, WorkerRole};

    fn card(names: &Names, worker_id: WorkerId) -> WorkerCard {
        WorkerCard {
            v: SchemaVersion::CURRENT,
            worker_id,
            model: "m".into(),
            role: WorkerRole::Aggregated,
            block_size: 16,
            total_kv_blocks: 100,
            max_num_batched_tokens: 0,
            dp_start_rank: 0,
            dp_size: 1,
            taints: vec![],
            labels: Default::default(),
            request_subject: names.worker_requests(worker_id),
            software_version: String::new(),
            http_url: None,
            kv_events: true,
            lora_adapters: None,
        }
    }

    fn reason(names: &Names, key: &str, value: &[u8]) -> Option<BadCard> {
        match decode_card(names, key.as_bytes(), value) {
            Ok(_) => None,
            Err(e) => match *e {
                WorkerEvent::Invalid { reason, .. } => Some(reason),
                other => panic!("not an Invalid event: {other:?}"),
            },
        }
    }

    #[test]
    fn each_bad_card_has_its_reason() {
        let names = Names::new(&Namespace::new("t").unwrap());
        let key = names.worker_key(7);
        let good = card(&names, 7);
        assert_eq!(reason(&names, &key, &encode(&good).unwrap()), None);
        let with = |f: fn(&mut WorkerCard)| {
            let mut c = good.clone();
            f(&mut c);
            encode(&c).unwrap()
        };
        let cases: Vec<(&str, Vec<u8>, BadCard)> = vec![
            (
                "/kvroute/t/workers/x",
                encode(&good).unwrap().to_vec(),
                BadCard::BadKey,
            ),
            (&key, vec![], BadCard::Empty),
            (&key, vec![0; 64 * 1024 + 1], BadCard::TooLarge),
            (&key, b"{\"worker_id\": 7}".to_vec(), BadCard::Malformed),
            (
                &key,
                with(|c| c.v = SchemaVersion(u16::MAX)).to_vec(),
                BadCard::UnsupportedVersion,
            ),
            (
                &key,
                with(|c| c.worker_id = 8).to_vec(),
                BadCard::WorkerIdMismatch,
            ),
            (
                &key,
                with(|c| c.model = " ".into()).to_vec(),
                BadCard::Invalid(CardField::Model),
            ),
            (
                &key,
                with(|c| c.block_size = 0).to_vec(),
                BadCard::Invalid(CardField::BlockSize),
            ),
            (
                &key,
                with(|c| c.total_kv_blocks = 0).to_vec(),
                BadCard::Invalid(CardField::TotalKvBlocks),
            ),
            (
                &key,
                with(|c| c.request_subject = "a..b".into()).to_vec(),
                BadCard::Invalid(CardField::RequestSubject),
            ),
            (
                &key,
                with(|c| c.lora_adapters = Some(vec![String::new()])).to_vec(),
                BadCard::Invalid(CardField::LoraAdapters),
            ),
        ];
        assert_eq!(cases.len(), BadCard::ALL.len(), "every reason is exercised");
        for (key, value, expected) in cases {
            assert_eq!(reason(&names, key, &value), Some(expected), "{expected:?}");
        }
        let labels: std::collections::HashSet<_> = BadCard::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), BadCard::ALL.len(), "labels are distinct");
    }
}
