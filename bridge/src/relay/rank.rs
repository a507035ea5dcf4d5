//! One rank's receive loop: live batches from the SUB socket, their `seq` judged, gaps and the
//! start-up history fetched from the engine's replay socket, each batch decoded, mirrored and
//! published under the rank's lock.
//!
//! A replay is asked from the last batch applied, which must come back unchanged (else the
//! engine restarted: the rank is cleared and the new incarnation's batches replayed from 0);
//! an answer with a hole is applied up to the hole and asked again from there; what cannot be
//! replayed clears the rank. Each replay request waits at most [`REPLAY_IDLE`] for each
//! message, so its length scales with what is replayed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_common::DpRank;
use kvroute_common::messages::KvEventData;
use xxhash_rust::xxh3::xxh3_64;

use super::RankState;
use crate::config::EngineKind;
use crate::metrics::{BridgeMetrics, names};
use crate::mirror::Translation;
use crate::sequence::{BatchDisposition, ReplayDisposition, judge_replay};
use crate::wire::{EngineEvent, decode_batch};
use crate::zmq_io::{self, Subscriber};

/// How long a replay may go without a message before it is given up.
pub const REPLAY_IDLE: Duration = Duration::from_secs(2);

/// Requests one replay may take to fill the holes of its answers (each brings a batch more).
const REPLAY_ROUNDS: usize = 64;

/// How a replay ended.
#[derive(Debug)]
enum Replayed {
    /// Everything wanted was applied.
    Done,
    /// What is missing cannot be replayed (`outcome` is the metric label).
    Lost { why: String, outcome: &'static str },
    /// The engine's copy of the last batch applied differs: a new incarnation.
    Restarted,
}

/// One rank's receive loop.
pub(super) struct RankWorker {
    pub(super) label: String,
    pub(super) kind: EngineKind,
    pub(super) rank: DpRank,
    pub(super) ctx: zmq::Context,
    pub(super) replay: Option<String>,
    pub(super) state: Arc<Mutex<RankState>>,
    pub(super) metrics: Arc<BridgeMetrics>,
    /// Batches received from the engine (live and replayed), for the silent-events check.
    pub(super) received: Arc<AtomicU64>,
    /// Set by [`super::Relay::check_incarnation`]: verify the engine's incarnation first.
    pub(super) check: Arc<AtomicBool>,
}

impl RankWorker {
    pub(super) fn run(self, subscriber: Subscriber, running: &AtomicBool) {
        // Subscribed first, so live batches queue while the history is fetched.
        let mut replayed = self.catch_up();
        while running.load(Ordering::Relaxed) {
            if self.check.swap(false, Ordering::Relaxed) {
                replayed.extend(self.check_incarnation());
            }
            let frames = match subscriber.recv() {
                Ok(Some(f)) => f,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(engine = %self.label, rank = self.rank, error = %e, "ZMQ receive failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let received = Instant::now();
            if let Some(reason) = zmq_io::frames_error(&frames) {
                self.count_error(reason);
                continue;
            }
            let seq = zmq_io::seq_of(&frames[1]);
            let hash = xxh3_64(&frames[2]);
            // Live batches queued during the start-up catch-up that it already applied: the same
            // seq with the same bytes (a restarted engine's batch differs, by its timestamp at
            // least).
            if !replayed.is_empty() {
                if replayed.get(&seq) == Some(&hash) {
                    self.metrics.inc(
                        names::IGNORED,
                        &self.label,
                        Some(self.rank),
                        "already_replayed",
                    );
                    continue;
                }
                replayed.clear();
            }
            let verdict = self.state.lock().expect("rank lock").tracker.observe(seq);
            match verdict {
                BatchDisposition::Apply => {}
                BatchDisposition::Gap { from, to } => {
                    self.metrics
                        .inc(names::GAPS, &self.label, Some(self.rank), "");
                    self.fill(from, to);
                }
                BatchDisposition::Restarted { seq } => {
                    tracing::info!(engine = %self.label, rank = self.rank, seq, "engine restarted (seq went back): clearing the rank");
                    self.restarted();
                    if seq > 0 {
                        self.metrics
                            .inc(names::GAPS, &self.label, Some(self.rank), "");
                        self.fill(0, seq);
                    }
                }
            }
            self.apply(&frames[2], received, Some((seq, hash)));
        }
    }

    /// At start, fetches the engine's whole replay buffer, so the engine's cache is known
    /// without waiting for its next batch (an engine at rest may send none for a long time).
    /// Returns the seqs applied with a hash of their bytes. An engine that is not up yet, or
    /// has no replay socket, leaves this to the first live batch.
    fn catch_up(&self) -> hashbrown::HashMap<u64, u64> {
        let mut applied = hashbrown::HashMap::new();
        if self.replay.is_none() {
            return applied;
        }
        let outcome = self.replay_into(0, None, true, &mut applied);
        let last = applied.keys().copied().max();
        match outcome {
            Replayed::Done => {
                let first = applied.keys().copied().min();
                if first.is_some_and(|f| f > 0) {
                    // The buffer no longer starts at the engine's first batch: what came before
                    // is unknown to routing until the engine stores it again.
                    self.metrics
                        .inc(names::REPLAYS, &self.label, Some(self.rank), "not_covered");
                    tracing::warn!(engine = %self.label, rank = self.rank, first, "the engine's history is only partly buffered");
                } else if first.is_some() {
                    self.metrics
                        .inc(names::REPLAYS, &self.label, Some(self.rank), "ok");
                }
            }
            Replayed::Lost { why, .. } => {
                tracing::info!(engine = %self.label, rank = self.rank, error = %why, "no (complete) history from the engine at start; the next batch decides");
            }
            // Nothing was applied before the first answer: cannot happen at start.
            Replayed::Restarted => {}
        }
        if let Some(last) = last {
            self.state
                .lock()
                .expect("rank lock")
                .tracker
                .resume(last.saturating_add(1));
            tracing::info!(engine = %self.label, rank = self.rank, batches = applied.len(), next = last + 1, "caught up with the engine's buffered history");
        }
        applied
    }

    /// After the engine was deemed down and answers again: is it still the incarnation whose
    /// batches were applied? Asks the replay socket from the last batch applied, which must come
    /// back unchanged; then the mirror is kept (the engine was only slow to answer `/health`) and
    /// the batches sent since are applied. Otherwise — other bytes, a buffer that no longer has
    /// it, no replay socket, no batch applied to prove it with blocks mirrored — the rank is
    /// cleared as a new incarnation and the new one's buffered batches are applied. Returns the
    /// batches applied (seq → payload hash), for the live loop to skip.
    fn check_incarnation(&self) -> hashbrown::HashMap<u64, u64> {
        let (last, mirrored) = {
            let s = self.state.lock().expect("rank lock");
            (s.tracker.last_applied(), !s.mirror.is_empty())
        };
        let why = match (last, &self.replay) {
            (None, _) if !mirrored => return hashbrown::HashMap::new(),
            (None, _) => "no batch applied to prove it by".to_owned(),
            (Some(_), None) => "no replay endpoint to prove it by".to_owned(),
            (Some((seq, _)), Some(_)) => {
                let mut applied = hashbrown::HashMap::new();
                match self.replay_into(seq.saturating_add(1), None, false, &mut applied) {
                    Replayed::Done => {
                        if let Some(&max) = applied.keys().max() {
                            let mut s = self.state.lock().expect("rank lock");
                            if s.tracker.next().is_none_or(|n| n <= max) {
                                s.tracker.resume(max.saturating_add(1));
                            }
                        }
                        self.metrics.inc(
                            names::INCARNATION_CHECKS,
                            &self.label,
                            Some(self.rank),
                            "same",
                        );
                        tracing::info!(engine = %self.label, rank = self.rank, seq, "the engine answers again with its last batch unchanged: its cache is kept");
                        return applied;
                    }
                    Replayed::Restarted => "its last batch differs".to_owned(),
                    Replayed::Lost { why, .. } => why,
                }
            }
        };
        self.metrics.inc(
            names::INCARNATION_CHECKS,
            &self.label,
            Some(self.rank),
            "new",
        );
        tracing::info!(engine = %self.label, rank = self.rank, why, "the engine answers again as a new incarnation: clearing the rank");
        self.restarted();
        self.state.lock().expect("rank lock").tracker.reset();
        self.catch_up()
    }

    fn count_error(&self, reason: &str) {
        self.metrics
            .inc(names::DECODE_ERRORS, &self.label, Some(self.rank), reason);
    }

    /// Fetches batches `from .. to` from the engine's replay socket and applies them; when that
    /// is not possible, clears the rank (its earlier blocks are lost to routing until the engine
    /// stores them again). An engine found to have restarted is replayed from its first batch.
    fn fill(&self, from: u64, to: u64) {
        if self.replay.is_none() {
            self.metrics.inc(
                names::REPLAYS,
                &self.label,
                Some(self.rank),
                "not_configured",
            );
            return self.give_up(from, to, "no replay endpoint");
        }
        let mut applied = hashbrown::HashMap::new();
        let mut outcome = self.replay_into(from, Some(to), false, &mut applied);
        if let Replayed::Restarted = outcome {
            tracing::info!(engine = %self.label, rank = self.rank, from, to, "the engine's numbering moved past ours, but its batches are others: a new incarnation, clearing the rank");
            self.restarted();
            outcome = self.replay_into(0, Some(to), false, &mut applied);
        }
        match outcome {
            Replayed::Done => self
                .metrics
                .inc(names::REPLAYS, &self.label, Some(self.rank), "ok"),
            Replayed::Lost { why, outcome } => {
                self.metrics
                    .inc(names::REPLAYS, &self.label, Some(self.rank), outcome);
                self.give_up(from, to, &why);
            }
            // The new incarnation's first batch cannot differ from a batch not yet applied.
            Replayed::Restarted => self.give_up(from, to, "the engine restarted again"),
        }
    }

    /// Asks the replay socket for batches from `from` (up to `until`, or the whole buffer) and
    /// applies them, asking again after each hole. `from_anywhere`: take the buffer from
    /// wherever it starts (the start-up catch-up). Records every batch applied in `applied`.
    fn replay_into(
        &self,
        from: u64,
        until: Option<u64>,
        from_anywhere: bool,
        applied: &mut hashbrown::HashMap<u64, u64>,
    ) -> Replayed {
        let Some(endpoint) = &self.replay else {
            return Replayed::Lost {
                why: "no replay endpoint".into(),
                outcome: "not_configured",
            };
        };
        let mut check = self
            .state
            .lock()
            .expect("rank lock")
            .tracker
            .continuity(from);
        let mut asked = check.map_or(from, |(seq, _)| seq);
        let mut anywhere = from_anywhere;
        for _ in 0..REPLAY_ROUNDS {
            let batches = match zmq_io::replay(&self.ctx, endpoint, asked, REPLAY_IDLE) {
                Ok(b) => b,
                Err(e) => {
                    return Replayed::Lost {
                        why: e.to_string(),
                        outcome: "failed",
                    };
                }
            };
            let hashes: Vec<(u64, u64)> = batches.iter().map(|(s, p)| (*s, xxh3_64(p))).collect();
            let verdict = judge_replay(asked, check.map(|(_, h)| h), &hashes, until, anywhere);
            let (skip, take, again) = match verdict {
                ReplayDisposition::Apply { skip, take, again } => (skip, take, again),
                ReplayDisposition::NotCovered => {
                    return Replayed::Lost {
                        why: "the engine's replay buffer no longer has it".into(),
                        outcome: "not_covered",
                    };
                }
                ReplayDisposition::Restarted => return Replayed::Restarted,
            };
            let now = Instant::now();
            for i in skip..skip + take {
                let (seq, payload) = &batches[i];
                self.apply(payload, now, Some(hashes[i]));
                applied.insert(*seq, hashes[i].1);
            }
            let Some(next) = again else {
                return Replayed::Done;
            };
            self.metrics
                .inc(names::REPLAYS, &self.label, Some(self.rank), "hole");
            if take == 0 {
                return Replayed::Lost {
                    why: format!("the engine's replay answers keep missing batch {next}"),
                    outcome: "incomplete",
                };
            }
            tracing::debug!(engine = %self.label, rank = self.rank, next, "the replay answer had a hole: asking again");
            // Again from the last batch applied, which must still be the engine's.
            check = Some(hashes[skip + take - 1]);
            asked = next - 1;
            anywhere = false;
        }
        Replayed::Lost {
            why: format!("still incomplete after {REPLAY_ROUNDS} replay requests"),
            outcome: "incomplete",
        }
    }

    fn give_up(&self, from: u64, to: u64, why: &str) {
        tracing::warn!(engine = %self.label, rank = self.rank, from, to, why, "cannot replay the gap: clearing the rank");
        self.metrics
            .inc(names::CLEARED, &self.label, Some(self.rank), "");
        self.clear_rank();
    }

    /// A new engine incarnation seen on the wire: counted, and the rank cleared.
    fn restarted(&self) {
        self.metrics
            .inc(names::INCARNATIONS, &self.label, Some(self.rank), "");
        self.clear_rank();
    }

    fn clear_rank(&self) {
        let mut s = self.state.lock().expect("rank lock");
        s.mirror.clear();
        s.tracker.forget_applied();
        s.publish(self.rank, vec![KvEventData::Cleared]);
        self.metrics
            .set(names::MIRROR_BLOCKS, &self.label, Some(self.rank), 0.0);
    }

    /// Decodes and applies one batch (`seq_hash`: its seq and payload hash, recorded as the last
    /// applied). A batch that cannot be decoded (or is over [`zmq_io::MAX_BATCH_BYTES`]) is
    /// counted and skipped — and since what it said is lost, the rank is cleared, as for a gap
    /// that cannot be replayed: kvroute must not keep blocks whose removal may have been in it.
    fn apply(&self, payload: &[u8], received: Instant, seq_hash: Option<(u64, u64)>) {
        self.received.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .inc(names::BATCHES, &self.label, Some(self.rank), "");
        let decoded = if payload.len() > zmq_io::MAX_BATCH_BYTES {
            Err("oversize")
        } else {
            decode_batch(self.kind, payload).map_err(|e| e.reason())
        };
        let batch = match decoded {
            Ok(b) => b,
            Err(reason) => {
                self.count_error(reason);
                tracing::warn!(engine = %self.label, rank = self.rank, reason, "undecodable batch: clearing the rank");
                self.metrics
                    .inc(names::CLEARED, &self.label, Some(self.rank), "");
                self.clear_rank();
                if let Some((seq, hash)) = seq_hash {
                    self.state
                        .lock()
                        .expect("rank lock")
                        .tracker
                        .applied(seq, hash);
                }
                return;
            }
        };
        for reason in &batch.skipped {
            self.count_error(reason);
        }
        let mut out = Translation::default();
        let mut s = self.state.lock().expect("rank lock");
        for event in &batch.events {
            let kind = match event {
                EngineEvent::Stored(_) => "BlockStored",
                EngineEvent::Removed(_) => "BlockRemoved",
                EngineEvent::AllCleared => {
                    s.engine_clears += 1;
                    "AllBlocksCleared"
                }
            };
            self.metrics
                .inc(names::EVENTS, &self.label, Some(self.rank), kind);
            s.mirror.apply(event, &mut out);
        }
        if let Some((seq, hash)) = seq_hash {
            s.tracker.applied(seq, hash);
        }
        let published = !out.events.is_empty() && s.publisher.is_some();
        s.publish(self.rank, std::mem::take(&mut out.events));
        let blocks = s.mirror.len();
        drop(s);
        let m = &self.metrics;
        if published {
            m.inc(names::PUBLISHED_BATCHES, &self.label, Some(self.rank), "");
            m.add_f64(
                names::PUBLISH_SECONDS,
                &self.label,
                Some(self.rank),
                received.elapsed().as_secs_f64(),
            );
        }
        if out.duplicate_copies > 0 {
            m.add(
                names::DUPLICATE_COPIES,
                &self.label,
                Some(self.rank),
                "",
                out.duplicate_copies,
            );
        }
        for (reason, n) in out.ignored {
            m.add(names::IGNORED, &self.label, Some(self.rank), reason, n);
        }
        m.set(
            names::MIRROR_BLOCKS,
            &self.label,
            Some(self.rank),
            blocks as f64,
        );
    }
}
