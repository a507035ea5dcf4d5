//! Runs a [`Selection`] to its end by answering what it needs: [`run`] over the network (the
//! router service's intake and admission dispatcher: the index's overlap and the session
//! bucket), [`now`] from memory at once (`kvroute-sim`, the replay's local selector, tests).

use std::future::Future;

use crate::decide::selection::{Answer, Need, Selection};
use crate::decide::{Decided, DecisionState};
use crate::select::SelectFailure;
use crate::session::{MemSessionStore, SessionStore, write};
use crate::signals::SignalSnapshot;

/// How a selection ended.
#[derive(Debug)]
pub enum Ended {
    /// Every eligible worker is busy: the request joins (or stays in) the admission queue with
    /// this overlap.
    Join(SignalSnapshot),
    /// Reply with this.
    Reply(Result<Decided, SelectFailure>),
}

/// Runs `selection` from `need` (what its start returned): `overlap` fetches the overlap of the
/// selection's prompt, `store` holds the session bindings.
pub async fn run<S: SessionStore, D: DecisionState, F: Future<Output = SignalSnapshot>>(
    mut selection: Selection<'_>,
    mut need: Need,
    state: &mut D,
    store: &S,
    overlap: impl FnOnce() -> F,
) -> Ended {
    let mut overlap = Some(overlap);
    loop {
        let answer = match need {
            Need::Overlap => {
                let fetch = overlap.take().expect("the overlap is needed once");
                Answer::Overlap(fetch().await)
            }
            Need::ReadSession(key) => Answer::Session(store.get(&key).await),
            Need::WriteSession(key, op) => Answer::Written(write(store, &key, op).await),
            Need::Join(overlap) => return Ended::Join(overlap),
            Need::Reply(result) => return Ended::Reply(result),
        };
        need = selection.resume(answer, state);
    }
}

/// [`run`] with answers at hand: the in-memory session store, and `overlap` computed at once.
pub fn now<D: DecisionState>(
    mut selection: Selection<'_>,
    mut need: Need,
    state: &mut D,
    store: &MemSessionStore,
    overlap: impl FnOnce() -> SignalSnapshot,
) -> Ended {
    let mut overlap = Some(overlap);
    loop {
        let answer = match need {
            Need::Overlap => {
                let fetch = overlap.take().expect("the overlap is needed once");
                Answer::Overlap(fetch())
            }
            Need::ReadSession(key) => Answer::Session(Ok(store.get_now(&key))),
            Need::WriteSession(key, op) => Answer::Written(Ok(store.write_now(&key, op))),
            Need::Join(overlap) => return Ended::Join(overlap),
            Need::Reply(result) => return Ended::Reply(result),
        };
        need = selection.resume(answer, state);
    }
}
