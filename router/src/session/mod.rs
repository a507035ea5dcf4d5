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
pub use flow::{AfterChoice, AfterWrite, MAX_COMMIT_ATTEMPTS, SessionFlow};
pub use memory::MemSessionStore;
pub use store::{SessionStore, SessionWrite, StoreError, WriteOutcome, write};
pub use table::{
    BindingStatus, CommitPlan, SessionError, SessionLookup, SessionRoute, SessionTable,
};
