//! What SGLang's JSON endpoints say about its cache and its load (shapes as SGLang 0.5.23's
//! `srt/entrypoints/http_server.py` (`/server_info`, formerly `/get_server_info`) and
//! `srt/entrypoints/v1_loads.py` + `srt/managers/load_snapshot.py` (`/v1/loads`) build them).
//! Every field may be missing or `null`; numbers may come as floats.

use kvroute_common::DpRank;
use serde_json::Value;

use super::{EngineInfo, EngineLoad};

fn uint(v: &Value, key: &str) -> Option<u64> {
    let v = v.get(key)?;
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f.round() as u64)
    })
}

/// The server's resolved arguments plus its scheduler's facts. `page_size` is SGLang's block
/// size; `max_total_num_tokens` (the KV pool of one data-parallel rank) / `page_size` its
/// blocks; the per-step budget is `chunked_prefill_size` (−1 or absent: chunking off) else
/// `max_prefill_tokens`.
pub fn info(server_info: &Value) -> EngineInfo {
    let block_size = uint(server_info, "page_size")
        .filter(|&p| p > 0)
        .and_then(|p| u32::try_from(p).ok());
    let num_gpu_blocks = match (uint(server_info, "max_total_num_tokens"), block_size) {
        (Some(tokens), Some(page)) => Some(tokens / u64::from(page)),
        _ => None,
    };
    let budget = uint(server_info, "chunked_prefill_size")
        .filter(|&c| c > 0)
        .or_else(|| uint(server_info, "max_prefill_tokens").filter(|&m| m > 0));
    EngineInfo {
        model: server_info
            .get("served_model_name")
            .and_then(Value::as_str)
            .map(str::to_owned),
        block_size,
        num_gpu_blocks,
        dp_size: uint(server_info, "dp_size")
            .filter(|&d| d > 0)
            .and_then(|d| u32::try_from(d).ok()),
        max_num_batched_tokens: budget,
        version: server_info
            .get("version")
            .and_then(Value::as_str)
            .map(str::to_owned),
        bootstrap_port: (server_info
            .get("disaggregation_mode")
            .and_then(Value::as_str)
            == Some("prefill"))
        .then(|| uint(server_info, "disaggregation_bootstrap_port"))
        .flatten()
        .and_then(|p| u16::try_from(p).ok()),
        lora_adapters: None,
        problems: Vec::new(),
    }
}

/// `/v1/loads`: `{"loads": [{"dp_rank": r, "num_running_reqs": .., ...}, ...]}`; a rank of
/// `ranks` the answer does not list gets an all-unknown load.
pub fn load(loads: &Value, ranks: &[DpRank]) -> Vec<(DpRank, EngineLoad)> {
    let entries = loads
        .get("loads")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    ranks
        .iter()
        .map(|&rank| {
            let entry = entries
                .iter()
                .find(|e| uint(e, "dp_rank").unwrap_or(0) == u64::from(rank));
            let load = entry.map_or_else(EngineLoad::default, |e| EngineLoad {
                running: uint(e, "num_running_reqs"),
                waiting: uint(e, "num_waiting_reqs"),
                kv_usage: e
                    .get("token_usage")
                    .and_then(Value::as_f64)
                    .filter(|u| u.is_finite() && *u >= 0.0)
                    .map(|u| u.min(1.0)),
                waiting_uncached_tokens: uint(e, "num_waiting_uncached_tokens"),
                used_tokens: uint(e, "num_used_tokens"),
                total_tokens: uint(e, "max_total_num_tokens").filter(|&t| t > 0),
                ..EngineLoad::default()
            });
            (rank, load)
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Trimmed from an SGLang 0.5.23 server's `/server_info` (two data-parallel ranks).
    pub(crate) const SERVER_INFO: &str = r#"{
        "model_path": "Qwen/Qwen3-0.6B", "tokenizer_path": "Qwen/Qwen3-0.6B",
        "served_model_name": "Qwen/Qwen3-0.6B", "host": "0.0.0.0", "port": 30000,
        "mem_fraction_static": 0.835, "max_running_requests": null,
        "chunked_prefill_size": 8192, "max_prefill_tokens": 16384, "page_size": 16,
        "tp_size": 1, "dp_size": 2, "enable_dp_attention": false,
        "kv_events_config": "{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}",
        "launch_command": "python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --dp-size 2 --page-size 16",
        "status": "ready", "max_total_num_tokens": 425984, "max_req_input_len": 40954,
        "startup_time": 1764612281.8, "hicache_object_layout": null,
        "kv_events": {"enabled": true},
        "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {"weight": 1.1, "kvcache": 3.25}}],
        "version": "0.5.23", "frontend": "python"
    }"#;

    /// Trimmed from an SGLang 0.5.23 server's `/v1/loads` (the default `include=all`).
    pub(crate) const LOADS: &str = r#"{
        "timestamp": "2026-12-01T14:05:11.204Z", "version": "0.5.23",
        "accelerator": "NVIDIA H100 80GB HBM3", "num_accelerators": 1,
        "loads": [
            {"timestamp": 1764612311.2, "dp_rank": 0, "num_running_reqs": 5, "num_waiting_reqs": 2,
             "num_waiting_uncached_tokens": 3072, "num_used_tokens": 8192, "num_total_tokens": 11264,
             "num_active_tokens": 11264, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 425984,
             "max_running_requests": 2048, "token_usage": 0.0192, "gen_throughput": 812.4,
             "cache_hit_rate": 0.41, "utilization": 0.0, "total_prefill_uncached_tokens": 120034,
             "total_prefill_busy_us": 9120031, "decode_moments": null,
             "memory": {"weight_gb": 1.1, "kv_cache_gb": 3.25, "graph_gb": 0.4, "token_capacity": 425984},
             "disaggregation": {"mode": "null", "prefill_bootstrap_queue_reqs": 0,
                                "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
             "queues": {"waiting": 2, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}},
            {"timestamp": 1764612311.2, "dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0,
             "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 0,
             "max_total_num_tokens": 425984, "token_usage": 0.0}
        ]
    }"#;

    #[test]
    fn server_info_gives_blocks_ranks_budget_and_version() {
        let info = info(&serde_json::from_str(SERVER_INFO).unwrap());
        assert_eq!(
            info,
            EngineInfo {
                model: Some("Qwen/Qwen3-0.6B".into()),
                block_size: Some(16),
                num_gpu_blocks: Some(425984 / 16),
                dp_size: Some(2),
                max_num_batched_tokens: Some(8192),
                version: Some("0.5.23".into()),
                bootstrap_port: None,
                lora_adapters: None,
                problems: Vec::new(),
            }
        );
    }

    #[test]
    fn a_prefill_server_gives_its_bootstrap_port() {
        let mut v: Value = serde_json::from_str(SERVER_INFO).unwrap();
        v["disaggregation_bootstrap_port"] = 8998.into();
        assert_eq!(
            info(&v).bootstrap_port,
            None,
            "mode null: not a prefill server"
        );
        v["disaggregation_mode"] = "decode".into();
        assert_eq!(info(&v).bootstrap_port, None);
        v["disaggregation_mode"] = "prefill".into();
        v["disaggregation_bootstrap_port"] = 9100.into();
        assert_eq!(info(&v).bootstrap_port, Some(9100));
    }

    #[test]
    fn missing_or_disabled_fields_stay_unknown() {
        let v: Value =
            serde_json::from_str(r#"{"chunked_prefill_size": -1, "max_prefill_tokens": 4096, "page_size": null, "max_total_num_tokens": 1000.0}"#)
                .unwrap();
        let i = info(&v);
        assert_eq!(i.max_num_batched_tokens, Some(4096));
        assert_eq!(
            (i.block_size, i.num_gpu_blocks, i.dp_size),
            (None, None, None)
        );
        assert_eq!(info(&Value::Null), EngineInfo::default());
    }

    #[test]
    fn negative_or_non_finite_loads_stay_unknown_not_zero() {
        let v: Value = serde_json::from_str(
            r#"{"loads": [{"dp_rank": 0, "num_running_reqs": -1, "num_waiting_reqs": 2.0, "token_usage": -0.5, "num_used_tokens": -3.5}]}"#,
        )
        .unwrap();
        let l = load(&v, &[0]).remove(0).1;
        assert_eq!(
            (l.running, l.waiting, l.kv_usage, l.used_tokens),
            (None, Some(2), None, None)
        );
    }

    #[test]
    fn loads_per_rank() {
        let loads = load(&serde_json::from_str(LOADS).unwrap(), &[0, 1, 2]);
        assert_eq!(
            loads[0],
            (
                0,
                EngineLoad {
                    running: Some(5),
                    waiting: Some(2),
                    kv_usage: Some(0.0192),
                    waiting_uncached_tokens: Some(3072),
                    used_tokens: Some(8192),
                    total_tokens: Some(425984),
                    ..EngineLoad::default()
                }
            )
        );
        assert_eq!(loads[1].1.running, Some(0));
        assert_eq!(loads[2], (2, EngineLoad::default()));
        assert_eq!(load(&Value::Null, &[0])[0].1, EngineLoad::default());
    }
}
