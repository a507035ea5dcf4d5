//! One entry of the event log, decoded from its subject and payload.

use kvroute_common::codec::{DecodeError, decode};
use kvroute_common::messages::{ControlRecord, KvEventBatch};
use kvroute_common::names::{Names, parse_worker_id};

/// What a log message carries.
#[derive(Debug, Clone, PartialEq)]
pub enum LogEntry {
    Events(KvEventBatch),
    Control(ControlRecord),
}

/// Why a log message was skipped; `reason()` labels the bad-message metric.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadEntry {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("batch on {subject} claims worker {claimed}")]
    WorkerMismatch { subject: String, claimed: u64 },
    #[error("unexpected subject {subject}")]
    UnknownSubject { subject: String },
}

impl BadEntry {
    /// Every [`BadEntry::reason`].
    pub fn reasons() -> Vec<&'static str> {
        let mut all = DecodeError::REASONS.to_vec();
        all.extend(["worker_mismatch", "unknown_subject"]);
        all
    }

    pub fn reason(&self) -> &'static str {
        match self {
            BadEntry::Decode(e) => e.reason(),
            BadEntry::WorkerMismatch { .. } => "worker_mismatch",
            BadEntry::UnknownSubject { .. } => "unknown_subject",
        }
    }
}

/// Decodes a message of the events stream. A batch must come from the worker its subject
/// names (a schema violation otherwise).
pub fn decode_entry(names: &Names, subject: &str, payload: &[u8]) -> Result<LogEntry, BadEntry> {
    if subject == names.kv_control() {
        return Ok(LogEntry::Control(decode(payload)?));
    }
    let Some(worker) = subject
        .rsplit_once('.')
        .filter(|(stem, _)| format!("{stem}.*") == names.kv_events_all())
        .and_then(|(_, id)| parse_worker_id(id))
    else {
        return Err(BadEntry::UnknownSubject {
            subject: subject.to_owned(),
        });
    };
    let batch: KvEventBatch = decode(payload)?;
    if batch.worker_id != worker {
        return Err(BadEntry::WorkerMismatch {
            subject: subject.to_owned(),
            claimed: batch.worker_id,
        });
    }
    Ok(LogEntry::Events(batch))
}
