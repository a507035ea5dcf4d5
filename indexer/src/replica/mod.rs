//! The replicated state of an indexer: the radix index, the event-id tracker and the stream
//! sequence applied so far. Pure: [`ReplicaState::apply`] takes one log message and returns
//! what happened; the service shell turns the report into metrics and leader actions.
//!
//! Every replica that applies the same log prefix holds the same state, so the same
//! `(applied_seq, digest)`.

mod continuity;
mod log_entry;
mod tracker;

pub use continuity::{Continuity, continuity};
pub use log_entry::{BadEntry, LogEntry, decode_entry};
pub use tracker::{EventDisposition, EventTracker, MAX_REMOVED, REMOVED_RETENTION_MS};

use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::{ControlAction, KvEventData};
use kvroute_common::names::Names;
use serde::{Deserialize, Serialize};

use crate::index::{IndexConfig, PinnedIndex, SharedIndex, SnapshotError};

/// What one log message did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub events_applied: u32,
    /// Events the index refused (see [`crate::ApplyError`]); their workers should be resynced.
    pub events_refused: u32,
    pub duplicates: u32,
    /// Events of a removed worker, ignored.
    pub ignored_removed: u32,
    /// (worker, rank, first missing id, id that arrived) for every gap.
    pub gaps: Vec<(WorkerId, DpRank, u64, u64)>,
    /// Workers whose state is known to be incomplete (gap or refused event).
    pub needs_resync: Vec<WorkerId>,
    pub removed_worker: Option<WorkerId>,
    /// A control record from a leader term older than the newest seen: ignored.
    pub stale_term: Option<u64>,
    pub bad: Option<BadEntry>,
}

/// A snapshot of a [`ReplicaState`] taken at one log position, serialized by
/// [`PendingSnapshot::write`].
#[derive(Debug)]
pub struct PendingSnapshot {
    applied_seq: u64,
    term: u64,
    tracker: EventTracker,
    index: Result<PinnedIndex, Vec<u8>>,
}

impl PendingSnapshot {
    /// The log position the snapshot holds.
    pub fn applied_seq(&self) -> u64 {
        self.applied_seq
    }

    /// Records the leader term that writes the snapshot (metadata: the state itself is the
    /// same whoever writes it).
    pub fn written_in_term(mut self, term: u64) -> Self {
        self.term = term;
        self
    }

    /// The bytes [`ReplicaState::restore`] reads (the pin, if any, is released after).
    pub fn write(self) -> Vec<u8> {
        let file = SnapshotFile {
            v: SNAPSHOT_VERSION,
            applied_seq: self.applied_seq,
            term: self.term,
            tracker: self.tracker,
            index: match self.index {
                Ok(pinned) => pinned.snapshot(),
                Err(bytes) => bytes,
            },
        };
        rmp_serde::to_vec_named(&file).expect("snapshot serializes")
    }
}

/// The state a replica builds from the log.
#[derive(Debug, Clone)]
pub struct ReplicaState {
    index: SharedIndex,
    tracker: EventTracker,
    applied_seq: u64,
    names: Names,
}

/// The snapshot file: versioned, the tracker and the index's own snapshot bytes.
#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    v: u16,
    applied_seq: u64,
    /// The leader term that wrote it (0: unknown, or written outside a term).
    #[serde(default)]
    term: u64,
    tracker: EventTracker,
    #[serde(with = "serde_bytes")]
    index: Vec<u8>,
}

const SNAPSHOT_VERSION: u16 = 1;

/// A snapshot that cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("snapshot file: {0}")]
    File(String),
    #[error("snapshot version {0} is not supported (expected {SNAPSHOT_VERSION})")]
    Version(u16),
    #[error(transparent)]
    Index(#[from] SnapshotError),
}

impl ReplicaState {
    /// An empty state. Its index is one copy (fast to build) until the owner calls
    /// [`SharedIndex::attach_second_copy`] on it, when readers arrive.
    pub fn new(names: &Names, config: IndexConfig) -> Self {
        Self {
            index: SharedIndex::solo(crate::index::RadixIndex::new(config)),
            tracker: EventTracker::default(),
            applied_seq: 0,
            names: names.clone(),
        }
    }

    /// The index, for readers (queries) on other threads.
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    pub fn tracker(&self) -> &EventTracker {
        &self.tracker
    }

    /// The last stream sequence applied (0: none).
    pub fn applied_seq(&self) -> u64 {
        self.applied_seq
    }

    pub fn digest(&self) -> u64 {
        self.index.digest()
    }

    /// Applies the log message at stream sequence `seq`. Messages at or below the applied
    /// sequence are ignored (already applied). A bad message changes nothing but the sequence.
    pub fn apply(&mut self, seq: u64, subject: &str, payload: &[u8]) -> ApplyReport {
        if seq <= self.applied_seq {
            return ApplyReport::default();
        }
        self.apply_entry(seq, decode_entry(&self.names, subject, payload))
    }

    /// [`ReplicaState::apply`] for a message already decoded with [`decode_entry`] (the
    /// service decodes on the consumer's thread, so decoding and applying overlap).
    pub fn apply_entry(&mut self, seq: u64, entry: Result<LogEntry, BadEntry>) -> ApplyReport {
        let mut report = ApplyReport::default();
        if seq <= self.applied_seq {
            return report;
        }
        self.applied_seq = seq;
        match entry {
            Err(bad) => report.bad = Some(bad),
            Ok(LogEntry::Control(record)) if !self.tracker.observe_term(record.term) => {
                report.stale_term = Some(record.term);
            }
            Ok(LogEntry::Control(record)) => match record.action {
                ControlAction::WorkerRemoved { worker_id } => {
                    self.index.remove_worker(worker_id);
                    self.tracker.remove_worker(worker_id, seq, record.at_ms);
                    report.removed_worker = Some(worker_id);
                }
            },
            Ok(LogEntry::Events(batch)) => {
                let (w, r) = (batch.worker_id, batch.dp_rank);
                // Consecutive accepted events are applied together, in chunks, so readers
                // never wait behind a whole batch.
                let mut run: Vec<KvEventData> = Vec::new();
                for event in batch.events {
                    match self.tracker.check(w, r, event.event_id, &event.data) {
                        EventDisposition::Apply => run.push(event.data),
                        EventDisposition::ApplyAfterGap { expected } => {
                            report.gaps.push((w, r, expected, event.event_id));
                            run.push(event.data);
                        }
                        EventDisposition::Duplicate => report.duplicates += 1,
                        EventDisposition::WorkerRemoved => report.ignored_removed += 1,
                    }
                }
                // One write: readers see the message's events all at once.
                let outcome = self.index.apply_events(w, r, &run);
                report.events_applied += outcome.applied;
                report.events_refused += outcome.refused;
                if !report.gaps.is_empty() || report.events_refused > 0 {
                    report.needs_resync.push(w);
                }
            }
        }
        report
    }

    /// Serializes the whole state (tagged with the applied sequence).
    pub fn snapshot(&self) -> Vec<u8> {
        self.snapshot_later().write()
    }

    /// The whole state as of now, to serialize later on any thread while this state goes on
    /// applying the log: the index is held on a pinned copy (see [`SharedIndex::try_pin`]),
    /// or serialized now when no copy can be pinned.
    pub fn snapshot_later(&self) -> PendingSnapshot {
        PendingSnapshot {
            applied_seq: self.applied_seq,
            term: 0,
            tracker: self.tracker.clone(),
            index: match self.index.try_pin() {
                Some(pinned) => Ok(pinned),
                None => Err(self.index.snapshot()),
            },
        }
    }

    /// Rebuilds a state from [`ReplicaState::snapshot`] bytes (its index one copy, as with
    /// [`ReplicaState::new`]).
    pub fn restore(names: &Names, bytes: &[u8]) -> Result<Self, RestoreError> {
        let file: SnapshotFile =
            rmp_serde::from_slice(bytes).map_err(|e| RestoreError::File(e.to_string()))?;
        if file.v != SNAPSHOT_VERSION {
            return Err(RestoreError::Version(file.v));
        }
        Ok(Self {
            index: SharedIndex::solo(crate::index::RadixIndex::restore(&file.index)?),
            tracker: file.tracker,
            applied_seq: file.applied_seq,
            names: names.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::codec::encode;
    use kvroute_common::messages::{
        ControlRecord, KvEvent, KvEventBatch, SchemaVersion, StorageTier, StoredBlock,
    };
    use kvroute_common::{Names, Namespace};

    use super::*;

    fn names() -> Names {
        Names::new(&Namespace::new("t").unwrap())
    }

    fn batch(worker: u64, first_id: u64, events: Vec<KvEventData>) -> Vec<u8> {
        let events = events
            .into_iter()
            .enumerate()
            .map(|(i, data)| KvEvent {
                event_id: first_id + i as u64,
                data,
            })
            .collect();
        encode(&KvEventBatch {
            v: SchemaVersion::CURRENT,
            worker_id: worker,
            dp_rank: 0,
            events,
            ts: 0,
        })
        .unwrap()
        .to_vec()
    }

    fn stored(parent: Option<u64>, h: u64) -> KvEventData {
        KvEventData::Stored {
            parent_hash: parent,
            blocks: vec![StoredBlock {
                block_hash: h,
                tokens_hash: h,
            }],
            tier: StorageTier::Device,
        }
    }

    /// `kv.events.+7` and `kv.events.07` were taken as (seen writing the `log_entry` fuzz target)
    /// worker 7's subject.
    #[test]
    fn a_worker_has_one_events_subject() {
        let n = names();
        let payload = batch(7, 0, vec![KvEventData::Cleared]);
        for id in ["+7", "07", "007"] {
            let subject = n.kv_events(7).replace(".7", &format!(".{id}"));
            let e = decode_entry(&n, &subject, &payload).unwrap_err();
            assert_eq!(e.reason(), "unknown_subject", "{subject}");
        }
        assert!(decode_entry(&n, &n.kv_events(7), &payload).is_ok());
    }

    #[test]
    fn applies_in_order_skips_duplicates_and_bad_messages() {
        let n = names();
        let mut s = ReplicaState::new(&n, IndexConfig::default());
        let subj = n.kv_events(1);
        let r = s.apply(
            1,
            &subj,
            &batch(
                1,
                0,
                vec![KvEventData::Cleared, stored(None, 10), stored(Some(10), 11)],
            ),
        );
        assert_eq!(r.events_applied, 3);
        let digest = s.digest();
        // The same message again (redelivery) and an old event id: no change.
        assert_eq!(
            s.apply(1, &subj, &batch(1, 0, vec![stored(None, 99)])),
            ApplyReport::default()
        );
        let r = s.apply(2, &subj, &batch(1, 2, vec![stored(None, 99)]));
        assert_eq!(r.duplicates, 1);
        assert_eq!(s.digest(), digest);
        // Garbage and a forged worker id: counted, nothing changes, the sequence advances.
        let r = s.apply(3, &subj, b"\xc1garbage");
        assert_eq!(r.bad.unwrap().reason(), "malformed");
        let r = s.apply(4, &n.kv_events(2), &batch(1, 3, vec![stored(None, 5)]));
        assert_eq!(r.bad.unwrap().reason(), "worker_mismatch");
        assert_eq!((s.applied_seq(), s.digest()), (4, digest));
        // A gap is applied and reported for resync.
        let r = s.apply(5, &subj, &batch(1, 7, vec![stored(Some(11), 12)]));
        assert_eq!(r.gaps, vec![(1, 0, 3, 7)]);
        assert_eq!(r.needs_resync, vec![1]);
    }

    #[test]
    fn worker_removed_record_drops_the_worker_until_it_reincarnates() {
        let n = names();
        let mut s = ReplicaState::new(&n, IndexConfig::default());
        s.apply(
            1,
            &n.kv_events(1),
            &batch(1, 0, vec![KvEventData::Cleared, stored(None, 10)]),
        );
        let empty = ReplicaState::new(&n, IndexConfig::default()).digest();
        let record = ControlRecord {
            v: SchemaVersion::CURRENT,
            action: ControlAction::WorkerRemoved { worker_id: 1 },
            replica_id: "x".into(),
            term: 0,
            at_ms: 0,
        };
        let r = s.apply(2, &n.kv_control(), &encode(&record).unwrap());
        assert_eq!(r.removed_worker, Some(1));
        assert_eq!(s.digest(), empty);
        // A late event of the old incarnation is ignored ...
        let r = s.apply(3, &n.kv_events(1), &batch(1, 2, vec![stored(None, 11)]));
        assert_eq!(r.ignored_removed, 1);
        assert_eq!(s.digest(), empty);
        // ... a new incarnation is not.
        let r = s.apply(
            4,
            &n.kv_events(1),
            &batch(1, 0, vec![KvEventData::Cleared, stored(None, 11)]),
        );
        assert_eq!(r.events_applied, 2);
        assert_ne!(s.digest(), empty);
    }

    #[test]
    fn a_removal_from_a_deposed_term_is_ignored() {
        let n = names();
        let mut s = ReplicaState::new(&n, IndexConfig::default());
        for w in [1, 2] {
            s.apply(
                w,
                &n.kv_events(w),
                &batch(w, 0, vec![KvEventData::Cleared, stored(None, 10 + w)]),
            );
        }
        let removal = |worker_id, term| {
            encode(&ControlRecord {
                v: SchemaVersion::CURRENT,
                action: ControlAction::WorkerRemoved { worker_id },
                replica_id: "x".into(),
                term,
                at_ms: 1_000,
            })
            .unwrap()
        };
        let r = s.apply(3, &n.kv_control(), &removal(1, 9));
        assert_eq!((r.removed_worker, r.stale_term), (Some(1), None));
        let digest = s.digest();
        // The old leader's record lands after the new term's: nothing changes but the sequence.
        let r = s.apply(4, &n.kv_control(), &removal(2, 8));
        assert_eq!((r.removed_worker, r.stale_term), (None, Some(8)));
        assert_eq!((s.applied_seq(), s.digest()), (4, digest));
        assert!(!s.tracker().is_removed(2));
        // The same term, and a later one, still apply; the newest term is snapshotted.
        assert_eq!(
            s.apply(5, &n.kv_control(), &removal(2, 9)).removed_worker,
            Some(2)
        );
        let restored = ReplicaState::restore(&n, &s.snapshot()).unwrap();
        assert_eq!(restored.tracker().term(), 9);
    }

    #[test]
    fn snapshot_restores_index_tracker_and_sequence() {
        let n = names();
        let mut s = ReplicaState::new(&n, IndexConfig::default());
        s.apply(
            7,
            &n.kv_events(1),
            &batch(1, 0, vec![KvEventData::Cleared, stored(None, 10)]),
        );
        let restored = ReplicaState::restore(&n, &s.snapshot()).unwrap();
        assert_eq!(restored.applied_seq(), 7);
        assert_eq!(restored.digest(), s.digest());
        assert_eq!(restored.tracker(), s.tracker());
        assert!(ReplicaState::restore(&n, b"nonsense").is_err());
    }
}
