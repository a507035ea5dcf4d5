//! The integration-test harness: real `nats-server` (JetStream) and `etcd` processes on free
//! loopback ports with temporary data dirs, stopped when the test ends (even if it is killed).
//!
//! Binaries are found through `KVROUTE_NATS_SERVER` / `KVROUTE_ETCD`, then the repo's
//! `.tools/bin/` (where `scripts/install-deps` puts nats-server), then `PATH`.
//!
//! `EnginePublisher` runs vLLM's and SGLang's own KV-event publishers (tests/engines/);
//! `VllmEngine` a real vLLM engine (scripts/install-vllm), `EventWatch` reads its KV events.

mod bins;
mod bridge;
pub mod cpu;
mod engine_face;
mod engine_publisher;
mod gateway;
mod http;
mod load;
mod played_engine;
mod ports;
mod process;
mod router;
mod secrets;
mod servers;
mod sim_worker;
mod vllm;
mod vllm_events;

pub use bins::{IndexerProcess, kvroute_bin, sibling_bin};
pub use bridge::BridgeProcess;
pub use engine_face::{
    Batch, EngineFace, Sub, decode_batch, eventually, face_config, field, map_keys, python_json,
    replay, sample,
};
pub use engine_publisher::{Engine, EngineOptions, EnginePublisher, RankEndpoints};
pub use gateway::{GatewayProcess, GatewayStack, STACK_MODEL, http_card, model_dir, register};
pub use http::{
    SampleError, http_get, labelled, metric_sample, metric_sample_if_up, one_of, sample_value,
    series,
};
pub use load::{LoadPlan, LoadReport, Sent, steady_load};
pub use played_engine::{Play, PlayedEngine, Received, play};
pub use ports::free_port;
pub use process::{ChildGuard, Exited, Supervised, run_to_exit};
pub use router::{
    PromptWorker, RouterProcess, continuing, expect_worker, fleet_worker, prompt_workers, request,
    router_exit, router_exit_with, select, select_raw, select_until_overlap, send_select,
    wait_routers_registered, worker_card,
};
pub use secrets::Secrets;
pub use servers::{EtcdCluster, EtcdServer, NatsServer, TestEnv, find_binary, workspace_root};
pub use sim_worker::{SimWorker, expected_index, sim_card, stored};
pub use vllm::{VLLM_BLOCK_SIZE, VLLM_KV_BLOCKS, VLLM_MAX_MODEL_LEN, VllmEngine, vllm_install};
pub use vllm_events::{EngineBlocks, EventWatch};
