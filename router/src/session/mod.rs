//! Session affinity: bindings of sessions to ranks, their idle TTL and invalidation, behind a
//! small storage trait. Pure logic; the store is the only boundary.

mod binding;
mod flow;
mod memory;
mod store;
mod table;
#[cfg(test)]
mod tests;

pub use binding::{
    AffinityMode, InvalidSessionConfig, Revision, SessionBinding, SessionConfig, Versioned,
};
pub use flow::{Chooser, MAX_COMMIT_ATTEMPTS, choose_in_session};
pub use memory::MemSessionStore;
pub use store::{SessionStore, StoreError, WriteOutcome};
pub use table::{
    BindingStatus, CommitOutcome, SessionError, SessionLookup, SessionRoute, SessionTable,
};
