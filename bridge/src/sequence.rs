//! Judging each live batch's `seq` for one engine rank. Pure.
//!
//! Engines number their batches per rank from 0, one by one, on the PUB socket (which drops
//! messages under back-pressure, and which a subscriber joins late). The tracker says what to
//! do with the next live batch: apply it, fetch a gap first, or start over because the engine
//! restarted (its numbering went back).

/// What to do with a live batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch in order: apply it.
    Apply,
    /// Batches `from .. to` are missing: replay them (or clear the rank), then apply this one.
    Gap { from: u64, to: u64 },
    /// The numbering went back: a new engine incarnation. Clear the rank; batches `0 .. seq`
    /// of the new incarnation are missing when `seq > 0` (replay them first).
    Restarted { seq: u64 },
}

/// The per-rank tracker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqTracker {
    /// The seq expected next; `None` before the first batch (or after a reset).
    next: Option<u64>,
}

impl SeqTracker {
    /// Judges live batch `seq` and advances past it.
    pub fn observe(&mut self, seq: u64) -> Verdict {
        let verdict = match self.next {
            None if seq == 0 => Verdict::Apply,
            // Joined late: what the engine announced before is unknown.
            None => Verdict::Gap { from: 0, to: seq },
            Some(n) if seq == n => Verdict::Apply,
            Some(n) if seq > n => Verdict::Gap { from: n, to: seq },
            Some(_) => Verdict::Restarted { seq },
        };
        self.next = Some(seq.saturating_add(1));
        verdict
    }

    /// Continues after batches up to `next - 1` were applied from the engine's replay buffer
    /// (the bridge catching up when it starts).
    pub fn resume(&mut self, next: u64) {
        self.next = Some(next);
    }

    /// Forgets the numbering (the engine restarted by other signs).
    pub fn reset(&mut self) {
        self.next = None;
    }

    pub fn next(&self) -> Option<u64> {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_gaps_late_joins_and_restarts() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0), Verdict::Apply);
        assert_eq!(t.observe(1), Verdict::Apply);
        assert_eq!(t.observe(4), Verdict::Gap { from: 2, to: 4 });
        assert_eq!(t.observe(5), Verdict::Apply);
        assert_eq!(t.observe(0), Verdict::Restarted { seq: 0 });
        assert_eq!(t.observe(1), Verdict::Apply);
        assert_eq!(t.observe(1), Verdict::Restarted { seq: 1 });
        let mut late = SeqTracker::default();
        assert_eq!(late.observe(7), Verdict::Gap { from: 0, to: 7 });
        assert_eq!(late.next(), Some(8));
        late.reset();
        assert_eq!(late.observe(3), Verdict::Gap { from: 0, to: 3 });
        assert_eq!(
            late.observe(u64::MAX),
            Verdict::Gap {
                from: 4,
                to: u64::MAX
            }
        );
    }
}
