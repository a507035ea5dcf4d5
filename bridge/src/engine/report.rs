//! What an engine's tasks publish on NATS: load reports, lifecycle events and replies. Not the
//! `WorkerAgent` itself, so a request still running when the agent is shut down can finish
//! and report.

use async_nats::Subject;
use kvroute_common::codec::encode;
use kvroute_common::messages::{GenerateResponse, RequestLifecycle, WorkerLoad};
use kvroute_common::{Names, WorkerId};

/// Publishes for one worker.
#[derive(Debug, Clone)]
pub struct Reporter {
    nats: async_nats::Client,
    names: Names,
    worker_id: WorkerId,
}

impl Reporter {
    pub fn new(nats: async_nats::Client, names: Names, worker_id: WorkerId) -> Self {
        Self {
            nats,
            names,
            worker_id,
        }
    }

    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    pub async fn load(&self, load: &WorkerLoad) -> anyhow::Result<()> {
        self.nats
            .publish(self.names.load(self.worker_id), encode(load)?)
            .await?;
        Ok(())
    }

    pub async fn lifecycle(&self, event: &RequestLifecycle) -> anyhow::Result<()> {
        self.nats
            .publish(self.names.lifecycle(self.worker_id), encode(event)?)
            .await?;
        Ok(())
    }

    pub async fn reply(&self, to: Subject, response: &GenerateResponse) -> anyhow::Result<()> {
        self.nats.publish(to, encode(response)?).await?;
        Ok(())
    }
}
