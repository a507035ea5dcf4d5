//! A minimal simulated worker for indexer and router tests: a set of single-block prompts it
//! "holds", published through the real worker-side library, and the index those blocks should
//! produce, so tests can compare replicas with the truth.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_common::Names;
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock, WorkerCard, WorkerRole};
use kvroute_common::worker::{
    EventPublisher, PublisherConfig, RegistrationConfig, ResyncSource, WorkerAgent,
    WorkerAgentConfig,
};
use kvroute_indexer::index::{IndexConfig, RadixIndex};
use rand::Rng;

use crate::servers::TestEnv;

#[derive(Default)]
struct Held(Mutex<BTreeSet<u64>>);

impl ResyncSource for Held {
    fn resync(&self, publisher: &EventPublisher) {
        let held = self.0.lock().expect("held lock");
        let mut events = vec![KvEventData::Cleared];
        events.extend(held.iter().map(|h| stored(*h)));
        publisher.publish(0, events);
    }
}

/// One block stored as the whole prompt (its own root), named by `h` in both hash spaces.
pub fn stored(h: u64) -> KvEventData {
    KvEventData::Stored {
        parent_hash: None,
        blocks: vec![StoredBlock {
            block_hash: h,
            tokens_hash: h,
        }],
        tier: StorageTier::Device,
    }
}

/// A worker whose cache is a set of single-block prompts.
pub struct SimWorker {
    pub worker_id: u64,
    agent: Option<WorkerAgent>,
    held: Arc<Held>,
}

impl std::fmt::Debug for SimWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimWorker")
            .field("worker_id", &self.worker_id)
            .finish()
    }
}

/// The card a simulated worker registers.
pub fn sim_card(names: &Names, worker_id: u64, model: &str) -> WorkerCard {
    WorkerCard {
        v: Default::default(),
        worker_id,
        model: model.into(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        total_kv_blocks: 10_000,
        max_num_batched_tokens: 8192,
        dp_start_rank: 0,
        dp_size: 1,
        taints: vec![],
        labels: Default::default(),
        request_subject: names.worker_requests(worker_id),
        software_version: "sim".into(),
        http_url: None,
        kv_events: true,
        lora_adapters: None,
    }
}

impl SimWorker {
    /// Registers (lease TTL `ttl_secs`) and publishes `Cleared` as event 0.
    pub async fn start(
        env: &TestEnv,
        worker_id: u64,
        model: &str,
        ttl_secs: u64,
    ) -> anyhow::Result<Self> {
        Self::start_as(env, None, worker_id, model, ttl_secs).await
    }

    /// [`SimWorker::start`] connecting as `identity` of a secure environment (`None`: the
    /// servers' plain settings).
    pub async fn start_as(
        env: &TestEnv,
        identity: Option<&str>,
        worker_id: u64,
        model: &str,
        ttl_secs: u64,
    ) -> anyhow::Result<Self> {
        let names = Names::new(&env.namespace);
        let (nats, etcd) = match identity {
            Some(user) => (
                env.nats_args_as(user).connect("kvroute-test").await?,
                env.etcd_args_as(user).connect().await?,
            ),
            None => (env.nats.connect().await?, env.etcd.connect().await?),
        };
        let held = Arc::new(Held::default());
        let config = WorkerAgentConfig {
            registration: RegistrationConfig {
                lease_ttl: Duration::from_secs(ttl_secs),
                retry_interval: Duration::from_millis(100),
            },
            publisher: PublisherConfig {
                ack_timeout: Duration::from_millis(500),
                retry_interval: Duration::from_millis(100),
                ..Default::default()
            },
        };
        let mut agent = WorkerAgent::start(
            nats,
            etcd,
            &names,
            sim_card(&names, worker_id, model),
            config,
            held.clone(),
        )
        .await?;
        agent.wait_registered().await;
        Ok(Self {
            worker_id,
            agent: Some(agent),
            held,
        })
    }

    fn agent(&self) -> &WorkerAgent {
        self.agent.as_ref().expect("worker is running")
    }

    pub fn store(&self, hashes: &[u64]) {
        let mut held = self.held.0.lock().expect("held lock");
        let new: Vec<u64> = hashes.iter().copied().filter(|h| held.insert(*h)).collect();
        self.agent()
            .publish_events(0, new.into_iter().map(stored).collect());
    }

    pub fn remove(&self, hashes: &[u64]) {
        let mut held = self.held.0.lock().expect("held lock");
        let gone: Vec<u64> = hashes.iter().copied().filter(|h| held.remove(h)).collect();
        if !gone.is_empty() {
            self.agent().publish_events(
                0,
                vec![KvEventData::Removed {
                    block_hashes: gone,
                    tier: StorageTier::Device,
                }],
            );
        }
    }

    /// Evicts `hashes` but "loses" the event (its id is consumed, nothing is published).
    pub fn remove_and_lose_event(&self, hashes: &[u64]) {
        let mut held = self.held.0.lock().expect("held lock");
        for h in hashes {
            held.remove(h);
        }
        self.agent().publisher().skip_event_ids(0, 1);
    }

    /// `ops` random stores and removals over hashes `1..=universe`.
    pub fn churn(&self, rng: &mut impl Rng, ops: usize, universe: u64) {
        for _ in 0..ops {
            let h = rng.random_range(1..=universe);
            if rng.random_bool(0.6) {
                self.store(&[h]);
            } else {
                self.remove(&[h]);
            }
        }
    }

    /// The next event id this worker will assign (without publishing anything).
    pub fn next_event_id(&self) -> u64 {
        self.agent().publisher().publish(0, Vec::new())
    }

    pub fn held(&self) -> BTreeSet<u64> {
        self.held.0.lock().expect("held lock").clone()
    }

    /// Waits until every event published so far is acknowledged by JetStream.
    pub async fn flush(&self) {
        self.agent().publisher().flush().await;
    }

    /// Deregisters (the card disappears at once).
    pub async fn shutdown(&mut self) {
        if let Some(agent) = self.agent.take() {
            agent.shutdown().await;
        }
    }

    /// Crashes: stops keeping the lease alive (the card expires with its TTL).
    pub fn crash(&mut self) {
        if let Some(agent) = self.agent.take() {
            agent.abandon();
        }
    }
}

/// The index the given workers' current blocks should produce.
pub fn expected_index(workers: &[&SimWorker]) -> RadixIndex {
    let mut index = RadixIndex::new(IndexConfig::default());
    for w in workers {
        for h in w.held() {
            index
                .apply(w.worker_id, 0, &stored(h))
                .expect("valid store");
        }
    }
    index
}
