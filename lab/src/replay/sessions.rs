//! Session figures of a run, for traces whose rows name their session: how well a session's
//! turns stay on one worker (stickiness) and the cache hit rate of the turns after the first,
//! next to the finite oracle's for the same turns. Also the `SessionContext` a replayed
//! request carries.

use std::collections::{BTreeMap, HashMap};

use kvroute_common::WorkerId;
use kvroute_common::messages::{SessionContext, SessionTrigger};
use kvroute_common::trace::TraceRequest;
use serde::{Deserialize, Serialize};

use super::oracle::ratio;

/// The session a trace row names, as a client sends it: a user's message in that session,
/// its id after `scope` (which keeps one run's or mode's sessions apart from another's in the
/// routers' shared bindings; empty: the row's id as it is).
pub fn session_context(request: &TraceRequest, scope: &str) -> Option<SessionContext> {
    request.session_id.as_ref().map(|id| SessionContext {
        id: format!("{scope}{id}"),
        parent_id: None,
        is_final: false,
        trigger: SessionTrigger::UserMessage,
    })
}

/// Where each planned request sits in its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKeys {
    of_request: Vec<Option<SessionTurn>>,
    sessions: usize,
}

/// A request's session (an index, dense from 0) and whether it comes after the session's
/// first turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTurn {
    pub session: usize,
    pub later: bool,
}

impl SessionKeys {
    /// The sessions of `requests`, or `None` when no row names one. A row is a later turn
    /// when its `turn` is 2 or more, or, without `turn`, when an earlier row named its session.
    pub fn of(requests: &[TraceRequest]) -> Option<Self> {
        let mut index: HashMap<&str, usize> = HashMap::new();
        let of_request: Vec<Option<SessionTurn>> = requests
            .iter()
            .map(|r| {
                let id = r.session_id.as_deref()?;
                let next = index.len();
                let seen = index.contains_key(id);
                let session = *index.entry(id).or_insert(next);
                let later = r.turn.map_or(seen, |t| t >= 2);
                Some(SessionTurn { session, later })
            })
            .collect();
        (!index.is_empty()).then_some(Self {
            of_request,
            sessions: index.len(),
        })
    }

    /// Request `i`'s session, if it has one.
    pub fn get(&self, i: usize) -> Option<SessionTurn> {
        self.of_request.get(i).copied().flatten()
    }

    /// Sessions in the plan.
    pub fn sessions(&self) -> usize {
        self.sessions
    }

    /// The planned requests that are later turns.
    pub fn later_turns(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.of_request.len()).filter(|&i| self.get(i).is_some_and(|t| t.later))
    }
}

/// The finite oracle on the later turns: what one fleet-sized LRU cache would have held of
/// their prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionOracle {
    /// Full prompt blocks of the later turns.
    pub later_turn_blocks: u64,
    /// Of them, leading blocks the finite oracle held.
    pub finite_hit_blocks: u64,
    /// `finite_hit_blocks / later_turn_blocks` (absent without later turns).
    pub finite: Option<f64>,
}

/// [`SessionOracle`] of `requests` from the finite oracle's hits per request (in blocks of
/// `block_size` tokens, as `oracle_with_hits` counts them).
pub fn session_oracle(
    keys: &SessionKeys,
    requests: &[TraceRequest],
    finite_hits: &[u32],
    block_size: u32,
) -> SessionOracle {
    let (mut blocks, mut hits) = (0u64, 0u64);
    for i in keys.later_turns() {
        blocks += u64::from(requests[i].input_length / block_size.max(1));
        hits += u64::from(finite_hits[i]);
    }
    SessionOracle {
        later_turn_blocks: blocks,
        finite_hit_blocks: hits,
        finite: (blocks > 0).then(|| ratio(hits, blocks)),
    }
}

/// One mode's session figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionReport {
    /// Whether the requests carried their session (off: `--no-sessions`).
    pub sent: bool,
    /// Sessions with at least two completed turns: the ones stickiness is measured on (a
    /// single turn cannot move).
    pub sessions: u64,
    /// The mean, over those sessions, of the share of a session's completed turns served by
    /// its most-used worker.
    pub stickiness: Option<f64>,
    /// The fraction of those sessions whose completed turns all ran on one worker.
    pub single_worker: Option<f64>,
    /// Completed turns after their session's first.
    pub later_turns: u64,
    pub later_prompt_tokens: u64,
    pub later_cached_tokens: u64,
    /// `later_cached_tokens / later_prompt_tokens`.
    pub later_hit_rate: Option<f64>,
}

/// One completed request of a session, as the recorder keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedTurn {
    /// The request's index in the plan.
    pub request: usize,
    pub worker_id: WorkerId,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Collects a mode's completed session turns.
#[derive(Debug, Clone)]
pub struct SessionRecorder {
    keys: SessionKeys,
    sent: bool,
    served: Vec<ServedTurn>,
}

impl SessionRecorder {
    pub fn new(keys: SessionKeys, sent: bool) -> Self {
        Self {
            keys,
            sent,
            served: Vec::new(),
        }
    }

    pub fn record(&mut self, turn: ServedTurn) {
        if self.keys.get(turn.request).is_some() {
            self.served.push(turn);
        }
    }

    pub fn finish(self) -> SessionReport {
        session_report(&self.keys, self.sent, &self.served)
    }
}

/// The session figures of `served` (completed requests, any order; requests without a session
/// are left out).
pub fn session_report(keys: &SessionKeys, sent: bool, served: &[ServedTurn]) -> SessionReport {
    // Per session: turns per worker.
    let mut per_session: BTreeMap<usize, BTreeMap<WorkerId, u64>> = BTreeMap::new();
    let (mut later_turns, mut later_prompt, mut later_cached) = (0u64, 0u64, 0u64);
    for s in served {
        let Some(turn) = keys.get(s.request) else {
            continue;
        };
        *per_session
            .entry(turn.session)
            .or_default()
            .entry(s.worker_id)
            .or_default() += 1;
        if turn.later {
            later_turns += 1;
            later_prompt += s.prompt_tokens;
            later_cached += s.cached_tokens;
        }
    }
    let (mut measured, mut share_sum, mut single) = (0u64, 0.0, 0u64);
    for workers in per_session.values() {
        let turns: u64 = workers.values().sum();
        if turns < 2 {
            continue;
        }
        let most = workers.values().copied().max().unwrap_or(0);
        measured += 1;
        share_sum += most as f64 / turns as f64;
        single += u64::from(workers.len() == 1);
    }
    SessionReport {
        sent,
        sessions: measured,
        stickiness: (measured > 0).then(|| share_sum / measured as f64),
        single_worker: (measured > 0).then(|| single as f64 / measured as f64),
        later_turns,
        later_prompt_tokens: later_prompt,
        later_cached_tokens: later_cached,
        later_hit_rate: (later_prompt > 0).then(|| ratio(later_cached, later_prompt)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(session: Option<&str>, turn: Option<u32>, input_length: u32) -> TraceRequest {
        TraceRequest {
            input_length,
            output_length: 1,
            session_id: session.map(str::to_owned),
            turn,
            ..TraceRequest::default()
        }
    }

    fn served(request: usize, worker_id: WorkerId, cached_tokens: u64) -> ServedTurn {
        ServedTurn {
            request,
            worker_id,
            prompt_tokens: 100,
            cached_tokens,
        }
    }

    #[test]
    fn keys_number_sessions_and_find_later_turns() {
        assert_eq!(SessionKeys::of(&[row(None, None, 1)]), None);
        let trace = [
            row(Some("a"), Some(1), 1),
            row(Some("b"), None, 1),
            row(None, None, 1),
            row(Some("a"), Some(2), 1),
            row(Some("b"), None, 1),
            // A cut trace: its first row is turn 3.
            row(Some("c"), Some(3), 1),
        ];
        let keys = SessionKeys::of(&trace).unwrap();
        assert_eq!(keys.sessions(), 3);
        assert_eq!(keys.get(2), None);
        assert_eq!(
            keys.get(4),
            Some(SessionTurn {
                session: 1,
                later: true
            })
        );
        assert_eq!(keys.later_turns().collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(keys.get(99), None);
    }

    #[test]
    fn stickiness_is_the_mean_share_of_the_most_used_worker() {
        // Session a: 4 turns, 3 on worker 1. Session b: 2 turns on worker 2. Session c: one
        // turn (not measured). A request without a session is left out.
        let trace = [
            row(Some("a"), Some(1), 100),
            row(Some("b"), Some(1), 100),
            row(Some("a"), Some(2), 100),
            row(Some("c"), Some(1), 100),
            row(Some("a"), Some(3), 100),
            row(Some("b"), Some(2), 100),
            row(Some("a"), Some(4), 100),
            row(None, None, 100),
        ];
        let keys = SessionKeys::of(&trace).unwrap();
        let decisions = [
            served(0, 1, 0),
            served(1, 2, 0),
            served(2, 1, 60),
            served(3, 3, 0),
            served(4, 5, 0),
            served(5, 2, 100),
            served(6, 1, 80),
            served(7, 9, 100),
        ];
        let r = session_report(&keys, true, &decisions);
        assert_eq!(r.sessions, 2);
        assert_eq!(r.stickiness, Some((0.75 + 1.0) / 2.0));
        assert_eq!(r.single_worker, Some(0.5));
        // Later turns: a's 2, 3, 4 and b's 2: 240 of 400 tokens cached.
        assert_eq!((r.later_turns, r.later_prompt_tokens), (4, 400));
        assert_eq!(r.later_hit_rate, Some(0.6));

        // The metric can fail: every turn elsewhere.
        let scattered: Vec<ServedTurn> = (0..7).map(|i| served(i, i as u64, 0)).collect();
        let r = session_report(&keys, false, &scattered);
        assert_eq!(
            r.stickiness,
            Some((0.25 + 0.5) / 2.0),
            "a: 1 of 4, b: 1 of 2"
        );
        assert_eq!(r.single_worker, Some(0.0));
        assert_eq!(r.later_hit_rate, Some(0.0));
        assert!(!r.sent);

        // Nothing measurable: no figure rather than a zero.
        let r = session_report(&keys, true, &[served(0, 1, 0)]);
        assert_eq!(
            (r.sessions, r.stickiness, r.later_hit_rate),
            (0, None, None)
        );
    }

    #[test]
    fn the_oracle_counts_later_turns_only() {
        let trace = [
            row(Some("a"), Some(1), 640),
            row(Some("a"), Some(2), 1300),
            row(None, None, 640),
        ];
        let keys = SessionKeys::of(&trace).unwrap();
        let o = session_oracle(&keys, &trace, &[0, 10, 10], 64);
        assert_eq!((o.later_turn_blocks, o.finite_hit_blocks), (20, 10));
        assert_eq!(o.finite, Some(0.5));
    }

    #[test]
    fn a_row_with_a_session_is_sent_as_a_users_message() {
        let s = session_context(&row(Some("chat-1"), Some(2), 1), "").unwrap();
        assert_eq!((s.id.as_str(), s.is_final), ("chat-1", false));
        assert_eq!(s.trigger, SessionTrigger::UserMessage);
        assert_eq!(session_context(&row(None, Some(2), 1), ""), None);
        let scoped = session_context(&row(Some("chat-1"), None, 1), "run-kv/").unwrap();
        assert_eq!(scoped.id, "run-kv/chat-1");
    }
}
