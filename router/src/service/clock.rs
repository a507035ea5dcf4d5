//! The request's clock: the one place the selection path reads the wall and monotonic clocks
//! (the pure core takes `now_ms` as an argument).
#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: stamps each request with the clock at intake"
)]

use std::time::Instant;

use kvroute_common::messages::{SelectRequest, now_ms};

/// The request's clock: one wall-clock reading at intake, advanced by the monotonic clock.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock {
    pub(super) wall_ms: u64,
    at: Instant,
}

impl Clock {
    pub(super) fn now() -> Self {
        Self {
            wall_ms: now_ms(),
            at: Instant::now(),
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.wall_ms + u64::try_from(self.at.elapsed().as_millis()).unwrap_or(u64::MAX / 2)
    }

    /// Time since the reading at intake.
    pub(super) fn elapsed(&self) -> std::time::Duration {
        self.at.elapsed()
    }

    pub(super) fn expired(&self, request: &SelectRequest) -> bool {
        request.deadline_ms.is_some_and(|d| self.now_ms() > d)
    }
}
