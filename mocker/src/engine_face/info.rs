//! What the impersonated engines report about themselves, from the ranks' snapshots: vLLM's
//! Prometheus `/metrics` (names, help and labels of vllm/v1/metrics/loggers.py, exposed as
//! prometheus_client does: labels sorted, counters as `_total` and `_created`), SGLang's
//! `/get_server_info` and `/v1/loads` (sglang/srt/entrypoints/http_server.py, v1_loads.py).

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{Value, json};

use super::rank::RankSnapshot;
use super::{FaceSettings, SGLANG_VERSION};

/// vLLM's `/metrics`: scheduler gauges, cache and token counters, and `cache_config_info`.
pub(crate) fn vllm_metrics(face: &FaceSettings, ranks: &[RankSnapshot]) -> String {
    let model = escape(&face.model);
    // prometheus_client writes labels sorted by name.
    let labels = |rank: u32, extra: &[(&str, &str)]| {
        let rank = rank.to_string();
        let mut all = vec![("engine", rank.as_str()), ("model_name", model.as_str())];
        all.extend_from_slice(extra);
        all.sort_unstable();
        all.iter()
            .map(|(k, v)| format!("{k}=\"{v}\""))
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: &dyn Fn(&RankSnapshot) -> f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for s in ranks {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(s.rank, &[]), float(value(s)));
        }
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &|s| s.load.active_requests as f64,
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &|s| s.load.waiting_requests as f64,
    );
    // vLLM's usage counts idle cached blocks as free (they sit in its free queue).
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &|s| s.pinned_blocks as f64 / s.load.total_kv_blocks.max(1) as f64,
    );
    let created = face.started.as_secs_f64();
    let mut counter =
        |name: &str, help: &str, extra: &[(&str, &str)], value: &dyn Fn(&RankSnapshot) -> u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for s in ranks {
                let l = labels(s.rank, extra);
                let _ = writeln!(out, "{name}_total{{{l}}} {}", float(value(s) as f64));
                let _ = writeln!(out, "{name}_created{{{l}}} {}", float(created));
            }
        };
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        &[],
        &|s| s.counters.prompt_tokens,
    );
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        &[],
        &|s| s.counters.cached_tokens,
    );
    counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        &[],
        &|s| s.counters.prompt_tokens,
    );
    counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        &[],
        &|s| s.counters.generation_tokens,
    );
    counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        &[("finished_reason", "length")],
        &|s| s.counters.finished,
    );
    let name = "vllm:cache_config_info";
    let _ = writeln!(
        out,
        "# HELP {name} Information of the LLMEngine CacheConfig\n# TYPE {name} gauge"
    );
    for s in ranks {
        let _ = writeln!(out, "{name}{{{}}} 1.0", cache_config_labels(face, s.rank));
    }
    out
}

/// `CacheConfig.metrics_info()`: every field as `str(value)`, plus `engine`; sorted.
fn cache_config_labels(face: &FaceSettings, rank: u32) -> String {
    let c = &face.engine;
    let bs = c.block_size.to_string();
    let blocks = c.num_blocks.to_string();
    let tokens = (c.num_blocks * u64::from(c.block_size)).to_string();
    let rank = rank.to_string();
    let mut labels = vec![
        ("block_size", bs.as_str()),
        ("cache_dtype", "auto"),
        ("cache_hit_alignment_tokens", bs.as_str()),
        ("effective_attention_block_size", bs.as_str()),
        ("enable_mamba_shared_prefix_checkpoint", "False"),
        ("enable_prefix_caching", "True"),
        ("engine", rank.as_str()),
        ("gpu_memory_utilization", "0.92"),
        ("hash_block_size", bs.as_str()),
        ("is_attention_free", "False"),
        ("kv_cache_dtype_skip_layers", "[]"),
        ("kv_cache_layout", "None"),
        ("kv_cache_max_concurrency", "None"),
        ("kv_cache_memory_bytes", "None"),
        ("kv_cache_size_tokens", tokens.as_str()),
        ("kv_offloading_backend", "native"),
        ("kv_offloading_size", "None"),
        ("kv_sharing_fast_prefill", "False"),
        ("mamba_block_size", "None"),
        ("mamba_cache_dtype", "auto"),
        ("mamba_cache_mode", "none"),
        ("mamba_page_size_padded", "None"),
        ("mamba_ssm_cache_dtype", "auto"),
        ("num_cpu_blocks", "None"),
        ("num_gpu_blocks", blocks.as_str()),
        ("num_gpu_blocks_override", "None"),
        ("prefix_cache_retention_interval", "0"),
        ("prefix_caching_hash_algo", "sha256"),
        ("prefix_match_unit", "None"),
        ("replayssm_buffer_len", "16"),
        ("skip_page_size_padded", "None"),
        ("sliding_window", "None"),
        ("swa_bounded_replay", "True"),
        ("use_kda_recoverssm", "False"),
        ("use_replayssm", "False"),
        ("user_specified_block_size", "True"),
    ];
    labels.sort_unstable();
    labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{v}\""))
        .collect::<Vec<_>>()
        .join(",")
}

/// SGLang's `/get_server_info`: the resolved server arguments the mocker has an answer for
/// (the real one lists several hundred), the scheduler's handshake, the KV-event descriptor,
/// and one internal state per DP rank.
pub(crate) fn sglang_server_info(face: &FaceSettings) -> Value {
    let c = &face.engine;
    let tokens = c.num_blocks * u64::from(c.block_size);
    let kv_events_config = json!({
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{}", face.zmq_port),
        "replay_endpoint": format!("tcp://*:{}", face.replay_port),
        "topic": face.topic,
        "buffer_steps": face.replay_buffer,
    })
    .to_string();
    let internal_state = |rank: u32| {
        json!({
            "dp_rank": rank,
            "page_size": c.block_size,
            "dp_size": face.dp_size,
            "max_running_requests": c.max_num_seqs,
            "chunked_prefill_size": c.max_num_batched_tokens,
            "world_size": face.dp_size,
            "startup_time": face.started.as_secs_f64(),
            "effective_max_running_requests_per_dp": c.max_num_seqs,
            "last_gen_throughput": 0.0,
        })
    };
    json!({
        "model_path": face.model,
        "tokenizer_path": face.model,
        "served_model_name": face.model,
        "host": face.host.to_string(),
        "port": face.http_port,
        "page_size": c.block_size,
        "dp_size": face.dp_size,
        "tp_size": 1,
        "pp_size": 1,
        "chunked_prefill_size": c.max_num_batched_tokens,
        "max_prefill_tokens": c.max_num_batched_tokens,
        "max_running_requests": c.max_num_seqs,
        "max_total_tokens": tokens,
        "context_length": tokens,
        "schedule_policy": "fcfs",
        "disable_radix_cache": false,
        "enable_metrics": false,
        "enable_cache_report": true,
        "load_balance_method": "round_robin",
        "kv_events_config": kv_events_config,
        "launch_command": format!("kvroute-mocker --engine-api sglang --model {}", face.model),
        "status": "ready",
        "max_total_num_tokens": tokens,
        "max_req_input_len": tokens.saturating_sub(1),
        "startup_time": face.started.as_secs_f64(),
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": face.host.to_string(),
            "endpoint_port_base": face.zmq_port,
            "topic": face.topic,
            "block_size": c.block_size,
            "dp_size": face.dp_size,
            "replay_endpoint_port_base": face.replay_port,
        },
        "internal_states": (0..face.dp_size).map(internal_state).collect::<Vec<_>>(),
        "version": SGLANG_VERSION,
        "frontend": "python",
    })
}

/// SGLang's `/v1/loads` at `now` (since the Unix epoch): one `LoadSnapshot.to_dict()` per rank
/// (core fields, then the memory, disaggregation and queues sections a plain server fills).
pub(crate) fn sglang_loads(face: &FaceSettings, ranks: &[RankSnapshot], now: Duration) -> Value {
    let c = &face.engine;
    let page = u64::from(c.block_size);
    let capacity = c.num_blocks * page;
    let loads: Vec<Value> = ranks
        .iter()
        .map(|s| {
            let used = s.pinned_blocks * page;
            let counters = &s.counters;
            let hit_rate = if counters.prompt_tokens == 0 {
                0.0
            } else {
                counters.cached_tokens as f64 / counters.prompt_tokens as f64
            };
            // Waiting prompts' uncached tokens plus the chunked prefill's remainder.
            let pending = s.load.active_prefill_tokens;
            json!({
                "timestamp": now.as_secs_f64(),
                "dp_rank": s.rank,
                "num_running_reqs": s.load.active_requests,
                "num_waiting_reqs": s.load.waiting_requests,
                "num_waiting_uncached_tokens": pending,
                "num_used_tokens": used,
                "num_total_tokens": used + pending,
                "num_active_tokens": used + pending,
                "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": capacity,
                "max_running_requests": c.max_num_seqs,
                "token_usage": used as f64 / capacity.max(1) as f64,
                "gen_throughput": 0.0,
                "cache_hit_rate": hit_rate,
                "utilization": s.load.active_requests as f64 / f64::from(c.max_num_seqs),
                "total_prefill_uncached_tokens": counters.computed_tokens,
                "total_prefill_busy_us": 0,
                "decode_moments": null,
                "memory": {
                    "weight_gb": 0.0,
                    "kv_cache_gb": 0.0,
                    "graph_gb": 0.0,
                    "token_capacity": capacity,
                },
                "disaggregation": {
                    "mode": "null",
                    "prefill_bootstrap_queue_reqs": 0,
                    "prefill_inflight_queue_reqs": 0,
                    "decode_prealloc_queue_reqs": 0,
                    "decode_transfer_queue_reqs": 0,
                    "decode_retracted_queue_reqs": 0,
                    "kv_transfer_speed_gb_s": 0.0,
                    "kv_transfer_latency_ms": 0.0,
                },
                "queues": {
                    "waiting": s.load.waiting_requests,
                    "grammar": 0,
                    "paused": 0,
                    "retracted": 0,
                    "prealloc_ready": 0,
                },
            })
        })
        .collect();
    json!({
        "timestamp": iso8601(now),
        "version": SGLANG_VERSION,
        "accelerator": null,
        "num_accelerators": 1,
        "loads": loads,
    })
}

/// A float as Python prints it for integral values (`3.0`); otherwise Rust's shortest form.
fn float(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('\n', r"\n")
        .replace('"', "\\\"")
}

/// `datetime.now(timezone.utc).isoformat()`: `2026-01-31T12:34:56.789012+00:00`.
pub(crate) fn iso8601(since_epoch: Duration) -> String {
    let secs = since_epoch.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}+00:00",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since_epoch.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_dates() {
        assert_eq!(iso8601(Duration::ZERO), "1970-01-01T00:00:00.000000+00:00");
        assert_eq!(
            iso8601(Duration::from_micros(1_709_210_096_123_456)),
            "2024-02-29T12:34:56.123456+00:00"
        );
    }

    #[test]
    fn floats_print_like_python() {
        assert_eq!(float(3.0), "3.0");
        assert_eq!(float(0.25), "0.25");
    }
}
