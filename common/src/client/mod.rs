//! Clients of kvroute's replicated services — the routers' select group and the indexers'
//! query group. A member that stalls keeps receiving its share of a queue group's requests
//! until the NATS server drops its connection, so every request here carries a per-attempt
//! deadline (a member that picks it up late drops it), is retried under the same identity when
//! no answer comes in time, and a retry goes to the replica that answered most recently.

mod group;
mod retry;
mod select;

pub use group::{Answered, GroupClient, GroupError, Judged};
pub use retry::{RetryPolicy, RetryPolicyError, Target, target};
pub use select::{SelectCallFailure, SelectClient, SelectRetryArgs, Selected};
