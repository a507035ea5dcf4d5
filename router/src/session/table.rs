//! The session table: a session store with its configuration, and the pure rules of a
//! binding — how what the store holds constrains selection (exact target or affinity hint,
//! [`read`]), and what committing a successful selection writes and reports (new / kept /
//! rebound / released, [`plan_commit`]). [`super::SessionFlow`] runs them as steps.

use kvroute_common::messages::{BindingState, SessionContext};

use super::binding::{AffinityMode, SessionBinding, SessionConfig, Versioned};
use super::store::{SessionStore, SessionWrite, StoreError};
use crate::worker::{WorkerRank, WorkerTarget};

/// The session table failed to read or commit a binding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("session {session:?}: binding kept changing under concurrent writers")]
    Contention { session: String },
}

/// The binding as this selection sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindingStatus {
    Absent,
    /// Bound to a rank that is still registered and was used within the idle TTL.
    Live(WorkerRank),
    /// Idle past the TTL: treated as absent.
    Expired,
    /// Bound to a rank that is no longer registered for the model: never offered or honored.
    Departed(WorkerRank),
}

/// How the binding constrains this selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionRoute {
    /// Select normally, offering `affinity` to the policy (soft mode).
    Open { affinity: Option<WorkerTarget> },
    /// Use exactly this rank if it is still eligible, otherwise select normally (hard mode).
    Exact(WorkerTarget),
}

/// A session's binding as read before selection; handed back to [`plan_commit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionLookup {
    session: SessionContext,
    current: Option<Versioned>,
    status: BindingStatus,
}

impl SessionLookup {
    pub fn status(&self) -> BindingStatus {
        self.status
    }

    pub fn session(&self) -> &SessionContext {
        &self.session
    }

    /// The selection route in `mode`.
    pub fn route(&self, mode: AffinityMode) -> SessionRoute {
        match (self.status, mode) {
            (BindingStatus::Live(worker), AffinityMode::Hard) => {
                SessionRoute::Exact(WorkerTarget::exact(worker))
            }
            (BindingStatus::Live(worker), AffinityMode::Soft) => SessionRoute::Open {
                affinity: Some(WorkerTarget::exact(worker)),
            },
            _ => SessionRoute::Open { affinity: None },
        }
    }
}

/// The session store and its configuration.
#[derive(Debug)]
pub struct SessionTable<S> {
    store: S,
    config: SessionConfig,
}

impl<S: SessionStore> SessionTable<S> {
    pub fn new(store: S, config: SessionConfig) -> Self {
        Self { store, config }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    pub fn store(&self) -> &S {
        &self.store
    }
}

/// What committing a choice takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitPlan {
    /// Nothing to write: committed with this state.
    Done(Option<BindingState>),
    /// This write; once written, the binding's state is the one given.
    Write(SessionWrite, BindingState),
}

/// The binding as a selection sees it, from what the store holds (`current`) at `now_ms`.
/// `registered` says whether a rank is still registered for the request's model and role (a
/// departed worker's binding is invalid).
pub fn read(
    config: &SessionConfig,
    session: SessionContext,
    current: Option<Versioned>,
    registered: &(dyn Fn(WorkerRank) -> bool + Sync),
    now_ms: u64,
) -> SessionLookup {
    let status = match current {
        None => BindingStatus::Absent,
        Some(v) if v.binding.is_expired(now_ms, config.idle_ttl_ms) => BindingStatus::Expired,
        Some(v) if !registered(v.binding.worker()) => BindingStatus::Departed(v.binding.worker()),
        Some(v) => BindingStatus::Live(v.binding.worker()),
    };
    SessionLookup {
        session,
        current,
        status,
    }
}

/// The write that commits `chosen` after a successful selection (a delete for a final
/// request), and the state it reports.
pub fn plan_commit(lookup: &SessionLookup, chosen: WorkerRank, now_ms: u64) -> CommitPlan {
    if lookup.session.is_final {
        if lookup.current.is_none() {
            return CommitPlan::Done(None);
        }
        return CommitPlan::Write(SessionWrite::Delete, BindingState::Released);
    }
    let binding = SessionBinding::new(chosen, now_ms);
    match (lookup.current, lookup.status) {
        (None, _) => CommitPlan::Write(SessionWrite::Create(binding), BindingState::New),
        (Some(current), status) => {
            let state = match status {
                BindingStatus::Live(bound) if bound == chosen => BindingState::Kept,
                BindingStatus::Live(_) | BindingStatus::Departed(_) => BindingState::Rebound,
                BindingStatus::Expired | BindingStatus::Absent => BindingState::New,
            };
            CommitPlan::Write(SessionWrite::Update(binding, current.revision), state)
        }
    }
}
