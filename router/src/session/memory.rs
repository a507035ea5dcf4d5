//! An in-memory [`SessionStore`] with the same conditional-write semantics as the KV bucket.
//! For tests and single-process use; it has no TTL of its own (the table checks idleness).

use std::collections::HashMap;
use std::sync::Mutex;

use super::binding::{Revision, SessionBinding, Versioned};
use super::store::{SessionStore, SessionWrite, StoreError, WriteOutcome};

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

impl MemSessionStore {
    /// What [`SessionStore::get`] answers, at once.
    pub fn get_now(&self, session: &str) -> Option<Versioned> {
        self.lock().entries.get(session).copied()
    }

    /// What [`super::store::write`] answers, at once.
    pub fn write_now(&self, session: &str, op: SessionWrite) -> WriteOutcome {
        let mut inner = self.lock();
        match op {
            SessionWrite::Create(binding) => {
                if inner.entries.contains_key(session) {
                    return WriteOutcome::Conflict;
                }
                Self::write(&mut inner, session, binding)
            }
            SessionWrite::Update(binding, revision) => match inner.entries.get(session) {
                Some(current) if current.revision == revision => {
                    Self::write(&mut inner, session, binding)
                }
                _ => WriteOutcome::Conflict,
            },
            SessionWrite::Delete => {
                inner.entries.remove(session);
                WriteOutcome::Written(0)
            }
        }
    }
}

impl SessionStore for MemSessionStore {
    async fn get(&self, session: &str) -> Result<Option<Versioned>, StoreError> {
        Ok(self.get_now(session))
    }

    async fn create(
        &self,
        session: &str,
        binding: &SessionBinding,
    ) -> Result<WriteOutcome, StoreError> {
        Ok(self.write_now(session, SessionWrite::Create(*binding)))
    }

    async fn update(
        &self,
        session: &str,
        binding: &SessionBinding,
        revision: Revision,
    ) -> Result<WriteOutcome, StoreError> {
        Ok(self.write_now(session, SessionWrite::Update(*binding, revision)))
    }

    async fn delete(&self, session: &str) -> Result<(), StoreError> {
        self.write_now(session, SessionWrite::Delete);
        Ok(())
    }
}
