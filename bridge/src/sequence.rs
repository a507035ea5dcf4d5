//! Judging each live batch's `seq` for one engine rank, and each replay answer. Pure.
//!
//! Engines number their batches per rank from 0, one by one, on the PUB socket (which drops
//! messages under back-pressure, and which a subscriber joins late). The tracker says what to
//! do with the next live batch: apply it, fetch a gap first, or start over because the engine
//! restarted (its numbering went back).
//!
//! A forward gap may also be a restart: an engine that restarted without its `/health` failing
//! numbers from 0 again, and by the time the bridge sees it the new numbering may have passed
//! the old one. So the tracker keeps a hash of the last batch applied, and a gap is replayed
//! from that batch: the engine's copy of it must be the same bytes ([`judge_replay`]), else
//! the engine is a new incarnation. A replay answer must also be consecutive: the engines'
//! replay ROUTER drops messages past its high-water mark (vLLM 0.32: 1,000) and still sends
//! the end marker, so a hole is asked for again, never taken as complete.

/// What to do with a live batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchDisposition {
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
    /// The last batch applied: its seq and a hash of its payload.
    last: Option<(u64, u64)>,
}

impl SeqTracker {
    /// Judges live batch `seq` and advances past it.
    pub fn observe(&mut self, seq: u64) -> BatchDisposition {
        let verdict = match self.next {
            None if seq == 0 => BatchDisposition::Apply,
            // Joined late: what the engine announced before is unknown.
            None => BatchDisposition::Gap { from: 0, to: seq },
            Some(n) if seq == n => BatchDisposition::Apply,
            Some(n) if seq > n => BatchDisposition::Gap { from: n, to: seq },
            Some(_) => BatchDisposition::Restarted { seq },
        };
        self.next = Some(seq.saturating_add(1));
        verdict
    }

    /// Continues after batches up to `next - 1` were applied from the engine's replay buffer
    /// (the bridge catching up when it starts).
    pub fn resume(&mut self, next: u64) {
        self.next = Some(next);
    }

    /// Batch `seq`, whose payload hashes to `hash`, was applied.
    pub fn applied(&mut self, seq: u64, hash: u64) {
        self.last = Some((seq, hash));
    }

    /// The batch a replay for a gap from `from` starts with, to prove the engine is the one
    /// that sent it: `(from - 1, its hash)` when that was the last batch applied.
    pub fn continuity(&self, from: u64) -> Option<(u64, u64)> {
        self.last
            .filter(|&(seq, _)| seq.checked_add(1) == Some(from))
    }

    /// Forgets the last batch applied (the rank was cleared: it proves nothing any more).
    pub fn forget_applied(&mut self) {
        self.last = None;
    }

    /// Forgets the numbering (the engine restarted by other signs).
    pub fn reset(&mut self) {
        self.next = None;
        self.last = None;
    }

    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// The last batch applied (its seq and payload hash), if it still proves anything.
    pub fn last_applied(&self) -> Option<(u64, u64)> {
        self.last
    }
}

/// What a replay answer is worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayDisposition {
    /// Apply answer entries `skip .. skip + take` (consecutive seqs). `again`: the answer had
    /// a hole at that seq, or stopped short of the batches wanted: ask again from there.
    Apply {
        skip: usize,
        take: usize,
        again: Option<u64>,
    },
    /// The engine's buffer no longer starts at the asked seq: what is missing is lost.
    NotCovered,
    /// The engine's batch at the asked seq is not the one applied: a new incarnation.
    Restarted,
}

/// Judges a replay `answer` (`(seq, payload hash)` in order) to a request from `asked`.
/// `check`: the hash of batch `asked` as applied before (it must come back unchanged and is not
/// applied again). `want_until`: the batches wanted end before this seq (`None`: the whole
/// buffer). `from_anywhere`: an answer starting after `asked` is taken as it is (the bridge's
/// start-up catch-up, where what came before is unknown anyway).
pub fn judge_replay(
    asked: u64,
    check: Option<u64>,
    answer: &[(u64, u64)],
    want_until: Option<u64>,
    from_anywhere: bool,
) -> ReplayDisposition {
    let mut skip = 0;
    let mut expected = asked;
    if let Some(hash) = check {
        match answer.first() {
            Some(&(seq, h)) if seq == asked && h == hash => {
                skip = 1;
                expected = asked.saturating_add(1);
            }
            Some(&(seq, _)) if seq == asked => return ReplayDisposition::Restarted,
            _ => return ReplayDisposition::NotCovered,
        }
    } else {
        match answer.first() {
            Some(&(seq, _)) if seq == asked => {}
            Some(&(seq, _)) if from_anywhere && seq > asked => expected = seq,
            None if from_anywhere => {
                return ReplayDisposition::Apply {
                    skip: 0,
                    take: 0,
                    again: None,
                };
            }
            _ => return ReplayDisposition::NotCovered,
        }
    }
    let mut take = 0;
    for &(seq, _) in &answer[skip..] {
        if want_until.is_some_and(|end| seq >= end) || seq != expected {
            break;
        }
        take += 1;
        expected = expected.saturating_add(1);
    }
    let complete = match want_until {
        Some(end) => expected >= end,
        // The whole buffer: complete unless a hole cut the answer short.
        None => skip + take == answer.len(),
    };
    ReplayDisposition::Apply {
        skip,
        take,
        again: (!complete).then_some(expected),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_gaps_late_joins_and_restarts() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0), BatchDisposition::Apply);
        assert_eq!(t.observe(1), BatchDisposition::Apply);
        assert_eq!(t.observe(4), BatchDisposition::Gap { from: 2, to: 4 });
        assert_eq!(t.observe(5), BatchDisposition::Apply);
        assert_eq!(t.observe(0), BatchDisposition::Restarted { seq: 0 });
        assert_eq!(t.observe(1), BatchDisposition::Apply);
        assert_eq!(t.observe(1), BatchDisposition::Restarted { seq: 1 });
        let mut late = SeqTracker::default();
        assert_eq!(late.observe(7), BatchDisposition::Gap { from: 0, to: 7 });
        assert_eq!(late.next(), Some(8));
        late.reset();
        assert_eq!(late.observe(3), BatchDisposition::Gap { from: 0, to: 3 });
        assert_eq!(
            late.observe(u64::MAX),
            BatchDisposition::Gap {
                from: 4,
                to: u64::MAX
            }
        );
    }

    #[test]
    fn the_last_batch_applied_proves_continuity_until_a_reset() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0), BatchDisposition::Apply);
        t.applied(0, 99);
        assert_eq!(t.continuity(1), Some((0, 99)));
        assert_eq!(t.continuity(2), None, "only the batch right before the gap");
        t.reset();
        assert_eq!(t.continuity(1), None);
    }

    fn seqs(list: &[u64]) -> Vec<(u64, u64)> {
        list.iter().map(|&s| (s, s * 10)).collect()
    }

    #[test]
    fn a_replay_answer_must_be_consecutive_and_start_where_asked() {
        use ReplayDisposition::*;
        let apply = |skip, take, again| Apply { skip, take, again };
        // A gap 5..8 asked from 4 (the last batch applied): 4 comes back unchanged.
        let full = seqs(&[4, 5, 6, 7, 8]);
        assert_eq!(
            judge_replay(4, Some(40), &full, Some(8), false),
            apply(1, 3, None)
        );
        // The high-water mark dropped 6: apply 5, ask again from 6.
        let holed = seqs(&[4, 5, 7, 8]);
        assert_eq!(
            judge_replay(4, Some(40), &holed, Some(8), false),
            apply(1, 1, Some(6))
        );
        // The engine's batch 4 is another one: the engine restarted.
        assert_eq!(judge_replay(4, Some(41), &full, Some(8), false), Restarted);
        // The buffer starts later, or is empty.
        assert_eq!(
            judge_replay(4, Some(40), &seqs(&[5, 6]), Some(8), false),
            NotCovered
        );
        assert_eq!(judge_replay(4, None, &[], Some(8), false), NotCovered);
        // No batch to check (a late join): the answer must start at the asked seq.
        assert_eq!(
            judge_replay(0, None, &seqs(&[0, 1, 2]), Some(2), false),
            apply(0, 2, None)
        );
        assert_eq!(
            judge_replay(0, None, &seqs(&[1, 2]), Some(2), false),
            NotCovered
        );
        // An answer that ends before the wanted batches: ask again.
        assert_eq!(
            judge_replay(0, None, &seqs(&[0, 1]), Some(5), false),
            apply(0, 2, Some(2))
        );
        // The whole buffer at start-up: from wherever it starts, up to a hole or the end.
        assert_eq!(
            judge_replay(0, None, &seqs(&[3, 4, 5]), None, true),
            apply(0, 3, None)
        );
        assert_eq!(
            judge_replay(0, None, &seqs(&[3, 4, 9]), None, true),
            apply(0, 2, Some(5))
        );
        assert_eq!(judge_replay(0, None, &[], None, true), apply(0, 0, None));
    }
}
