//! The storage boundary of the session table: get, create-if-absent, compare-and-swap by
//! revision, delete. The service implements it over a JetStream KV bucket; tests use
//! [`super::MemSessionStore`].

use std::future::Future;

use super::binding::{Revision, SessionBinding, Versioned};

/// A write to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionWrite {
    /// Create the key only if it is absent.
    Create(SessionBinding),
    /// Write only if the key's revision is still this one.
    Update(SessionBinding, Revision),
    /// Remove the key (a final request).
    Delete,
}

/// The result of a conditional write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written(Revision),
    /// The key exists (create) or has another revision (update): nothing was written.
    Conflict,
}

/// The store failed (unreachable, timed out, undecodable value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("session store: {message}")]
pub struct StoreError {
    pub message: String,
}

impl StoreError {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// Where session bindings live, keyed by session id.
pub trait SessionStore: Send + Sync {
    fn get(
        &self,
        session: &str,
    ) -> impl Future<Output = Result<Option<Versioned>, StoreError>> + Send;

    /// Writes only if the key is absent (or deleted).
    fn create(
        &self,
        session: &str,
        binding: &SessionBinding,
    ) -> impl Future<Output = Result<WriteOutcome, StoreError>> + Send;

    /// Writes only if the key's current revision is `revision`.
    fn update(
        &self,
        session: &str,
        binding: &SessionBinding,
        revision: Revision,
    ) -> impl Future<Output = Result<WriteOutcome, StoreError>> + Send;

    /// Removes the key; absent is fine.
    fn delete(&self, session: &str) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// Runs `op` on `store` for `key` (a delete always counts as written).
pub async fn write<S: SessionStore>(
    store: &S,
    key: &str,
    op: SessionWrite,
) -> Result<WriteOutcome, StoreError> {
    match op {
        SessionWrite::Create(binding) => store.create(key, &binding).await,
        SessionWrite::Update(binding, revision) => store.update(key, &binding, revision).await,
        SessionWrite::Delete => store.delete(key).await.map(|()| WriteOutcome::Written(0)),
    }
}
