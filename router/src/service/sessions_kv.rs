//! The session table's store over the JetStream KV bucket `KVROUTE_<ns>_SESSIONS`, shared by
//! every router replica: create-if-absent for a first binding, update by revision afterwards
//! (a wrong revision is a `Conflict`, never an overwrite). The bucket's max age is the idle
//! TTL, so an unused binding disappears by itself.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use kvroute_common::codec::{decode, encode};
use kvroute_common::jetstream::JetStreamError;
use kvroute_common::messages::{SchemaVersion, SessionBindingRecord};
use kvroute_common::names::Names;
use kvroute_common::ops::exit::describe;

use crate::session::{Revision, SessionBinding, SessionStore, StoreError, Versioned, WriteOutcome};

/// Bucket settings.
#[derive(Debug, Clone, Copy)]
pub struct BucketConfig {
    /// Bindings unused for this long expire (the bucket's max age).
    pub idle_ttl: Duration,
    pub replicas: usize,
}

/// Session bindings in the KV bucket.
#[derive(Clone)]
pub struct KvSessionStore {
    kv: kv::Store,
    names: Names,
}

impl std::fmt::Debug for KvSessionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvSessionStore")
            .field("bucket", &self.names.sessions_bucket())
            .finish_non_exhaustive()
    }
}

impl KvSessionStore {
    /// Opens the bucket, creating it if absent (an existing bucket is used as it is). A
    /// refused creation names `--session-bucket-replicas` and keeps the server's cause.
    pub async fn open(
        js: &jetstream::Context,
        names: &Names,
        config: BucketConfig,
    ) -> Result<Self, JetStreamError> {
        let bucket = names.sessions_bucket();
        let kv = match js.get_key_value(&bucket).await {
            Ok(kv) => kv,
            Err(_) => {
                let created = js
                    .create_key_value(kv::Config {
                        bucket: bucket.clone(),
                        description: "kvroute session bindings".into(),
                        history: 1,
                        max_age: config.idle_ttl,
                        num_replicas: config.replicas,
                        max_value_size: SessionBindingRecord::MAX_BYTES as i32,
                        ..Default::default()
                    })
                    .await;
                match created {
                    Ok(kv) => kv,
                    // Another replica may have created it meanwhile.
                    Err(refused) => match js.get_key_value(&bucket).await {
                        Ok(kv) => kv,
                        Err(_) => {
                            return Err(JetStreamError::Refused {
                                setting: format!("--session-bucket-replicas {}", config.replicas),
                                what: format!("bucket {bucket}"),
                                cause: describe(&refused),
                            });
                        }
                    },
                }
            }
        };
        Ok(Self {
            kv,
            names: names.clone(),
        })
    }

    fn value(binding: &SessionBinding) -> Result<bytes::Bytes, StoreError> {
        let record = SessionBindingRecord {
            v: SchemaVersion::CURRENT,
            worker_id: binding.worker_id,
            dp_rank: binding.dp_rank,
            last_used_ms: binding.last_used_ms,
        };
        encode(&record).map_err(|e| StoreError::new(e.to_string()))
    }
}

use kvroute_common::codec::WireMessage as _;

impl SessionStore for KvSessionStore {
    async fn get(&self, session: &str) -> Result<Option<Versioned>, StoreError> {
        let entry = self
            .kv
            .entry(self.names.session_key(session))
            .await
            .map_err(|e| StoreError::new(e.to_string()))?;
        let Some(entry) = entry else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let record: SessionBindingRecord =
            decode(&entry.value).map_err(|e| StoreError::new(e.to_string()))?;
        Ok(Some(Versioned {
            binding: SessionBinding {
                worker_id: record.worker_id,
                dp_rank: record.dp_rank,
                last_used_ms: record.last_used_ms,
            },
            revision: entry.revision,
        }))
    }

    async fn create(
        &self,
        session: &str,
        binding: &SessionBinding,
    ) -> Result<WriteOutcome, StoreError> {
        let value = Self::value(binding)?;
        match self.kv.create(self.names.session_key(session), value).await {
            Ok(revision) => Ok(WriteOutcome::Written(revision)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(WriteOutcome::Conflict),
            Err(e) => Err(StoreError::new(e.to_string())),
        }
    }

    async fn update(
        &self,
        session: &str,
        binding: &SessionBinding,
        revision: Revision,
    ) -> Result<WriteOutcome, StoreError> {
        let value = Self::value(binding)?;
        match self
            .kv
            .update(self.names.session_key(session), value, revision)
            .await
        {
            Ok(revision) => Ok(WriteOutcome::Written(revision)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Ok(WriteOutcome::Conflict)
            }
            Err(e) => Err(StoreError::new(e.to_string())),
        }
    }

    async fn delete(&self, session: &str) -> Result<(), StoreError> {
        self.kv
            .delete(self.names.session_key(session))
            .await
            .map_err(|e| StoreError::new(e.to_string()))
    }
}
