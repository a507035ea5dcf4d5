//! What the impersonated SGLang reports about itself as JSON, from the ranks' snapshots:
//! `/get_server_info` and `/v1/loads` (sglang/srt/entrypoints/http_server.py, v1_loads.py).
//! The Prometheus `/metrics` of both engines are in `metrics.rs`.

use std::time::Duration;

use serde_json::{Value, json};

use super::config::DisaggregationRole;
use super::rank::RankSnapshot;
use super::transfer::Transfers;
use super::{FaceSettings, SGLANG_VERSION};

/// A worker's disaggregation as SGLang reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Disaggregation {
    /// `--disaggregation-mode`: `null`, `prefill` or `decode`.
    pub mode: &'static str,
    /// A prefill's bootstrap port.
    pub bootstrap_port: Option<u16>,
    /// Hand-offs a prefill holds for its decodes.
    pub held: usize,
}

impl Disaggregation {
    pub fn of(t: &Transfers) -> Self {
        Self {
            mode: match t.role {
                DisaggregationRole::None => "null",
                DisaggregationRole::Prefill => "prefill",
                DisaggregationRole::Decode => "decode",
            },
            bootstrap_port: t.side_channel.as_ref().map(|(_, port)| *port),
            held: t.outbox.len(),
        }
    }
}

/// SGLang's `/get_server_info`: the resolved server arguments the mocker has an answer for
/// (the real one lists several hundred), the scheduler's handshake, the KV-event descriptor,
/// and one internal state per DP rank.
pub(crate) fn sglang_server_info(face: &FaceSettings, disagg: &Disaggregation) -> Value {
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
        "enable_metrics": true,
        "enable_cache_report": true,
        "load_balance_method": "round_robin",
        "disaggregation_mode": disagg.mode,
        "disaggregation_bootstrap_port": disagg.bootstrap_port.unwrap_or(8998),
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
pub(crate) fn sglang_loads(
    face: &FaceSettings,
    ranks: &[RankSnapshot],
    disagg: &Disaggregation,
    now: Duration,
) -> Value {
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
                    "mode": disagg.mode,
                    "prefill_bootstrap_queue_reqs": 0,
                    "prefill_inflight_queue_reqs": disagg.held,
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
}
