//! The engine face's flags: which engine every simulated worker impersonates, its event format,
//! and the ports of each worker's sockets (worker i: base + i × stride, rank r: + r, the
//! engines' own rule). Checked once by [`EngineFaceArgs::validate`]; errors name the flag.

use std::collections::HashMap;
use std::net::IpAddr;

use kvroute_common::config::ConfigError;
/// An engine the mocker can impersonate: the bridge's vocabulary.
pub use kvroute_engine_wire::EngineKind;

/// What a simulated worker looks like from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineApi {
    /// A kvroute worker: card in etcd, events and load on NATS, requests on its subject.
    #[default]
    Kvroute,
    /// vLLM: ZMQ KV events and the OpenAI server's HTTP API (`/metrics`); no NATS, no etcd.
    Vllm,
    /// SGLang: ZMQ KV events and its HTTP API (`/get_server_info`, `/v1/loads`).
    Sglang,
}

impl EngineApi {
    /// The engine impersonated, unless the worker is a plain kvroute worker.
    pub fn face(self) -> Option<EngineKind> {
        match self {
            EngineApi::Kvroute => None,
            EngineApi::Vllm => Some(EngineKind::Vllm),
            EngineApi::Sglang => Some(EngineKind::Sglang),
        }
    }
}

/// How events are written inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EventFormat {
    /// Tagged maps (`{"type": "BlockStored", ...}`), as vLLM and SGLang write them today.
    #[default]
    Maps,
    /// Tagged positional arrays (`["BlockStored", ...]`, every slot present), the older form.
    Arrays,
}

/// A worker's part in disaggregated serving (`--disaggregation-role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DisaggregationRole {
    /// Aggregated: the worker prefills and decodes its own requests.
    #[default]
    None,
    /// Computes prompts' KV and holds it for a decode worker to pull (vLLM: NIXL
    /// `kv_producer`; SGLang: `--disaggregation-mode prefill`, with a bootstrap server).
    Prefill,
    /// Decodes requests whose prompts' KV it pulls from a prefill worker (vLLM: NIXL
    /// `kv_consumer`; SGLang: `--disaggregation-mode decode`).
    Decode,
}

/// The side-channel port of a prefill worker 0 when `--engine-side-channel-port` is absent:
/// vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT` default, SGLang's `--disaggregation-bootstrap-port`.
pub fn default_side_channel_port(engine: EngineKind) -> u16 {
    match engine {
        EngineKind::Vllm => 5600,
        EngineKind::Sglang => 8998,
    }
}

/// Most data-parallel ranks one simulated worker runs.
pub const MAX_DP_SIZE: u32 = 64;
/// Most ranks in one process: each has a ZMQ thread.
pub const MAX_RANKS: u32 = 4096;

/// The flags of `--engine-api vllm|sglang` (ignored under `kvroute`).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct EngineFaceArgs {
    /// What each simulated worker looks like: `kvroute` (a kvroute worker on NATS and etcd), or
    /// `vllm` / `sglang`: that engine's ZMQ KV-event publisher and HTTP API, without NATS or
    /// etcd (point kvroute-bridge at the endpoints printed at startup).
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_API", value_enum, default_value_t)]
    pub engine_api: EngineApi,
    /// How events are written: `maps` (tagged maps, today's engines) or `arrays` (tagged
    /// positional arrays, the older format).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_ENGINE_EVENT_FORMAT",
        value_enum,
        default_value_t
    )]
    pub engine_event_format: EventFormat,
    /// HTTP port of worker 0 (worker i: + i × --engine-port-stride); 0: any free port.
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_HTTP_PORT", default_value_t = 8000)]
    pub engine_http_port: u16,
    /// ZMQ PUB port of worker 0, rank 0 (rank r: + r); 0: any free port (one rank only).
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_ZMQ_PORT", default_value_t = 5557)]
    pub engine_zmq_port: u16,
    /// ZMQ replay ROUTER port of worker 0, rank 0 (rank r: + r); 0: any free port (one rank
    /// only).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_ENGINE_REPLAY_PORT",
        default_value_t = 5558
    )]
    pub engine_replay_port: u16,
    /// Port distance between consecutive workers, for all three kinds of port.
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_PORT_STRIDE", default_value_t = 10)]
    pub engine_port_stride: u16,
    /// Data-parallel ranks per worker: each rank is its own simulated engine (queue, batch,
    /// cache) with its own PUB and replay sockets; the worker's HTTP server serves them all.
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_DP_SIZE", default_value_t = 1)]
    pub engine_dp_size: u32,
    /// The ZMQ topic every batch is published under (the engines' `topic`; default empty).
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_TOPIC", default_value = "")]
    pub engine_topic: String,
    /// Address every socket binds (ZMQ and HTTP).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_ENGINE_BIND_HOST",
        default_value = "127.0.0.1"
    )]
    pub engine_bind_host: IpAddr,
    /// Batches each rank keeps for replay requests (the engines' `buffer_steps`).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_ENGINE_REPLAY_BUFFER",
        default_value_t = 10_000
    )]
    pub engine_replay_buffer: usize,
    /// A model folder (`tokenizer.json`, `tokenizer_config.json`) to tokenize prompts and
    /// render chats with, as the real engine does with its model's tokenizer and chat
    /// template (kvroute-text); the same folder a kvroute-gateway in front is given, so both
    /// hash the same tokens. Absent: one token per UTF-8 byte and a fixed chat format.
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_TOKENIZER")]
    pub engine_tokenizer: Option<std::path::PathBuf>,
    /// LoRA adapters every worker serves (vLLM's `--lora-modules`): a request whose `model` is
    /// one of them runs under that adapter (its blocks keyed apart, its `BlockStored` events
    /// naming it; with `--max-loras`, one of the engine's adapter slots), `/v1/models` lists
    /// them, and vLLM's `/metrics` has `vllm:lora_requests_info`.
    #[arg(
        long,
        env = "KVROUTE_MOCKER_ENGINE_LORA_MODULES",
        value_delimiter = ','
    )]
    pub engine_lora_modules: Vec<String>,
    /// Every worker's role in disaggregated serving: `none` (aggregated), `prefill` or
    /// `decode`. Prefill workers hold prompts' KV for decode workers to pull through their
    /// side channel (`engine_face/transfer.rs`); see PROTOCOL.md for the request fields.
    #[arg(
        long,
        env = "KVROUTE_MOCKER_DISAGGREGATION_ROLE",
        value_enum,
        default_value_t
    )]
    pub disaggregation_role: DisaggregationRole,
    /// A prefill worker 0's side-channel port (vLLM: the NIXL side channel, `remote_port`;
    /// SGLang: the bootstrap port, `bootstrap_port`); worker i: + i × --engine-port-stride;
    /// 0: any free port. Default: the engine's, 5600 (vLLM) or 8998 (SGLang).
    #[arg(long, env = "KVROUTE_MOCKER_ENGINE_SIDE_CHANNEL_PORT")]
    pub engine_side_channel_port: Option<u16>,
    /// Simulated milliseconds to move one KV block from a prefill to a decode worker (at
    /// 25 GB/s, a 64-token block of an 8B model, 8 MiB, takes about 0.3 ms). Default 0.4.
    #[arg(
        long,
        env = "KVROUTE_MOCKER_KV_TRANSFER_MS_PER_BLOCK",
        default_value_t = 0.4
    )]
    pub kv_transfer_ms_per_block: f64,
    /// Probability, 0 to 1, that a KV transfer fails after its time (1: every one; tests).
    /// Default 0.
    #[arg(
        long,
        env = "KVROUTE_MOCKER_KV_TRANSFER_FAILURE_RATE",
        default_value_t = 0.0
    )]
    pub kv_transfer_failure_rate: f64,
    /// Seconds a prefill worker keeps computed KV for its decode worker (vLLM's
    /// `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`), and an SGLang decode waits for its room (SGLang's
    /// `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`). Wall seconds. Default 300.
    #[arg(
        long,
        env = "KVROUTE_MOCKER_DISAGGREGATION_TIMEOUT_SECS",
        default_value_t = 300.0
    )]
    pub disaggregation_timeout_secs: f64,
}

impl Default for EngineFaceArgs {
    fn default() -> Self {
        Self {
            engine_api: EngineApi::Kvroute,
            engine_event_format: EventFormat::Maps,
            engine_http_port: 8000,
            engine_zmq_port: 5557,
            engine_replay_port: 5558,
            engine_port_stride: 10,
            engine_dp_size: 1,
            engine_topic: String::new(),
            engine_bind_host: IpAddr::from([127, 0, 0, 1]),
            engine_replay_buffer: 10_000,
            engine_tokenizer: None,
            engine_lora_modules: Vec::new(),
            disaggregation_role: DisaggregationRole::None,
            engine_side_channel_port: None,
            kv_transfer_ms_per_block: 0.4,
            kv_transfer_failure_rate: 0.0,
            disaggregation_timeout_secs: 300.0,
        }
    }
}

/// The ports of one worker (0: chosen by the OS when binding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPorts {
    pub http: u16,
    /// A prefill worker's side channel (`None` unless `--disaggregation-role prefill`).
    pub side_channel: Option<u16>,
    /// Per rank.
    pub zmq: Vec<u16>,
    /// Per rank.
    pub replay: Vec<u16>,
}

impl EngineFaceArgs {
    /// Checks the face's settings for a fleet of `workers`; nothing to check under `kvroute`.
    pub fn validate(&self, workers: u32) -> Result<(), ConfigError> {
        if self.engine_api == EngineApi::Kvroute {
            return Ok(());
        }
        if let Some(bad) = self
            .engine_lora_modules
            .iter()
            .find(|name| name.trim().is_empty() || name.trim() != name.as_str())
        {
            return Err(ConfigError::new(
                "engine-lora-modules",
                format!("{bad:?} is not an adapter name"),
            ));
        }
        if self.engine_dp_size == 0 || self.engine_dp_size > MAX_DP_SIZE {
            return Err(ConfigError::new(
                "engine-dp-size",
                format!("must be 1..={MAX_DP_SIZE}, got {}", self.engine_dp_size),
            ));
        }
        if workers.saturating_mul(self.engine_dp_size) > MAX_RANKS {
            return Err(ConfigError::new(
                "engine-dp-size",
                format!(
                    "{} ranks per worker × {workers} workers is more than {MAX_RANKS} ranks (each has its own ZMQ thread)",
                    self.engine_dp_size
                ),
            ));
        }
        if self.engine_port_stride == 0 {
            return Err(ConfigError::new("engine-port-stride", "must be at least 1"));
        }
        if self.engine_replay_buffer == 0 {
            return Err(ConfigError::new(
                "engine-replay-buffer",
                "must be at least 1",
            ));
        }
        for (flag, base) in [
            ("engine-zmq-port", self.engine_zmq_port),
            ("engine-replay-port", self.engine_replay_port),
        ] {
            if base == 0 && self.engine_dp_size > 1 {
                return Err(ConfigError::new(
                    flag,
                    format!(
                        "0 (any free port) needs --engine-dp-size 1: rank r is found at base + r, got {} ranks",
                        self.engine_dp_size
                    ),
                ));
            }
        }
        if !(self.kv_transfer_ms_per_block.is_finite() && self.kv_transfer_ms_per_block >= 0.0) {
            return Err(ConfigError::new(
                "kv-transfer-ms-per-block",
                format!("must be 0 or more, got {}", self.kv_transfer_ms_per_block),
            ));
        }
        if !(0.0..=1.0).contains(&self.kv_transfer_failure_rate) {
            return Err(ConfigError::new(
                "kv-transfer-failure-rate",
                format!("must be 0 to 1, got {}", self.kv_transfer_failure_rate),
            ));
        }
        if !(self.disaggregation_timeout_secs.is_finite() && self.disaggregation_timeout_secs > 0.0)
        {
            return Err(ConfigError::new(
                "disaggregation-timeout-secs",
                format!("must be positive, got {}", self.disaggregation_timeout_secs),
            ));
        }
        self.check_ports(workers)
    }

    /// The side-channel port base of prefill workers (`None` unless the role is prefill).
    fn side_channel_base(&self) -> Option<u16> {
        let engine = self.engine_api.face()?;
        (self.disaggregation_role == DisaggregationRole::Prefill).then(|| {
            self.engine_side_channel_port
                .unwrap_or_else(|| default_side_channel_port(engine))
        })
    }

    /// Every fixed port of every worker and rank: within the u16 range and used once.
    fn check_ports(&self, workers: u32) -> Result<(), ConfigError> {
        let mut owners: HashMap<u32, (&'static str, u32, Option<u32>)> = HashMap::new();
        let stride = u32::from(self.engine_port_stride);
        for worker in 0..workers {
            let side = self.side_channel_base();
            let kinds = [
                ("engine-http-port", self.engine_http_port, None),
                ("engine-side-channel-port", side.unwrap_or(0), None),
                ("engine-zmq-port", self.engine_zmq_port, Some(())),
                ("engine-replay-port", self.engine_replay_port, Some(())),
            ];
            for (flag, base, per_rank) in kinds {
                if base == 0 {
                    continue;
                }
                let ranks = per_rank.map_or(1, |()| self.engine_dp_size);
                for r in 0..ranks {
                    let port = u32::from(base) + worker * stride + r;
                    let rank = per_rank.map(|()| r);
                    let here = describe(worker, rank);
                    if port > u32::from(u16::MAX) {
                        return Err(ConfigError::new(
                            flag,
                            format!("{base}: {here} would need port {port}, above 65535"),
                        ));
                    }
                    if let Some((other_flag, w, other_rank)) =
                        owners.insert(port, (flag, worker, rank))
                    {
                        return Err(ConfigError::new(
                            flag,
                            format!(
                                "{base}: port {port} of {here} is also --{other_flag}'s port for {} (change a base port or --engine-port-stride)",
                                describe(w, other_rank)
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The ports of worker `index` (0-based).
    pub fn worker_ports(&self, index: u32) -> WorkerPorts {
        let offset = index * u32::from(self.engine_port_stride);
        let port = |base: u16, rank: u32| -> u16 {
            if base == 0 {
                0
            } else {
                (u32::from(base) + offset + rank) as u16
            }
        };
        WorkerPorts {
            http: port(self.engine_http_port, 0),
            side_channel: self.side_channel_base().map(|base| port(base, 0)),
            zmq: (0..self.engine_dp_size)
                .map(|r| port(self.engine_zmq_port, r))
                .collect(),
            replay: (0..self.engine_dp_size)
                .map(|r| port(self.engine_replay_port, r))
                .collect(),
        }
    }
}

fn describe(worker: u32, rank: Option<u32>) -> String {
    match rank {
        Some(r) => format!("worker {worker} rank {r}"),
        None => format!("worker {worker}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm() -> EngineFaceArgs {
        EngineFaceArgs {
            engine_api: EngineApi::Vllm,
            ..EngineFaceArgs::default()
        }
    }

    #[test]
    fn defaults_fit_a_large_fleet_and_kvroute_checks_nothing() {
        vllm().validate(1024).unwrap();
        let kvroute = EngineFaceArgs {
            engine_dp_size: 0,
            ..EngineFaceArgs::default()
        };
        kvroute.validate(2).unwrap();
    }

    #[test]
    fn ports_follow_worker_stride_and_rank() {
        let args = EngineFaceArgs {
            engine_dp_size: 2,
            engine_replay_port: 5600,
            ..vllm()
        };
        args.validate(3).unwrap();
        let p = args.worker_ports(2);
        assert_eq!(p.http, 8020);
        assert_eq!(p.zmq, vec![5577, 5578]);
        assert_eq!(p.replay, vec![5620, 5621]);
        let any = EngineFaceArgs {
            engine_http_port: 0,
            engine_zmq_port: 0,
            engine_replay_port: 0,
            ..vllm()
        };
        any.validate(4).unwrap();
        assert_eq!(any.worker_ports(3).zmq, vec![0]);
    }

    #[test]
    fn prefill_workers_get_a_side_channel_port() {
        let prefill = EngineFaceArgs {
            disaggregation_role: DisaggregationRole::Prefill,
            ..vllm()
        };
        prefill.validate(3).unwrap();
        assert_eq!(prefill.worker_ports(2).side_channel, Some(5620));
        assert_eq!(vllm().worker_ports(2).side_channel, None);
        let sglang = EngineFaceArgs {
            engine_api: EngineApi::Sglang,
            ..prefill.clone()
        };
        assert_eq!(sglang.worker_ports(0).side_channel, Some(8998));
        let clash = EngineFaceArgs {
            engine_side_channel_port: Some(8000),
            ..prefill
        };
        let err = clash.validate(2).unwrap_err();
        assert_eq!(err.field, "engine-side-channel-port");
        assert!(err.message.contains("--engine-http-port"), "{err}");
    }

    #[test]
    fn overlapping_ranges_name_both_flags() {
        // Two ranks at 5557..5559 collide with the replay range starting at 5558.
        let err = EngineFaceArgs {
            engine_dp_size: 2,
            ..vllm()
        }
        .validate(1)
        .unwrap_err();
        assert_eq!(err.field, "engine-replay-port");
        assert!(err.message.contains("--engine-zmq-port"), "{err}");
        assert!(err.message.contains("worker 0 rank 1"), "{err}");
        // More ranks than the stride: worker 1's ranks meet worker 0's.
        let err = EngineFaceArgs {
            engine_dp_size: 12,
            engine_replay_port: 7000,
            ..vllm()
        }
        .validate(2)
        .unwrap_err();
        assert_eq!(err.field, "engine-zmq-port");
        assert!(err.message.contains("worker 1 rank 0"), "{err}");
        let err = EngineFaceArgs {
            engine_http_port: 65_530,
            ..vllm()
        }
        .validate(2)
        .unwrap_err();
        assert_eq!(err.field, "engine-http-port");
        assert!(err.message.contains("65540"), "{err}");
    }

    #[test]
    fn bad_values_name_the_flag() {
        let bad = |edit: fn(&mut EngineFaceArgs)| {
            let mut a = vllm();
            edit(&mut a);
            a.validate(2).unwrap_err().field
        };
        assert_eq!(bad(|a| a.engine_dp_size = 0), "engine-dp-size");
        assert_eq!(bad(|a| a.engine_dp_size = 65), "engine-dp-size");
        assert_eq!(bad(|a| a.engine_port_stride = 0), "engine-port-stride");
        let too_many = EngineFaceArgs {
            engine_dp_size: 8,
            engine_port_stride: 20,
            engine_replay_port: 30_000,
            engine_http_port: 0,
            ..vllm()
        };
        too_many.validate(512).unwrap();
        assert_eq!(too_many.validate(513).unwrap_err().field, "engine-dp-size");
        assert_eq!(bad(|a| a.engine_replay_buffer = 0), "engine-replay-buffer");
        assert_eq!(
            bad(|a| a.kv_transfer_ms_per_block = -1.0),
            "kv-transfer-ms-per-block"
        );
        assert_eq!(
            bad(|a| a.kv_transfer_failure_rate = 1.5),
            "kv-transfer-failure-rate"
        );
        assert_eq!(
            bad(|a| a.disaggregation_timeout_secs = 0.0),
            "disaggregation-timeout-secs"
        );
        assert_eq!(
            bad(|a| {
                a.engine_zmq_port = 0;
                a.engine_dp_size = 2;
                a.engine_replay_port = 6000;
            }),
            "engine-zmq-port"
        );
    }
}
