//! Everything the phases talk to: nats-server and etcd (the harness), release builds of
//! `kvroute-indexer`, `kvroute-router` and `kvroute-gateway`, nginx when installed, the
//! in-process engine and bare proxy; worker cards pointing at the engine, and every prompt's
//! blocks in the event log so that each selection finds its prefix on one worker.
//!
//! Placement: [`Stack::pin`] for the throughput phase (unless `--no-pin`) puts the proxy under
//! test — the gateway process, the bare proxy's threads, nginx — on CPU 1 and everything else
//! (nats-server, etcd, router, indexer, the bench's client and engine) on CPU 0; the latency
//! phase runs unpinned ([`Stack::unpin`]), so no hop waits for one busy core while the other
//! is free.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use kvroute_common::Names;
use kvroute_common::client::{RetryPolicy, SelectClient};
use kvroute_common::messages::{SelectRequest, StorageTier};
use kvroute_gateway::lifecycle::{Lifecycle, Placement};
use kvroute_gateway::metrics::Metrics;
use kvroute_tests::{
    GatewayProcess, IndexerProcess, PromptWorker, RouterProcess, TestEnv, cpu, http_card,
    sibling_bin,
};

use crate::accounts::{Accounts, Source};
use crate::engine::Api;
use crate::nginx::Nginx;
use crate::prompts::PromptSet;

/// The core of the proxy under test, and of everything else.
pub const PROXY_CPU: usize = 1;
pub const SERVICES_CPU: usize = 0;

/// Tokens per KV block of the registered workers.
pub const BLOCK_SIZE: u32 = 16;

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Direct,
    Bare,
    Nginx,
    Gateway,
}

impl Target {
    pub fn key(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Bare => "bare",
            Target::Nginx => "nginx",
            Target::Gateway => "gateway",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Target::Direct => "engine directly",
            Target::Bare => "bare proxy",
            Target::Nginx => "nginx",
            Target::Gateway => "kvroute-gateway",
        }
    }

    /// The account of its proxy's CPU.
    pub fn proxy_account(self) -> Option<&'static str> {
        match self {
            Target::Direct => None,
            Target::Bare => Some("bare proxy"),
            Target::Nginx => Some("nginx"),
            Target::Gateway => Some("gateway"),
        }
    }
}

/// How to start the stack.
#[derive(Debug, Clone)]
pub struct StackConfig {
    pub model: String,
    /// `--model NAME=DIR` for the gateway.
    pub model_dir: Option<PathBuf>,
    pub workers: u64,
    pub output_tokens: usize,
    pub nginx: bool,
    pub router_args: Vec<String>,
    pub gateway_args: Vec<String>,
    /// The bench's main thread (it drives the latency phase's requests): counted as client.
    pub main_tid: i32,
    /// The gateway binary to run (default: the release build next to the bench).
    pub gateway_bin: Option<PathBuf>,
}

/// The running stack.
#[derive(Debug)]
pub struct Stack {
    pub model: String,
    pub output_tokens: usize,
    pub engine: SocketAddr,
    pub bare: SocketAddr,
    pub nginx: Option<Nginx>,
    pub gateway: GatewayProcess,
    pub router: RouterProcess,
    pub indexer: IndexerProcess,
    pub workers: Vec<PromptWorker>,
    pub select: SelectClient,
    pub lifecycle: Lifecycle,
    pub accounts: Accounts,
    pub env: TestEnv,
}

/// Runs a blocking harness call (it polls with sleeps) without stalling the runtime.
fn block<R>(f: impl FnOnce() -> R) -> R {
    tokio::task::block_in_place(f)
}

impl Stack {
    /// Starts everything around the already running engine and bare proxy.
    pub async fn start(
        config: &StackConfig,
        engine: SocketAddr,
        bare: SocketAddr,
    ) -> anyhow::Result<Self> {
        let env = block(TestEnv::start)?;
        let indexer = block(|| {
            IndexerProcess::start_program(
                &env,
                sibling_bin("kvroute-indexer", "kvroute-indexer")?,
                "a",
                &[],
            )
        })?;
        let router_args: Vec<&str> = config.router_args.iter().map(String::as_str).collect();
        let router = block(|| {
            RouterProcess::start_program(
                &env,
                sibling_bin("kvroute-router", "kvroute-router")?,
                "r",
                &router_args,
            )
        })?;
        let mut gateway_args: Vec<String> = Vec::new();
        if let Some(dir) = &config.model_dir {
            gateway_args.extend([
                "--model".into(),
                format!("{}={}", config.model, dir.display()),
            ]);
        }
        // The latency rows send the same few prompts again and again: the gateway's tokenize
        // cache would serve them after the first round, so the rows run without it (they
        // measure a text not seen before) unless a --gateway-arg sets it; the conversation
        // rows measure the cache.
        if config.model_dir.is_some()
            && !config
                .gateway_args
                .iter()
                .any(|a| a.contains("tokenize-cache-mib"))
        {
            gateway_args.extend(["--tokenize-cache-mib".into(), "0".into()]);
        }
        gateway_args.extend(config.gateway_args.iter().cloned());
        let gateway_args: Vec<&str> = gateway_args.iter().map(String::as_str).collect();
        let gateway = block(|| {
            let program = match &config.gateway_bin {
                Some(p) => p.clone(),
                None => sibling_bin("kvroute-gateway", "kvroute-gateway")?,
            };
            GatewayProcess::start_program(&env, program, "bench", &gateway_args)
        })?;
        let nginx = match (config.nginx, crate::nginx::find()) {
            (true, Some(bin)) => Some(block(|| Nginx::start(bin, engine))?),
            (true, None) => {
                eprintln!("nginx not found (apt-get install nginx): measuring without it");
                None
            }
            (false, _) => None,
        };

        let names = Names::new(&env.namespace);
        let url = format!("http://{engine}");
        let mut workers = Vec::new();
        for id in 1..=config.workers {
            let mut card = http_card(id, &config.model, &url);
            card.block_size = BLOCK_SIZE;
            card.total_kv_blocks = 1 << 20;
            workers.push(PromptWorker::start(&env, card, 10).await?);
        }
        let nats = env.nats.connect().await?;
        let select = SelectClient::new(nats.clone(), &names, RetryPolicy::SELECT);
        let lifecycle = Lifecycle::start(nats, names, Arc::new(Metrics::default()));

        let mut accounts = Accounts::default();
        accounts.add("gateway", Source::Pids(gateway.pid().into_iter().collect()));
        let threads = |prefix, tids| Source::Threads { prefix, tids };
        accounts.add("bare proxy", threads("bench-proxy", vec![]));
        if let Some(n) = &nginx {
            accounts.add("nginx", Source::Pids(n.pids()));
        }
        accounts.add("client", threads("bench-client", vec![config.main_tid]));
        accounts.add("engine", threads("bench-engine", vec![]));
        accounts.add("router", Source::Pids(router.pid().into_iter().collect()));
        accounts.add("indexer", Source::Pids(indexer.pid().into_iter().collect()));
        accounts.add(
            "nats-server",
            Source::Pids(env.nats.pid().into_iter().collect()),
        );
        accounts.add("etcd", Source::Pids(env.etcd.pid().into_iter().collect()));

        Ok(Self {
            model: config.model.clone(),
            output_tokens: config.output_tokens,
            engine,
            bare,
            nginx,
            gateway,
            router,
            indexer,
            workers,
            select,
            lifecycle,
            accounts,
            env,
        })
    }

    /// The throughput phase's placement: the proxies (gateway, nginx, the bare proxy's
    /// threads) on [`PROXY_CPU`], everything else on [`SERVICES_CPU`].
    pub fn pin(&self) -> anyhow::Result<()> {
        let own = std::process::id() as i32;
        cpu::pin_process(own, SERVICES_CPU)?;
        for (tid, t) in cpu::threads_cpu() {
            if t.name.starts_with("bench-proxy") {
                cpu::pin_thread(tid, PROXY_CPU)?;
            }
        }
        for pid in self.service_pids() {
            cpu::pin_process(pid, SERVICES_CPU)?;
        }
        for pid in self.proxy_pids() {
            cpu::pin_process(pid, PROXY_CPU)?;
        }
        Ok(())
    }

    /// Every process and thread free to run anywhere (the latency phase's placement).
    pub fn unpin(&self) -> anyhow::Result<()> {
        cpu::unpin_process(std::process::id() as i32)?;
        for pid in self.service_pids().into_iter().chain(self.proxy_pids()) {
            cpu::unpin_process(pid)?;
        }
        Ok(())
    }

    fn service_pids(&self) -> Vec<i32> {
        [
            self.env.nats.pid(),
            self.env.etcd.pid(),
            self.indexer.pid(),
            self.router.pid(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn proxy_pids(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self.gateway.pid().into_iter().collect();
        if let Some(n) = &self.nginx {
            pids.extend(n.pids());
        }
        pids
    }

    /// The targets of this run, in table order.
    pub fn targets(&self) -> Vec<Target> {
        let mut t = vec![Target::Direct, Target::Bare];
        if self.nginx.is_some() {
            t.push(Target::Nginx);
        }
        t.push(Target::Gateway);
        t
    }

    pub fn url(&self, target: Target, api: Api) -> String {
        let base = match target {
            Target::Direct => self.engine,
            Target::Bare => self.bare,
            Target::Nginx => self.nginx.as_ref().expect("nginx runs").addr,
            Target::Gateway => ([127, 0, 0, 1], self.gateway.port).into(),
        };
        format!("http://{base}{}", api.path())
    }

    /// Stores every prompt (and its chat form) on one worker each (`i % workers`) and waits
    /// until a selection finds each one's full prefix.
    pub async fn store(&self, sets: &[PromptSet]) -> anyhow::Result<()> {
        let mut expected = Vec::new();
        for set in sets {
            for (i, p) in set.prompts.iter().enumerate() {
                let worker = &self.workers[i % self.workers.len()];
                for tokens in std::iter::once(&p.tokens).chain(p.chat_tokens.as_ref()) {
                    // A prompt shorter than a block has nothing to cache.
                    if tokens.len() as u32 >= BLOCK_SIZE {
                        worker.store_prompt(tokens).await;
                        // The router counts the blocks of all tokens but the last (an engine
                        // always computes the last token).
                        let blocks = (tokens.len() as u32 - 1) / BLOCK_SIZE;
                        expected.push((tokens.clone(), blocks));
                    }
                }
            }
        }
        let start = Instant::now();
        for (tokens, blocks) in expected {
            loop {
                let request = SelectRequest {
                    model: self.model.clone(),
                    token_ids: Some(tokens.clone()),
                    ..SelectRequest::default()
                };
                let reply = self
                    .select
                    .select(request)
                    .await
                    .map_err(|e| anyhow::anyhow!("selecting: {e}"))?
                    .reply;
                self.lifecycle.finished(
                    Placement {
                        request_id: reply.request_id,
                        worker_id: reply.worker_id,
                        dp_rank: reply.dp_rank,
                    },
                    0,
                );
                if reply
                    .overlap_blocks
                    .get(&StorageTier::Device)
                    .copied()
                    .unwrap_or(0)
                    == blocks
                {
                    break;
                }
                if start.elapsed() > Duration::from_secs(60) {
                    bail!("the index never showed a prompt's {blocks} blocks: {reply:?}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// Waits until the gateway lists every worker of the model.
    pub async fn gateway_sees_workers(&self) -> anyhow::Result<()> {
        let http = crate::client::http_client()?;
        let url = format!("http://127.0.0.1:{}/v1/models", self.gateway.port);
        let start = Instant::now();
        loop {
            let listed: serde_json::Value = http.get(&url).send().await?.json().await?;
            let workers = listed["data"]
                .as_array()
                .and_then(|d| d.iter().find(|m| m["id"] == self.model.as_str()))
                .and_then(|m| m["kvroute"]["workers"].as_u64());
            if workers == Some(self.workers.len() as u64) {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the gateway lists {listed}:\n{}", self.gateway.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the processes the stack started (servers go with `env`).
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        for w in self.workers.drain(..) {
            w.shutdown().await;
        }
        tokio::task::block_in_place(|| -> anyhow::Result<()> {
            if let Some(n) = self.nginx.take() {
                n.stop()?;
            }
            self.gateway.stop()?;
            self.router.stop()?;
            self.indexer.stop()?;
            // nats-server and etcd last.
            drop(self.env);
            Ok(())
        })
    }
}
