//! `kvroute-gateway` for tests: the binary under the harness supervisor, the model folders the
//! tests tokenize with (`tests/models/`), and worker cards of engines the tests play
//! themselves (a port nobody listens on, an engine that dies mid-stream).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvroute_common::Names;
use kvroute_common::messages::{WorkerCard, WorkerRole};
use kvroute_common::worker::{Registration, RegistrationConfig};

use crate::bins::kvroute_bin;
use crate::http::http_get;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::servers::{TestEnv, workspace_root};

/// A model folder of `tests/models/` (tokenizer.json + tokenizer_config.json).
pub fn model_dir(name: &str) -> PathBuf {
    workspace_root().join("tests/models").join(name)
}

/// A `kvroute-gateway` process against a [`TestEnv`].
#[derive(Debug)]
pub struct GatewayProcess {
    pub name: String,
    pub port: u16,
    spec: Supervised,
    child: Option<ChildGuard>,
}

impl GatewayProcess {
    /// Starts the gateway with `extra` flags (its models among them) and waits until
    /// `/readyz` is 200.
    pub fn start(env: &TestEnv, name: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let program = kvroute_bin("kvroute-gateway", "kvroute-gateway")?;
        Self::start_program(env, program, name, extra)
    }

    /// [`GatewayProcess::start`] with the binary at `program` (e.g. a release build).
    pub fn start_program(
        env: &TestEnv,
        program: PathBuf,
        name: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let port = free_port();
        let mut args = env.server_args();
        args.extend(["--http-addr".into(), format!("127.0.0.1:{port}")]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = env.nats.data_dir().join(format!("gateway-{name}.log"));
        let mut spec = Supervised::new(program, args, log);
        spec.env.push(("RUST_LOG".into(), "info".into()));
        let child = Some(spec.spawn()?);
        let p = Self {
            name: name.into(),
            port,
            spec,
            child,
        };
        let start = Instant::now();
        while !matches!(http_get(p.port, "/readyz"), Some((200, _))) {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("gateway {name} not ready:\n{}", p.log());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Ok(p)
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// POSTs `body` as JSON to `path` with `http`; panics when nothing answers.
    pub async fn post(
        &self,
        http: &reqwest::Client,
        path: &str,
        body: &serde_json::Value,
    ) -> reqwest::Response {
        http.post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("the gateway answers")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    /// Whether the process still runs (false once it exited, even before it is reaped).
    pub fn is_running(&self) -> bool {
        self.child.as_ref().is_some_and(ChildGuard::is_running)
    }

    /// The value of sample `name` (labels included, exactly as rendered); 0 when absent.
    pub fn metric(&self, name: &str) -> f64 {
        crate::http::metric_sample(self.port, name)
    }

    pub fn stop(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(c) => c.stop(),
            None => Ok(()),
        }
    }
}

/// A card for a worker the test plays itself, taking requests at `http_url`.
pub fn http_card(worker_id: u64, model: &str, http_url: &str) -> WorkerCard {
    WorkerCard {
        v: Default::default(),
        worker_id,
        model: model.into(),
        role: WorkerRole::Aggregated,
        block_size: 4,
        total_kv_blocks: 1024,
        max_num_batched_tokens: 0,
        dp_start_rank: 0,
        dp_size: 1,
        taints: vec![],
        labels: Default::default(),
        request_subject: format!("kvroute.test.{worker_id}"),
        software_version: String::new(),
        http_url: Some(http_url.into()),
        kv_events: true,
        lora_adapters: None,
    }
}

/// Registers `card` (2 s lease) until the returned value is dropped.
pub async fn register(env: &TestEnv, card: WorkerCard) -> anyhow::Result<Registration> {
    let etcd = env.etcd.connect().await?;
    let mut r = Registration::start(
        etcd,
        &Names::new(&env.namespace),
        card,
        RegistrationConfig {
            lease_ttl: Duration::from_secs(2),
            ..RegistrationConfig::default()
        },
    )
    .context("registering a test worker")?;
    r.wait_registered().await;
    Ok(r)
}

/// The real-engine path with a gateway in front: an indexer and a router, `workers` mocker
/// engines impersonating vLLM (4-token blocks), one kvroute-bridge for all of them (worker
/// ids 100, 101, ...), and gateways started on demand.
#[derive(Debug)]
pub struct GatewayStack {
    pub env: TestEnv,
    pub indexer: crate::IndexerProcess,
    pub router: crate::RouterProcess,
    pub engines: kvroute_mocker::engine_face::EngineFleet,
    pub endpoints: Vec<kvroute_mocker::engine_face::WorkerEndpoints>,
    /// A disaggregated stack's decode engines (`engines` are its prefill engines).
    pub decode: Option<(
        kvroute_mocker::engine_face::EngineFleet,
        Vec<kvroute_mocker::engine_face::WorkerEndpoints>,
    )>,
    bridge_stop: Option<tokio::sync::oneshot::Sender<()>>,
    bridge: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    _dir: tempfile::TempDir,
}

/// The bridge's YAML entries of `endpoints`, worker ids from `first_id`, each engine's kind
/// and disaggregation role as the mocker impersonates them.
fn bridge_yaml(
    endpoints: &[kvroute_mocker::engine_face::WorkerEndpoints],
    first_id: u64,
) -> String {
    use kvroute_mocker::engine_face::DisaggregationRole;
    endpoints
        .iter()
        .map(|e| {
            let role = match e.role {
                DisaggregationRole::None => "aggregated",
                DisaggregationRole::Prefill => "prefill",
                DisaggregationRole::Decode => "decode",
            };
            format!(
                "  - engine: {}\n    engine_url: {}\n    zmq_endpoint: {}\n    zmq_replay_endpoint: {}\n    worker_id: {}\n    role: {role}\n",
                e.engine.as_str(),
                e.url(),
                e.zmq[0],
                e.replay[0],
                first_id + u64::from(e.index)
            )
        })
        .collect()
}

/// The model name of the stack's engines.
pub const STACK_MODEL: &str = "m";

impl GatewayStack {
    /// Starts everything but the gateways; returns once every engine is registered.
    /// `face` adjusts the engines (speed, tokenizer) before they start.
    pub async fn start(
        workers: u32,
        face: impl FnOnce(&mut kvroute_mocker::fleet::FleetConfig),
    ) -> anyhow::Result<Self> {
        Self::start_with(workers, &[], face).await
    }

    /// [`GatewayStack::start`] with extra flags for the router.
    pub async fn start_with(
        workers: u32,
        router_flags: &[&str],
        face: impl FnOnce(&mut kvroute_mocker::fleet::FleetConfig),
    ) -> anyhow::Result<Self> {
        let mut config = Self::fleet_config(workers);
        face(&mut config);
        Self::start_pools(router_flags, config, None).await
    }

    /// A disaggregated stack: `prefill` prefill workers (ids 100, 101, ...) and `decode`
    /// decode workers (ids 200, 201, ...), mocker engines impersonating `api`'s prefill and
    /// decode servers, each registered by the bridge with its role. `face` adjusts both pools
    /// (it is told which role it adjusts); the prefill workers listen on a side channel (vLLM's
    /// NIXL port, SGLang's bootstrap port).
    pub async fn start_disaggregated(
        api: kvroute_mocker::engine_face::EngineApi,
        prefill: u32,
        decode: u32,
        router_flags: &[&str],
        face: impl Fn(&mut kvroute_mocker::fleet::FleetConfig, WorkerRole),
    ) -> anyhow::Result<Self> {
        use kvroute_mocker::engine_face::DisaggregationRole;
        let pool = |workers, role, disagg| {
            let mut c = Self::fleet_config(workers);
            c.face.engine_api = api;
            c.face.disaggregation_role = disagg;
            if role == WorkerRole::Prefill {
                c.face.engine_side_channel_port = Some(0);
            }
            face(&mut c, role);
            c
        };
        let p = pool(prefill, WorkerRole::Prefill, DisaggregationRole::Prefill);
        let d = pool(decode, WorkerRole::Decode, DisaggregationRole::Decode);
        Self::start_pools(router_flags, p, Some(d)).await
    }

    fn fleet_config(workers: u32) -> kvroute_mocker::fleet::FleetConfig {
        let mut config = kvroute_mocker::fleet::FleetConfig {
            workers,
            model: STACK_MODEL.into(),
            speedup: 1.0,
            ..kvroute_mocker::fleet::FleetConfig::default()
        };
        config.engine.block_size = 4;
        config.engine.num_blocks = 4096;
        config.face.engine_api = kvroute_mocker::engine_face::EngineApi::Vllm;
        config.face.engine_http_port = 0;
        config.face.engine_zmq_port = 0;
        config.face.engine_replay_port = 0;
        config
    }

    /// Starts the servers, the engines of `first` (ids from 100; aggregated or prefill, as its
    /// face's role says) and of `decode` (ids from 200), and one bridge for all of them.
    async fn start_pools(
        router_flags: &[&str],
        first: kvroute_mocker::fleet::FleetConfig,
        decode: Option<kvroute_mocker::fleet::FleetConfig>,
    ) -> anyhow::Result<Self> {
        use clap::Parser as _;
        let env = TestEnv::start()?;
        let indexer = crate::IndexerProcess::start(&env, "a", &[])?;
        let router = crate::RouterProcess::start(&env, "r", router_flags)?;
        let engines = kvroute_mocker::engine_face::EngineFleet::start(&first).await?;
        let endpoints = engines.endpoints();
        let mut yaml = bridge_yaml(&endpoints, 100);
        let mut workers = endpoints.len();
        let decode = match decode {
            Some(config) => {
                let fleet = kvroute_mocker::engine_face::EngineFleet::start(&config).await?;
                let at = fleet.endpoints();
                yaml.push_str(&bridge_yaml(&at, 200));
                workers += at.len();
                Some((fleet, at))
            }
            None => None,
        };
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("engines.yaml");
        std::fs::write(&file, format!("engines:\n{yaml}"))?;
        let mut argv = vec!["kvroute-bridge".to_owned()];
        argv.extend(env.server_args());
        argv.extend(
            [
                "--engines-file",
                &file.display().to_string(),
                "--health-interval-ms",
                "100",
                "--health-failures",
                "2",
                "--lease-ttl-secs",
                "2",
            ]
            .map(String::from),
        );
        let args = kvroute_bridge::BridgeArgs::try_parse_from(argv)?;
        let specs = args.engines()?;
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let bridge = tokio::spawn(kvroute_bridge::run::run(args, specs, async {
            let _ = stop_rx.await;
        }));
        let stack = Self {
            env,
            indexer,
            router,
            engines,
            endpoints,
            decode,
            bridge_stop: Some(stop),
            bridge: Some(bridge),
            _dir: dir,
        };
        let start = Instant::now();
        while stack.registered().await? < workers {
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the bridged engines did not all register");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(stack)
    }

    /// Worker cards in etcd.
    pub async fn registered(&self) -> anyhow::Result<usize> {
        let mut etcd = self.env.etcd.connect().await?;
        let prefix = Names::new(&self.env.namespace).workers_prefix();
        Ok(etcd
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await?
            .count() as usize)
    }

    /// A gateway (its `--model` flags among `extra`).
    pub fn gateway(&self, name: &str, extra: &[&str]) -> anyhow::Result<GatewayProcess> {
        GatewayProcess::start(&self.env, name, extra)
    }

    /// Stops the bridge (deregistering the engines).
    pub async fn stop_bridge(&mut self) {
        if let Some(stop) = self.bridge_stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.bridge.take() {
            let _ = task.await;
        }
    }
}
