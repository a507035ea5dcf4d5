//! One selection as a step machine without I/O, in the shape of raft-rs's `Ready`: given the
//! prepared request and `now`, [`Selection::start`] returns the first thing it needs done
//! ([`Need`]), and [`Selection::resume`] takes the result ([`Answer`]) and returns the next,
//! until the selection ends by joining the admission queue or with a reply. The decision itself
//! is not I/O: it runs inside `start`/`resume` under the caller's [`DecisionState`].
//!
//! The steps: the prompt's overlap (only when the policy reads `CACHE` and the caller did not
//! bring it) → with a session, the binding's read → [`decide`] under the route it gives → with
//! a session, the binding's write; a write that lost a race reads the binding again, withdraws
//! the decision and decides again (see [`crate::session::SessionFlow`]) → the reply. A request
//! that finds every eligible worker busy joins the queue instead, when the caller queues it.
//!
//! The router service drives it over NATS and the session bucket (`crate::drive`);
//! `kvroute-sim` and the replay's local selector answer from memory ([`crate::drive::now`]).

use kvroute_common::{DecisionId, Names};

use super::prompt::Prepared;
use super::{DecideInput, Decided, DecisionState, decide};
use crate::eligibility::{EligibilityError, Rules};
use crate::select::{SelectFailure, SelectionSettings};
use crate::session::{
    AfterChoice, AfterWrite, SessionConfig, SessionError, SessionFlow, SessionRoute, SessionWrite,
    StoreError, Versioned, WriteOutcome,
};
use crate::signals::SignalSnapshot;
use crate::worker::{WorkerRank, WorkerTarget};

/// What every selection of one router reads besides its request.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub settings: &'a SelectionSettings,
    /// Where a decision's reply says to send the request when its worker's card is gone.
    pub names: &'a Names,
    pub router_id: &'a str,
    pub sessions: SessionConfig,
}

/// How one selection starts, besides the prepared request.
#[derive(Debug, Clone)]
pub struct Start {
    /// The id a new decision gets (a re-decision after a lost commit reuses it: the withdrawn
    /// one was never published).
    pub decision_id: DecisionId,
    /// The policy reads `CACHE`: the prompt's overlap is needed.
    pub reads_cache: bool,
    /// The overlap the caller already has (a queued request's, when not too old).
    pub overlap: Option<SignalSnapshot>,
    /// A request classifier's soft preference (see [`DecideInput::selection_target`]).
    pub target: Option<WorkerTarget>,
    /// A request that finds every eligible worker busy joins the queue (else it fails
    /// `all_overloaded`).
    pub queues: bool,
}

/// The next thing a selection needs done.
#[derive(Debug)]
pub enum Need {
    /// The overlap of the prompt's hashes ([`Prepared::prompt`]) per rank: answer
    /// [`Answer::Overlap`] (empty when the prompt has no block or the index cannot answer).
    Overlap,
    /// The session's binding under this key: answer [`Answer::Session`].
    ReadSession(String),
    /// This write of the session's binding under this key: answer [`Answer::Written`].
    WriteSession(String, SessionWrite),
    /// Every eligible worker is busy: the request joins (or stays in) the admission queue,
    /// with the overlap it was decided with. The selection is over.
    Join(SignalSnapshot),
    /// The selection is over: reply with this.
    Reply(Result<Decided, SelectFailure>),
}

/// The result of a [`Need`].
#[derive(Debug)]
pub enum Answer {
    Overlap(SignalSnapshot),
    Session(Result<Option<Versioned>, StoreError>),
    Written(Result<WriteOutcome, StoreError>),
}

#[derive(Debug)]
enum Phase {
    Overlap,
    Read,
    Write(Box<super::NewDecision>),
    Reread(Box<super::NewDecision>),
    Done,
}

/// One request's selection (see the module docs).
#[derive(Debug)]
pub struct Selection<'a> {
    prepared: &'a Prepared,
    context: Context<'a>,
    start: Start,
    overlap: SignalSnapshot,
    session: Option<SessionFlow>,
    /// Dates the session binding's read and commit: the state's time once the overlap is in.
    session_ms: u64,
    phase: Phase,
}

impl<'a> Selection<'a> {
    /// The selection of `prepared`, and what it needs first.
    pub fn start(
        prepared: &'a Prepared,
        context: Context<'a>,
        mut start: Start,
        state: &mut impl DecisionState,
    ) -> (Self, Need) {
        let session =
            prepared.request.session.as_ref().map(|s| {
                SessionFlow::new(s.clone(), prepared.request.pin.is_some(), context.sessions)
            });
        let given = start.overlap.take();
        let needs_overlap = given.is_none() && start.reads_cache;
        let mut selection = Self {
            prepared,
            context,
            start,
            overlap: given.unwrap_or_default(),
            session,
            session_ms: 0,
            phase: Phase::Overlap,
        };
        let need = if needs_overlap {
            Need::Overlap
        } else {
            selection.after_overlap(state)
        };
        (selection, need)
    }

    /// Takes the result of the last [`Need`]; what is needed next.
    pub fn resume(&mut self, answer: Answer, state: &mut impl DecisionState) -> Need {
        match (std::mem::replace(&mut self.phase, Phase::Done), answer) {
            (Phase::Overlap, Answer::Overlap(overlap)) => {
                self.overlap = overlap;
                self.after_overlap(state)
            }
            (Phase::Read, Answer::Session(current)) => self.read(current, state),
            (Phase::Reread(new), Answer::Session(current)) => {
                state.with(|_, view, _| view.withdraw(&new.decision));
                self.read(current, state)
            }
            (Phase::Write(mut new), Answer::Written(written)) => {
                let flow = self.session.as_mut().expect("a write is a session's");
                match written.map(|o| flow.written(o)) {
                    Ok(AfterWrite::Bound(binding)) => {
                        new.bound(binding);
                        self.done(Ok(Decided::New(new)))
                    }
                    Ok(AfterWrite::Reread) => {
                        let key = flow.key().to_owned();
                        self.phase = Phase::Reread(new);
                        Need::ReadSession(key)
                    }
                    Err(e) => {
                        state.with(|_, view, _| view.withdraw(&new.decision));
                        self.done(Err(SessionError::from(e).into()))
                    }
                }
            }
            (phase, answer) => panic!("selection answered {answer:?} while in {phase:?}"),
        }
    }

    fn after_overlap(&mut self, state: &mut impl DecisionState) -> Need {
        self.session_ms = state.now_ms();
        match &self.session {
            Some(flow) => {
                self.phase = Phase::Read;
                Need::ReadSession(flow.key().to_owned())
            }
            None => self.decide(SessionRoute::Open { affinity: None }, state),
        }
    }

    fn read(
        &mut self,
        current: Result<Option<Versioned>, StoreError>,
        state: &mut impl DecisionState,
    ) -> Need {
        let flow = self.session.as_mut().expect("a read is a session's");
        let prepared = self.prepared;
        // A binding counts only while its rank is a registered rank of a card serving the
        // request.
        let rules = Rules::from_request(&prepared.request);
        let registered = |worker: WorkerRank| {
            prepared.partition.cards.iter().any(|c| {
                c.worker_id == worker.worker_id
                    && rules.serves(c)
                    && c.dp_ranks().any(|r| r == worker.dp_rank)
            })
        };
        let route = current
            .map_err(SessionError::from)
            .and_then(|current| flow.read(current, &registered, self.session_ms));
        match route {
            Ok(route) => self.decide(route, state),
            Err(e) => self.done(Err(e.into())),
        }
    }

    fn decide(&mut self, route: SessionRoute, state: &mut impl DecisionState) -> Need {
        let prepared = self.prepared;
        let input = DecideInput {
            request: &prepared.request,
            request_id: prepared.request_id,
            decision_id: self.start.decision_id,
            prompt: &prepared.prompt,
            partition: &prepared.partition,
            overlap: &self.overlap,
            settings: self.context.settings,
            names: self.context.names,
            router_id: self.context.router_id,
            selection_target: self.start.target,
        };
        let decided =
            state.with(|policy, view, now_ms| decide(policy, view, &input, route, now_ms));
        let mut new = match decided {
            Err(SelectFailure::Eligibility(EligibilityError::AllOverloaded { .. }))
                if self.start.queues =>
            {
                self.phase = Phase::Done;
                return Need::Join(std::mem::take(&mut self.overlap));
            }
            Ok(Decided::New(new)) => new,
            other => return self.done(other),
        };
        let Some(flow) = self.session.as_mut() else {
            return self.done(Ok(Decided::New(new)));
        };
        match flow.chose(new.selection.worker, self.session_ms) {
            AfterChoice::Bound(binding) => {
                new.bound(binding);
                self.done(Ok(Decided::New(new)))
            }
            AfterChoice::Write(op) => {
                let key = flow.key().to_owned();
                self.phase = Phase::Write(new);
                Need::WriteSession(key, op)
            }
        }
    }

    fn done(&mut self, result: Result<Decided, SelectFailure>) -> Need {
        self.phase = Phase::Done;
        Need::Reply(result)
    }
}
