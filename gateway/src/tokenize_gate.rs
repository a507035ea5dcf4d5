//! The bound on tokenizing: at most `--max-concurrent-tokenizations` prompts are tokenized at
//! once, at most `--tokenize-queue` more wait for a turn, and beyond that a request is refused
//! at once (503 with `Retry-After`), so a burst of long prompts costs bounded CPU and memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Admits tokenizations.
#[derive(Debug)]
pub struct TokenizeGate {
    turns: Arc<Semaphore>,
    /// Tokenizing or waiting.
    admitted: Arc<AtomicUsize>,
    /// `concurrent + queue`.
    capacity: usize,
}

/// A turn to tokenize; held until dropped.
#[derive(Debug)]
pub struct Turn {
    _permit: OwnedSemaphorePermit,
    admitted: Arc<AtomicUsize>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Every turn is taken and the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// Leaves the count when a waiting request gives up (its client left).
struct Waiting(Option<Arc<AtomicUsize>>);

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            a.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl TokenizeGate {
    pub fn new(concurrent: usize, queue: usize) -> Self {
        Self {
            turns: Arc::new(Semaphore::new(concurrent)),
            admitted: Arc::new(AtomicUsize::new(0)),
            capacity: concurrent + queue,
        }
    }

    /// A turn: at once if one is free, after waiting if the queue has room, else [`Busy`].
    pub async fn enter(&self) -> Result<Turn, Busy> {
        let admitted = self.admitted.fetch_add(1, Ordering::AcqRel);
        let mut waiting = Waiting(Some(self.admitted.clone()));
        if admitted >= self.capacity {
            return Err(Busy);
        }
        let permit = self
            .turns
            .clone()
            .acquire_owned()
            .await
            .expect("the gate's semaphore is never closed");
        let admitted = waiting.0.take().expect("set above");
        Ok(Turn {
            _permit: permit,
            admitted,
        })
    }

    /// Tokenizing or waiting now.
    pub fn admitted(&self) -> usize {
        self.admitted.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn beyond_the_turns_and_the_queue_is_busy() {
        let gate = Arc::new(TokenizeGate::new(1, 1));
        let first = gate.enter().await.expect("a free turn");
        let g = gate.clone();
        let queued = tokio::spawn(async move { g.enter().await.map(|_| ()) });
        while gate.admitted() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            gate.enter().await.unwrap_err(),
            Busy,
            "turn and queue taken"
        );
        assert_eq!(gate.admitted(), 2, "a refusal leaves no trace");
        drop(first);
        queued.await.unwrap().expect("the queued one gets the turn");
        assert_eq!(gate.admitted(), 0);
        gate.enter().await.expect("free again");
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_leaves_the_queue() {
        let gate = Arc::new(TokenizeGate::new(1, 1));
        let _first = gate.enter().await.expect("a free turn");
        let g = gate.clone();
        let waiter = tokio::spawn(async move { g.enter().await.map(|_| ()) });
        while gate.admitted() < 2 {
            tokio::task::yield_now().await;
        }
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(gate.admitted(), 1);
    }
}
