//! An in-memory [`SessionStore`] with the same conditional-write semantics as the KV bucket.
//! For tests and single-process use; it has no TTL of its own (the table checks idleness).

use std::collections::HashMap;
use std::sync::Mutex;

use super::binding::{Revision, SessionBinding, Versioned};
use super::store::{SessionStore, StoreError, WriteOutcome};

#[derive(Debug, Default)]
pub struct MemSessionStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Versioned>,
    last_revision: Revision,
}

impl MemSessionStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bindings currently stored.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave `Inner` half-updated: recover it.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(inner: &mut Inner, session: &str, binding: SessionBinding) -> WriteOutcome {
        inner.last_revision += 1;
        let revision = inner.last_revision;
        inner
            .entries
            .insert(session.to_owned(), Versioned { binding, revision });
        WriteOutcome::Written(revision)
    }
}

impl SessionStore for MemSessionStore {
    async fn get(&self, session: &str) -> Result<Option<Versioned>, StoreError> {
        Ok(self.lock().entries.get(session).copied())
    }

    async fn create(
        &self,
        session: &str,
        binding: &SessionBinding,
    ) -> Result<WriteOutcome, StoreError> {
        let mut inner = self.lock();
        if inner.entries.contains_key(session) {
            return Ok(WriteOutcome::Conflict);
        }
        Ok(Self::write(&mut inner, session, *binding))
    }

    async fn update(
        &self,
        session: &str,
        binding: &SessionBinding,
        revision: Revision,
    ) -> Result<WriteOutcome, StoreError> {
        let mut inner = self.lock();
        match inner.entries.get(session) {
            Some(current) if current.revision == revision => {
                Ok(Self::write(&mut inner, session, *binding))
            }
            _ => Ok(WriteOutcome::Conflict),
        }
    }

    async fn delete(&self, session: &str) -> Result<(), StoreError> {
        self.lock().entries.remove(session);
        Ok(())
    }
}
