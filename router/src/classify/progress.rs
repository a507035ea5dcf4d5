//! A request's progress: the high-water mark of its logical tokens (prompt plus generated).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Monotonic high-water mark of a request's logical tokens (prompt + generated), starting at
/// its input tokens and raised by the host's observations. Clones share one counter, so a
/// retry of the same request lifecycle keeps its progress; a new lifecycle gets a new one,
/// even under a reused request id. It counts tokens, not the KV blocks they occupy.
#[derive(Clone, Debug, Default)]
pub struct Progress(Arc<AtomicU64>);

impl Progress {
    pub fn new(initial: u64) -> Self {
        Self(Arc::new(AtomicU64::new(initial)))
    }

    /// The highest count observed so far.
    pub fn get(&self) -> u64 {
        // A lone monotonic counter: no other memory is published through it.
        self.0.load(Ordering::Relaxed)
    }

    /// Raises the mark to `tokens`; a lower count (a late or reordered observation) is ignored.
    pub fn observe(&self, tokens: u64) {
        self.0.fetch_max(tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_only_rises_and_clones_share_it() {
        let progress = Progress::new(100);
        let retry = progress.clone();
        progress.observe(150);
        progress.observe(120);
        assert_eq!(progress.get(), 150);
        assert_eq!(retry.get(), 150, "a clone sees the same counter");
        retry.observe(400);
        assert_eq!(progress.get(), 400);
        assert_eq!(
            Progress::new(100).get(),
            100,
            "a new lifecycle starts afresh"
        );
    }
}
