//! A request in a session, with the store's round trips outside the step that chooses: look the
//! binding up, choose under the route it gives (the caller's critical section — policy state
//! and load view — is held only inside [`Chooser::choose`]), then commit the binding. When
//! another router bound the session meanwhile (two first requests racing), this choice is
//! withdrawn and the request is chosen again under the winner's binding: adopted when the
//! winner is eligible for it, otherwise chosen anew and written over it.

use kvroute_common::messages::{BindingState, SessionContext};

use super::store::SessionStore;
use super::table::{BindingStatus, CommitOutcome, SessionError, SessionRoute, SessionTable};
use crate::worker::{WorkerRank, WorkerTarget};

/// How often a binding commit that raced with another router is retried.
pub const MAX_COMMIT_ATTEMPTS: usize = 4;

/// The step that chooses, run once per attempt.
pub trait Chooser {
    type Choice;
    type Error: From<SessionError>;
    /// Chooses under `route` (takes and releases whatever the choice needs locked).
    fn choose(&mut self, route: SessionRoute) -> Result<Self::Choice, Self::Error>;
    /// The rank to bind; `None` when the choice commits nothing (the request was already
    /// answered, or is past its deadline).
    fn worker(&self, choice: &Self::Choice) -> Option<WorkerRank>;
    /// The commit succeeded with `state`.
    fn bound(&mut self, choice: &mut Self::Choice, state: Option<BindingState>);
    /// The choice will not be used (its commit lost a race or failed): undo what choosing did.
    fn withdraw(&mut self, choice: Self::Choice);
}

/// Chooses for a request in `session` and commits its binding. `pinned`: the request names its
/// worker, so a racing router's binding is not adopted over the pin. `registered` says whether
/// a rank is still registered for the request's model and role.
pub async fn choose_in_session<S: SessionStore, C: Chooser>(
    table: &SessionTable<S>,
    session: &SessionContext,
    pinned: bool,
    registered: &(dyn Fn(WorkerRank) -> bool + Sync),
    now_ms: u64,
    chooser: &mut C,
) -> Result<C::Choice, C::Error> {
    let mut lookup = table.lookup(session, registered, now_ms).await?;
    let mut route = lookup.route(table.config().mode);
    for _ in 0..MAX_COMMIT_ATTEMPTS {
        let mut choice = chooser.choose(route)?;
        let Some(worker) = chooser.worker(&choice) else {
            return Ok(choice);
        };
        match table.commit(&lookup, worker, registered, now_ms).await {
            Ok(CommitOutcome::Committed(state)) => {
                chooser.bound(&mut choice, state);
                return Ok(choice);
            }
            Ok(CommitOutcome::Conflict(fresh)) => {
                chooser.withdraw(choice);
                route = match fresh.status() {
                    BindingStatus::Live(winner) if !pinned => {
                        SessionRoute::Exact(WorkerTarget::exact(winner))
                    }
                    _ => fresh.route(table.config().mode),
                };
                lookup = fresh;
            }
            Err(e) => {
                chooser.withdraw(choice);
                return Err(e.into());
            }
        }
    }
    Err(SessionError::Contention {
        session: session.id.clone(),
    }
    .into())
}
