//! The one rule for following the log in order, shared by indexer replicas and the router's
//! local replica ([`crate::service::IndexFollower`]): the next message must be the one after
//! the applied sequence (or the consumer's start, for an empty state); a later one means the
//! log dropped messages this replica never applied (purged or expired), and the replica must
//! bootstrap again.

/// Where a log message stands relative to what the replica applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuity {
    /// The expected next message: apply it.
    Next,
    /// At or below what is applied (a redelivery): applying it changes nothing.
    AlreadyApplied,
    /// Messages `expected .. seq` are missing: bootstrap again.
    Missing { expected: u64 },
}

/// Classifies the message at stream sequence `seq` for a replica that applied up to
/// `applied_seq` (0: nothing) and consumes from `start_seq` (the sequence its bootstrap
/// chose: the snapshot's sequence + 1, or the log's first sequence).
pub fn continuity(applied_seq: u64, start_seq: u64, seq: u64) -> Continuity {
    let expected = applied_seq.saturating_add(1).max(start_seq);
    if seq < expected {
        Continuity::AlreadyApplied
    } else if seq == expected {
        Continuity::Next
    } else {
        Continuity::Missing { expected }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_message_follows_the_applied_one_or_the_start() {
        // Restored from a snapshot at 10: consumption starts at 11.
        assert_eq!(continuity(10, 11, 11), Continuity::Next);
        assert_eq!(continuity(10, 11, 10), Continuity::AlreadyApplied);
        assert_eq!(continuity(10, 11, 13), Continuity::Missing { expected: 11 });
        // An empty state consuming a log that starts at 1.
        assert_eq!(continuity(0, 1, 1), Continuity::Next);
        // ... whose first messages were purged between bootstrap and the first delivery.
        assert_eq!(continuity(0, 1, 4), Continuity::Missing { expected: 1 });
        // An empty state that starts mid-log on purpose (bootstrap resync).
        assert_eq!(continuity(0, 40, 40), Continuity::Next);
        assert_eq!(continuity(0, 40, 41), Continuity::Missing { expected: 40 });
        // Once applying, the start no longer matters.
        assert_eq!(continuity(41, 40, 42), Continuity::Next);
        assert_eq!(continuity(41, 1, 3), Continuity::AlreadyApplied);
    }
}
