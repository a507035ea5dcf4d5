//! Concurrent selections on one store: two first requests of a session race, exactly one
//! creates the binding and the other adopts its worker.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::executor::block_on;
use kvroute_common::messages::BindingState;

use super::{Harness, in_session, prefix_on};
use crate::session::*;
use crate::testing::cards;

/// Delegates to a shared store, yielding once before each operation so that concurrent
/// selections interleave at every store access.
struct Yielding<'a> {
    store: &'a MemSessionStore,
    creates: &'a AtomicUsize,
}

struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

impl SessionStore for Yielding<'_> {
    async fn get(&self, session: &str) -> Result<Option<Versioned>, StoreError> {
        YieldOnce(false).await;
        self.store.get(session).await
    }
    async fn create(
        &self,
        session: &str,
        binding: &SessionBinding,
    ) -> Result<WriteOutcome, StoreError> {
        YieldOnce(false).await;
        self.creates.fetch_add(1, Ordering::SeqCst);
        self.store.create(session, binding).await
    }
    async fn update(
        &self,
        session: &str,
        binding: &SessionBinding,
        revision: Revision,
    ) -> Result<WriteOutcome, StoreError> {
        YieldOnce(false).await;
        self.store.update(session, binding, revision).await
    }
    async fn delete(&self, session: &str) -> Result<(), StoreError> {
        YieldOnce(false).await;
        self.store.delete(session).await
    }
}

#[test]
fn racing_first_requests_bind_once_and_the_loser_adopts_the_winner() {
    let store = MemSessionStore::new();
    let creates = AtomicUsize::new(0);
    let shared = || Yielding {
        store: &store,
        creates: &creates,
    };
    let workers = cards(3);
    // Two router replicas whose views disagree: A would pick worker 1, B worker 2.
    let mut a = Harness::with_store(shared(), AffinityMode::Hard);
    let mut b = Harness::with_store(shared(), AffinityMode::Soft);
    let (view_a, view_b) = (prefix_on(1), prefix_on(2));
    let request = in_session("s");
    let (ra, rb) = block_on(async {
        futures::join!(
            a.run(&request, &workers, &view_a, 0),
            b.run(&request, &workers, &view_b, 0),
        )
    });
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        creates.load(Ordering::SeqCst),
        2,
        "both saw no binding and raced"
    );
    let states = [ra.binding, rb.binding];
    assert_eq!(
        states
            .iter()
            .filter(|s| **s == Some(BindingState::New))
            .count(),
        1,
        "exactly one creates the binding: {states:?}"
    );
    assert!(states.contains(&Some(BindingState::Kept)), "{states:?}");
    assert_eq!(ra.worker, rb.worker, "the loser adopts the winner's worker");
    assert_eq!(
        block_on(store.get("s"))
            .unwrap()
            .map(|v| v.binding.worker()),
        Some(ra.worker)
    );
}

#[test]
fn the_selection_future_is_send_so_the_service_can_spawn_it() {
    fn assert_send<T: Send>(_: &T) {}
    let mut h = Harness::new(AffinityMode::Hard);
    let workers = cards(1);
    let signals = prefix_on(1);
    let request = in_session("s");
    let future = h.run(&request, &workers, &signals, 0);
    assert_send(&future);
    assert!(block_on(future).is_ok());
    assert!(
        SessionConfig {
            idle_ttl_ms: 0,
            ..SessionConfig::default()
        }
        .validate()
        .is_err()
    );
}
