//! The retry rule for requests to a replicated service, pure: how long each attempt waits and
//! where it goes. The first attempt goes to the queue group (any replica); a retry goes to the
//! replica that answered most recently, unless that replica already failed this request —
//! a stalled member then costs one attempt timeout instead of a coin toss per retry.

use std::time::Duration;

/// How many attempts, and how long each waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, at least 1.
    pub attempts: u32,
    /// The first attempt's timeout; each later one doubles, up to `max_timeout`.
    pub first_timeout: Duration,
    pub max_timeout: Duration,
    /// Pause before the next attempt when nobody is in the group (replicas restarting or
    /// stepping out); bounded by the remaining attempts' time.
    pub no_responders_backoff: Duration,
    /// Added to every attempt's timeout: how long the service may hold the request before it
    /// answers (a router's admission queue). Zero for services that answer at once.
    pub queue_wait: Duration,
}

/// A setting of [`RetryPolicy`] that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetryPolicyError {
    #[error("attempts must be at least 1")]
    NoAttempts,
    #[error("the attempt timeout must be above 0")]
    ZeroTimeout,
    #[error("the longest attempt timeout must be at least the first")]
    MaxBelowFirst,
}

impl RetryPolicy {
    /// kvroute's recommendation for selections (PROTOCOL.md): 4 attempts of 250, 500, 1000
    /// and 2000 ms.
    pub const SELECT: RetryPolicy = RetryPolicy {
        attempts: 4,
        first_timeout: Duration::from_millis(250),
        max_timeout: Duration::from_millis(2000),
        no_responders_backoff: Duration::from_millis(100),
        queue_wait: Duration::ZERO,
    };

    /// `attempts` attempts sharing `budget` equally (no growth): for a request whose total
    /// wait is fixed, such as a router's overlap query.
    pub fn split(budget: Duration, attempts: u32) -> Self {
        let attempts = attempts.max(1);
        let each = budget / attempts;
        Self {
            attempts,
            first_timeout: each,
            max_timeout: each,
            no_responders_backoff: Duration::ZERO,
            queue_wait: Duration::ZERO,
        }
    }

    pub fn validate(&self) -> Result<(), RetryPolicyError> {
        if self.attempts == 0 {
            return Err(RetryPolicyError::NoAttempts);
        }
        if self.first_timeout.is_zero() {
            return Err(RetryPolicyError::ZeroTimeout);
        }
        if self.max_timeout < self.first_timeout {
            return Err(RetryPolicyError::MaxBelowFirst);
        }
        Ok(())
    }

    /// The timeout of attempt `attempt` (0-based): the doubling part plus `queue_wait`.
    pub fn timeout(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.first_timeout
            .saturating_mul(factor)
            .min(self.max_timeout)
            .saturating_add(self.queue_wait)
    }

    /// The longest a request can wait in all (without no-responder pauses).
    pub fn budget(&self) -> Duration {
        (0..self.attempts).map(|a| self.timeout(a)).sum()
    }
}

/// Where one attempt goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'a> {
    /// The queue group: whichever replica the server picks.
    Group,
    /// One replica, on its direct subject.
    Replica(&'a str),
}

/// Attempt `attempt` goes to the group when it is the first, or when no replica is known to
/// have answered recently, or when that replica already failed this request (`failed`);
/// otherwise to that replica.
pub fn target<'a>(attempt: u32, last_good: Option<&'a str>, failed: &[String]) -> Target<'a> {
    match last_good {
        Some(id) if attempt > 0 && !failed.iter().any(|f| f == id) => Target::Replica(id),
        _ => Target::Group,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_double_up_to_the_maximum() {
        let p = RetryPolicy::SELECT;
        let ms: Vec<u128> = (0..6).map(|a| p.timeout(a).as_millis()).collect();
        assert_eq!(ms, [250, 500, 1000, 2000, 2000, 2000]);
        assert_eq!(p.budget(), Duration::from_millis(3750));
        assert_eq!(p.timeout(u32::MAX), Duration::from_millis(2000));
        assert!(p.validate().is_ok());
        let queued = RetryPolicy {
            queue_wait: Duration::from_secs(10),
            ..p
        };
        assert_eq!(queued.timeout(0), Duration::from_millis(10_250));
        assert_eq!(queued.timeout(5), Duration::from_millis(12_000));
    }

    #[test]
    fn a_split_budget_has_equal_attempts() {
        let p = RetryPolicy::split(Duration::from_millis(50), 2);
        assert_eq!(p.timeout(0), Duration::from_millis(25));
        assert_eq!(p.timeout(1), Duration::from_millis(25));
        assert_eq!(p.budget(), Duration::from_millis(50));
        assert_eq!(RetryPolicy::split(Duration::from_millis(50), 0).attempts, 1);
    }

    #[test]
    fn bad_policies_are_refused() {
        let mut p = RetryPolicy::SELECT;
        p.attempts = 0;
        assert_eq!(p.validate(), Err(RetryPolicyError::NoAttempts));
        let mut p = RetryPolicy::SELECT;
        p.first_timeout = Duration::ZERO;
        assert_eq!(p.validate(), Err(RetryPolicyError::ZeroTimeout));
        let mut p = RetryPolicy::SELECT;
        p.max_timeout = Duration::from_millis(10);
        assert_eq!(p.validate(), Err(RetryPolicyError::MaxBelowFirst));
    }

    #[test]
    fn retries_go_to_the_last_good_replica_unless_it_failed_this_request() {
        assert_eq!(target(0, Some("a"), &[]), Target::Group);
        assert_eq!(target(1, Some("a"), &[]), Target::Replica("a"));
        assert_eq!(target(1, None, &[]), Target::Group);
        assert_eq!(target(2, Some("a"), &["a".into()]), Target::Group);
        assert_eq!(target(2, Some("b"), &["a".into()]), Target::Replica("b"));
    }
}
