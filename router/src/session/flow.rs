//! A request in a session, with the store's round trips outside the step that chooses: look the
//! binding up, choose under the route it gives (the caller's critical section — policy state
//! and load view — is held only while choosing), then commit the binding. When another router
//! bound the session meanwhile (two first requests racing), this choice is withdrawn and the
//! request is chosen again under the winner's binding: adopted when the winner is eligible for
//! it, otherwise chosen anew and written over it.
//!
//! [`SessionFlow`] is those rules as a step machine without I/O: its caller reads and writes
//! the store and hands back the results (the selection machine, `crate::decide::selection`).

use kvroute_common::messages::{BindingState, SessionContext};

use super::binding::{SessionConfig, Versioned};
use super::store::{SessionWrite, WriteOutcome};
use super::table::{
    BindingStatus, CommitPlan, SessionError, SessionLookup, SessionRoute, plan_commit, read,
};
use crate::worker::{WorkerRank, WorkerTarget};

/// How often a binding commit that raced with another router is retried.
pub const MAX_COMMIT_ATTEMPTS: usize = 4;

/// A session's lookup, choice and commit, as steps (see the module docs).
#[derive(Debug, Clone)]
pub struct SessionFlow {
    session: SessionContext,
    config: SessionConfig,
    /// The request names its worker: a racing router's binding is not adopted over the pin.
    pinned: bool,
    lookup: Option<SessionLookup>,
    /// The state the pending write reports once written.
    writing: Option<BindingState>,
    attempts: usize,
}

/// What a choice's commit takes next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterChoice {
    /// Committed (nothing had to be written): the binding's state.
    Bound(Option<BindingState>),
    /// Write this, then hand the outcome to [`SessionFlow::written`].
    Write(SessionWrite),
}

/// What a write's outcome comes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterWrite {
    /// Committed with this state.
    Bound(Option<BindingState>),
    /// Another router wrote first: read the binding again, withdraw the choice
    /// ([`SessionFlow::read`] gives the route to choose under next).
    Reread,
}

impl SessionFlow {
    pub fn new(session: SessionContext, pinned: bool, config: SessionConfig) -> Self {
        Self {
            session,
            config,
            pinned,
            lookup: None,
            writing: None,
            attempts: 0,
        }
    }

    /// The key to read (first, and again after a lost race).
    pub fn key(&self) -> &str {
        &self.session.id
    }

    /// What the store held at `now_ms`: the route to choose under. After a lost race, a live
    /// winner is adopted exactly (unless the request is pinned); after
    /// [`MAX_COMMIT_ATTEMPTS`] lost races, contention.
    pub fn read(
        &mut self,
        current: Option<Versioned>,
        registered: &(dyn Fn(WorkerRank) -> bool + Sync),
        now_ms: u64,
    ) -> Result<SessionRoute, SessionError> {
        let raced = self.lookup.is_some();
        let lookup = read(
            &self.config,
            self.session.clone(),
            current,
            registered,
            now_ms,
        );
        let route = match lookup.status() {
            BindingStatus::Live(winner) if raced && !self.pinned => {
                SessionRoute::Exact(WorkerTarget::exact(winner))
            }
            _ => lookup.route(self.config.mode),
        };
        self.lookup = Some(lookup);
        if self.attempts >= MAX_COMMIT_ATTEMPTS {
            return Err(SessionError::Contention {
                session: self.session.id.clone(),
            });
        }
        Ok(route)
    }

    /// The choice's rank, chosen at `now_ms` after [`Self::read`].
    pub fn chose(&mut self, worker: WorkerRank, now_ms: u64) -> AfterChoice {
        let lookup = self.lookup.as_ref().expect("chose after read");
        match plan_commit(lookup, worker, now_ms) {
            CommitPlan::Done(state) => AfterChoice::Bound(state),
            CommitPlan::Write(write, state) => {
                self.writing = Some(state);
                AfterChoice::Write(write)
            }
        }
    }

    /// The write's outcome.
    pub fn written(&mut self, outcome: WriteOutcome) -> AfterWrite {
        match outcome {
            WriteOutcome::Written(_) => AfterWrite::Bound(self.writing.take()),
            WriteOutcome::Conflict => {
                self.attempts += 1;
                AfterWrite::Reread
            }
        }
    }
}
