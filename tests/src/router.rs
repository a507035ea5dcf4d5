//! Router tests' helpers: `kvroute-router` processes, simulated workers built on the
//! worker-side library (they publish the blocks of the prompts they "served", load reports
//! and lifecycle events), and a select client.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvroute_common::codec::{decode, encode};
use kvroute_common::hashing::{local_block_hashes, seed_for_lora, sequence_hashes};
use kvroute_common::messages::{
    KvEventData, LifecycleKind, RequestLifecycle, SchemaVersion, SelectReply, SelectRequest,
    SelectResponse, StorageTier, StoredBlock, WorkerCard, WorkerLoad, WorkerRole,
};
use kvroute_common::worker::{
    EventPublisher, RegistrationConfig, ResyncSource, WorkerAgent, WorkerAgentConfig,
};
use kvroute_common::{Names, RequestId, WorkerId};

use crate::bins::kvroute_bin;
use crate::http::http_get;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::servers::TestEnv;

/// A `kvroute-router` (or another binary embedding the router) against a [`TestEnv`].
#[derive(Debug)]
pub struct RouterProcess {
    pub router_id: String,
    pub http_port: u16,
    spec: Supervised,
    child: Option<ChildGuard>,
}

impl RouterProcess {
    /// Starts `kvroute-router` with `extra` flags and waits until `/readyz` is 200.
    pub fn start(env: &TestEnv, router_id: &str, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_bin(env, "kvroute-router", router_id, extra)
    }

    /// Starts binary `bin` (`kvroute-router` or `kvroute-router-custom`) and waits until it
    /// serves.
    pub fn start_bin(
        env: &TestEnv,
        bin: &str,
        router_id: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let p = Self::spawn_bin(env, bin, router_id, extra)?;
        p.wait_ready()?;
        Ok(p)
    }

    /// Starts `kvroute-router` without waiting for it to be ready.
    pub fn spawn(env: &TestEnv, router_id: &str, extra: &[&str]) -> anyhow::Result<Self> {
        Self::spawn_bin(env, "kvroute-router", router_id, extra)
    }

    fn spawn_bin(
        env: &TestEnv,
        bin: &str,
        router_id: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::spawn_program(env, kvroute_bin("kvroute-router", bin)?, router_id, extra)
    }

    /// Starts the router binary at `program` (e.g. a release build) and waits until it serves.
    pub fn start_program(
        env: &TestEnv,
        program: PathBuf,
        router_id: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let p = Self::spawn_program(env, program, router_id, extra)?;
        p.wait_ready()?;
        Ok(p)
    }

    fn spawn_program(
        env: &TestEnv,
        program: PathBuf,
        router_id: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let http_port = free_port();
        let mut args = env.server_args();
        args.extend([
            "--router-id".into(),
            router_id.into(),
            "--http-addr".into(),
            format!("127.0.0.1:{http_port}"),
            "--seed".into(),
            "7".into(),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = env.nats.data_dir().join(format!("router-{router_id}.log"));
        let mut spec = Supervised::new(program, args, log);
        spec.env.push(("RUST_LOG".into(), "info".into()));
        let child = Some(spec.spawn()?);
        Ok(Self {
            router_id: router_id.into(),
            http_port,
            spec,
            child,
        })
    }

    fn wait_ready(&self) -> anyhow::Result<()> {
        let start = Instant::now();
        while !self.is_ready() {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("router {} not ready:\n{}", self.router_id, self.log());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Ok(())
    }

    pub fn is_ready(&self) -> bool {
        matches!(http_get(self.http_port, "/readyz"), Some((200, _)))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    /// The value of the sample `name` (exactly, labels included, e.g.
    /// `kvroute_router_errors_total{code="bad_request"}`): see [`crate::metric_sample`] (0 for
    /// a declared family's absent sample; panics on an undeclared family or a silent process).
    pub fn metric(&self, name: &str) -> f64 {
        crate::http::metric_sample(self.http_port, name)
    }

    /// [`RouterProcess::metric`], `None` while the process does not answer (paused, restarting).
    pub fn metric_if_up(&self, name: &str) -> Option<f64> {
        crate::http::metric_sample_if_up(self.http_port, name)
    }

    pub fn stop(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(c) => c.stop(),
            None => Ok(()),
        }
    }

    /// Sends `signal` to the router process (SIGSTOP freezes it like a hung machine).
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        self.child.as_ref().context("not running")?.signal(signal)
    }
}

/// Runs router binary `bin` expecting it to exit by itself (a startup failure): its exit
/// code and stderr.
pub fn router_exit(env: &TestEnv, bin: &str, extra: &[&str]) -> anyhow::Result<(i32, String)> {
    router_exit_with(env, bin, extra, &[])
}

/// [`router_exit`] with extra environment variables `vars`.
pub fn router_exit_with(
    env: &TestEnv,
    bin: &str,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> anyhow::Result<(i32, String)> {
    let program = kvroute_bin("kvroute-router", bin)?;
    let mut args = env.server_args();
    args.extend(["--http-addr".into(), "127.0.0.1:0".into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let exited = crate::process::run_to_exit(&program, &args, vars, Duration::from_secs(30))?;
    Ok((exited.code, exited.stderr))
}

/// A worker card for model `model` with block size 16.
pub fn worker_card(names: &Names, worker_id: WorkerId, model: &str) -> WorkerCard {
    WorkerCard {
        v: SchemaVersion::CURRENT,
        worker_id,
        model: model.into(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        total_kv_blocks: 100_000,
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

/// The stored-block chains a simulated worker holds, republished on resync.
#[derive(Debug, Default)]
struct SimCache(Mutex<Vec<Vec<StoredBlock>>>);

impl ResyncSource for SimCache {
    fn resync(&self, publisher: &EventPublisher) {
        let chains = self.0.lock().expect("sim cache");
        let mut events = vec![KvEventData::Cleared];
        events.extend(chains.iter().map(|blocks| KvEventData::Stored {
            parent_hash: None,
            blocks: blocks.clone(),
            tier: StorageTier::Device,
        }));
        publisher.publish(0, events);
    }
}

/// A worker registered in etcd that "holds" the prompts it is told to store.
#[derive(Debug)]
pub struct PromptWorker {
    agent: WorkerAgent,
    cache: Arc<SimCache>,
    load_seq: Mutex<u64>,
}

impl PromptWorker {
    /// Registers `card` (lease TTL `ttl_secs`) and waits until it is in etcd.
    pub async fn start(env: &TestEnv, card: WorkerCard, ttl_secs: u64) -> anyhow::Result<Self> {
        let names = Names::new(&env.namespace);
        let cache = Arc::new(SimCache::default());
        let config = WorkerAgentConfig {
            registration: RegistrationConfig {
                lease_ttl: Duration::from_secs(ttl_secs),
                retry_interval: Duration::from_millis(100),
            },
            ..Default::default()
        };
        let mut agent = WorkerAgent::start(
            env.nats.connect().await?,
            env.etcd.connect().await?,
            &names,
            card,
            config,
            cache.clone(),
        )
        .await?;
        agent.wait_registered().await;
        Ok(Self {
            agent,
            cache,
            load_seq: Mutex::new(0),
        })
    }

    pub fn id(&self) -> WorkerId {
        self.agent.card().worker_id
    }

    /// Publishes the full blocks of `tokens` as one stored chain and waits until acked.
    pub async fn store_prompt(&self, tokens: &[u32]) {
        self.store_prompt_in(tokens, StorageTier::Device).await;
    }

    /// [`Self::store_prompt`] in `tier` (device-tier chains are also republished on resync).
    pub async fn store_prompt_in(&self, tokens: &[u32], tier: StorageTier) {
        let seed = seed_for_lora(None);
        let local = local_block_hashes(tokens, self.agent.card().block_size as usize, seed);
        let seq = sequence_hashes(&local, seed);
        let blocks: Vec<StoredBlock> = local
            .iter()
            .zip(&seq)
            .map(|(l, s)| StoredBlock {
                block_hash: *s,
                tokens_hash: *l,
            })
            .collect();
        if tier == StorageTier::Device {
            self.cache.0.lock().expect("sim cache").push(blocks.clone());
        }
        self.agent.publish_events(
            0,
            vec![KvEventData::Stored {
                parent_hash: None,
                blocks,
                tier,
            }],
        );
        self.agent.publisher().flush().await;
    }

    /// Publishes a load report with `active_requests` and `decode_blocks`.
    pub async fn report_load(&self, active_requests: u64, decode_blocks: u64) {
        let seq = {
            let mut s = self.load_seq.lock().expect("load seq");
            *s += 1;
            *s
        };
        let load = WorkerLoad {
            v: SchemaVersion::CURRENT,
            worker_id: self.id(),
            dp_rank: 0,
            seq,
            active_prefill_tokens: 0,
            active_decode_blocks: decode_blocks,
            active_requests,
            waiting_requests: 0,
            kv_used_blocks: 0,
            total_kv_blocks: 100_000,
            ts: 0,
            new_requests: None,
            adapters: None,
        };
        self.agent.publish_load(&load).await.expect("load report");
    }

    pub fn agent(&self) -> &WorkerAgent {
        &self.agent
    }

    /// Deregisters (the card disappears at once).
    pub async fn shutdown(self) {
        self.agent.shutdown().await;
    }
}

/// Sends one select request and decodes the answer.
pub async fn select(
    nats: &async_nats::Client,
    names: &Names,
    request: &SelectRequest,
) -> anyhow::Result<SelectResponse> {
    select_raw(nats, names, encode(request)?.to_vec()).await
}

/// Sends raw bytes as a select request and decodes the answer.
pub async fn select_raw(
    nats: &async_nats::Client,
    names: &Names,
    payload: Vec<u8>,
) -> anyhow::Result<SelectResponse> {
    let reply = tokio::time::timeout(
        Duration::from_secs(20),
        nats.request(names.select(), payload.into()),
    )
    .await
    .context("select timed out")??;
    Ok(decode(&reply.payload)?)
}

/// Workers `ids` serving model `m` (block size 16, lease TTL 10 s), registered.
pub async fn prompt_workers(env: &TestEnv, ids: &[WorkerId]) -> Vec<PromptWorker> {
    let names = Names::new(&env.namespace);
    let mut out = Vec::new();
    for id in ids {
        let card = worker_card(&names, *id, "m");
        out.push(
            PromptWorker::start(env, card, 10)
                .await
                .expect("worker starts"),
        );
    }
    out
}

/// Selects until the reply shows `blocks` device blocks of overlap (the index caught up), for
/// at most `limit`.
pub async fn select_until_overlap(
    nats: &async_nats::Client,
    names: &Names,
    req: &SelectRequest,
    blocks: u32,
    limit: Duration,
) -> kvroute_common::messages::SelectReply {
    let start = Instant::now();
    loop {
        let reply = match select(nats, names, req).await.expect("select") {
            SelectResponse::Ok(r) => r,
            SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
        };
        if reply.overlap_blocks.get(&StorageTier::Device) == Some(&blocks) {
            return reply;
        }
        assert!(
            start.elapsed() < limit,
            "overlap never reached {blocks}: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `stored` and one token more: a prompt of which an engine can reuse every stored block (an
/// engine always computes a prompt's last token, so a prompt of exactly N blocks reuses N − 1,
/// and the router counts its overlap so).
pub fn continuing(stored: &[u32]) -> Vec<u32> {
    let mut tokens = stored.to_vec();
    tokens.push(7);
    tokens
}

/// A request for `model` with prompt `tokens`.
pub fn request(model: &str, tokens: Vec<u32>) -> SelectRequest {
    SelectRequest {
        model: model.into(),
        token_ids: Some(tokens),
        ..SelectRequest::default()
    }
}

/// Sends `request` to `subject` in a task that waits up to 30 s for the answer (for requests
/// that may wait in a router's admission queue).
pub fn send_select(
    nats: &async_nats::Client,
    subject: String,
    request: &SelectRequest,
) -> tokio::task::JoinHandle<SelectResponse> {
    let nats = nats.clone();
    let payload = encode(request).expect("a select request encodes");
    tokio::spawn(async move {
        let reply = tokio::time::timeout(Duration::from_secs(30), nats.request(subject, payload))
            .await
            .expect("answered within 30 s")
            .expect("a responder");
        decode::<SelectResponse>(&reply.payload).expect("a select response")
    })
}

/// The reply of a successful selection; panics on an error answer.
pub fn expect_worker(response: SelectResponse) -> SelectReply {
    match response {
        SelectResponse::Ok(r) => r,
        SelectResponse::Error(e) => panic!("expected a worker, got {e:?}"),
    }
}

impl PromptWorker {
    /// Publishes that `request_id` finished here (its load leaves every router's view).
    pub async fn finish(&self, request_id: RequestId, output_tokens: u64) {
        let event = RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id,
            worker_id: self.id(),
            dp_rank: 0,
            kind: LifecycleKind::Finished { output_tokens },
            ts: 0,
        };
        self.agent
            .publish_lifecycle(&event)
            .await
            .expect("a lifecycle event");
    }
}

/// The worker of `fleet` with id `id`.
pub fn fleet_worker(fleet: &[PromptWorker], id: WorkerId) -> &PromptWorker {
    fleet
        .iter()
        .find(|w| w.id() == id)
        .expect("a worker of the fleet")
}

/// Waits until `expected` router replicas are registered in etcd (and gives their watchers a
/// moment to see the last one), so each knows the partitions' owners.
pub async fn wait_routers_registered(env: &TestEnv, names: &Names, expected: usize) {
    let mut etcd = env.etcd.connect().await.expect("etcd");
    let prefix = names.routers_prefix();
    for _ in 0..200 {
        let resp = etcd
            .get(
                prefix.as_str(),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("etcd get");
        if resp.kvs().len() == expected {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{expected} routers never registered");
}
