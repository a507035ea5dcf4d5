//! Index snapshots in the NATS object store `KVROUTE_<ns>_SNAPSHOTS`, one object per snapshot,
//! named by the stream sequence it includes (`snapshot-<seq, 20 digits>`).

use async_nats::jetstream::{self, object_store};
use futures::StreamExt;
use kvroute_common::jetstream::JetStreamError;
use kvroute_common::names::{Names, snapshot_object, snapshot_seq};
use kvroute_common::ops::exit::describe;
use tokio::io::AsyncReadExt;

/// The snapshot bucket.
#[derive(Clone)]
pub struct SnapshotStore {
    store: object_store::ObjectStore,
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore").finish_non_exhaustive()
    }
}

impl SnapshotStore {
    /// Opens the bucket, creating it if absent (`replicas` as the events stream: a refused
    /// creation names `--stream-replicas` and keeps the server's cause).
    pub async fn open(
        js: &jetstream::Context,
        names: &Names,
        replicas: usize,
    ) -> Result<Self, JetStreamError> {
        let bucket = names.snapshots_bucket();
        let store = match js.get_object_store(&bucket).await {
            Ok(s) => s,
            Err(_) => match js
                .create_object_store(object_store::Config {
                    bucket: bucket.clone(),
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
            {
                Ok(s) => s,
                // Another replica may have created it meanwhile.
                Err(refused) => match js.get_object_store(&bucket).await {
                    Ok(s) => s,
                    Err(_) => {
                        return Err(JetStreamError::Refused {
                            setting: format!("--stream-replicas {replicas}"),
                            what: format!("object store {bucket}"),
                            cause: describe(&refused),
                        });
                    }
                },
            },
        };
        Ok(Self { store })
    }

    /// Opens the bucket if it exists (followers read snapshots, never create the bucket).
    pub async fn existing(js: &jetstream::Context, names: &Names) -> Option<Self> {
        let store = js.get_object_store(names.snapshots_bucket()).await.ok()?;
        Some(Self { store })
    }

    /// Sequences of the stored snapshots, newest first.
    pub async fn list(&self) -> anyhow::Result<Vec<u64>> {
        let mut out = Vec::new();
        let mut list = self.store.list().await?;
        while let Some(info) = list.next().await {
            let info = info?;
            if !info.deleted
                && let Some(seq) = snapshot_seq(&info.name)
            {
                out.push(seq);
            }
        }
        out.sort_unstable_by(|a, b| b.cmp(a));
        Ok(out)
    }

    pub async fn load(&self, seq: u64) -> anyhow::Result<Vec<u8>> {
        let mut object = self.store.get(snapshot_object(seq)).await?;
        let mut bytes = Vec::new();
        object.read_to_end(&mut bytes).await?;
        Ok(bytes)
    }

    pub async fn save(&self, seq: u64, bytes: Vec<u8>) -> anyhow::Result<()> {
        let mut reader = std::io::Cursor::new(bytes);
        self.store
            .put(snapshot_object(seq).as_str(), &mut reader)
            .await?;
        Ok(())
    }

    /// Deletes all but the newest `keep` snapshots; returns the kept sequences (newest first).
    pub async fn prune(&self, keep: usize) -> anyhow::Result<Vec<u64>> {
        let all = self.list().await?;
        for seq in all.iter().skip(keep) {
            self.store.delete(snapshot_object(*seq)).await?;
        }
        Ok(all.into_iter().take(keep).collect())
    }
}
