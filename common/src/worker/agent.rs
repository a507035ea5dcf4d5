//! A worker's whole presence in kvroute: registration, event publishing, the resync responder,
//! and load / lifecycle reports.

use std::sync::Arc;

use async_nats::jetstream;
use futures::StreamExt;
use tokio::task::JoinHandle;

use super::publisher::{EventPublisher, PublisherConfig};
use super::registration::{Registration, RegistrationConfig};
use crate::codec::encode;
use crate::ids::DpRank;
use crate::messages::{KvEventData, RequestLifecycle, WorkerCard, WorkerLoad};
use crate::names::Names;

/// Answers a resync request: publish `Cleared` and then the worker's full current cache state.
///
/// Implementations must take the same lock under which they publish ordinary events, so the
/// state they publish is exactly the state at that point of the event stream.
pub trait ResyncSource: Send + Sync + 'static {
    fn resync(&self, publisher: &EventPublisher);
}

/// Settings of a [`WorkerAgent`].
#[derive(Debug, Clone, Default)]
pub struct WorkerAgentConfig {
    pub registration: RegistrationConfig,
    pub publisher: PublisherConfig,
}

/// A running worker presence. [`WorkerAgent::shutdown`] deregisters cleanly.
#[derive(Debug)]
pub struct WorkerAgent {
    card: WorkerCard,
    names: Names,
    nats: async_nats::Client,
    publisher: EventPublisher,
    registration: Option<Registration>,
    resync_task: JoinHandle<()>,
}

impl WorkerAgent {
    /// Starts publishing (every rank begins with `Cleared` as event 0, announcing a fresh
    /// cache), the resync responder, and the registration in etcd. A worker whose card says
    /// `kv_events: false` publishes no events: no `Cleared`, and a resync is answered without.
    pub async fn start(
        nats: async_nats::Client,
        etcd: etcd_client::Client,
        names: &Names,
        card: WorkerCard,
        config: WorkerAgentConfig,
        resync: Arc<dyn ResyncSource>,
    ) -> anyhow::Result<Self> {
        let js = jetstream::new(nats.clone());
        let publisher = EventPublisher::start(js, names, card.worker_id, config.publisher);
        for rank in card.dp_ranks().filter(|_| card.kv_events) {
            publisher.publish(rank, vec![KvEventData::Cleared]);
        }
        let kv_events = card.kv_events;
        let mut requests = nats.subscribe(names.worker_resync(card.worker_id)).await?;
        let resync_task = {
            let publisher = publisher.clone();
            let nats = nats.clone();
            let worker_id = card.worker_id;
            tokio::spawn(async move {
                while let Some(msg) = requests.next().await {
                    tracing::info!(worker_id, "resync requested");
                    if kv_events {
                        resync.resync(&publisher);
                        publisher.flush().await;
                    }
                    if let Some(reply) = msg.reply {
                        let _ = nats.publish(reply, "ok".into()).await;
                    }
                }
            })
        };
        let registration = Registration::start(etcd, names, card.clone(), config.registration)?;
        Ok(Self {
            card,
            names: names.clone(),
            nats,
            publisher,
            registration: Some(registration),
            resync_task,
        })
    }

    pub fn card(&self) -> &WorkerCard {
        &self.card
    }

    /// Replaces the registered card (the same worker: its id, ranks and event setting are
    /// kept), written under the live lease; e.g. the LoRA adapters the engine serves changed.
    pub fn update_card(&mut self, card: WorkerCard) -> anyhow::Result<()> {
        anyhow::ensure!(
            card.worker_id == self.card.worker_id
                && card.dp_start_rank == self.card.dp_start_rank
                && card.dp_size == self.card.dp_size
                && card.kv_events == self.card.kv_events,
            "a card update may not change the worker's id, ranks or KV event setting"
        );
        card.validate()?;
        if let Some(r) = &self.registration {
            r.update(&card)?;
        }
        self.card = card;
        Ok(())
    }

    pub fn publisher(&self) -> &EventPublisher {
        &self.publisher
    }

    /// Queues KV events of rank `dp_rank` (see [`EventPublisher::publish`]).
    pub fn publish_events(&self, dp_rank: DpRank, events: Vec<KvEventData>) -> u64 {
        self.publisher.publish(dp_rank, events)
    }

    /// Waits until the card is in etcd.
    pub async fn wait_registered(&mut self) {
        if let Some(r) = self.registration.as_mut() {
            r.wait_registered().await;
        }
    }

    pub fn is_registered(&self) -> bool {
        self.registration
            .as_ref()
            .is_some_and(Registration::is_registered)
    }

    pub async fn publish_load(&self, load: &WorkerLoad) -> anyhow::Result<()> {
        self.nats
            .publish(self.names.load(self.card.worker_id), encode(load)?)
            .await?;
        Ok(())
    }

    pub async fn publish_lifecycle(&self, event: &RequestLifecycle) -> anyhow::Result<()> {
        self.nats
            .publish(self.names.lifecycle(self.card.worker_id), encode(event)?)
            .await?;
        Ok(())
    }

    /// Flushes queued events, stops answering resyncs, and revokes the lease (the card
    /// disappears at once).
    pub async fn shutdown(mut self) {
        self.publisher.flush().await;
        self.resync_task.abort();
        if let Some(r) = self.registration.take() {
            r.deregister().await;
        }
    }

    /// Simulates a crash for tests and fault drills: stops everything without deregistering
    /// (the card stays until its lease expires).
    pub fn abandon(mut self) {
        self.resync_task.abort();
        if let Some(r) = self.registration.take() {
            r.abandon();
        }
    }
}
