//! The impersonated engines' Prometheus `/metrics`, from the ranks' snapshots. vLLM's: names,
//! help and labels of vllm/v1/metrics/loggers.py, exposed as prometheus_client does (labels
//! sorted, counters as `_total` and `_created`). SGLang's (served as with `--enable-metrics`):
//! a few series of sglang/srt/observability/metrics_collector.py, exposed as its
//! multiprocess collector does.

use std::fmt::Write as _;

use super::FaceSettings;
use super::rank::RankSnapshot;
use super::transfer::DisaggCounters;

/// vLLM's `FinishReason`s, in their order (vllm/v1/engine/__init__.py).
const VLLM_FINISH_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

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
    // Every finish reason's series exists from the start (the logger creates them all). A
    // client's abort is not among them: vLLM's output processor drops an aborted request's
    // state without recording its stats (vllm/v1/engine/output_processor.py,
    // `abort_requests`), so `finished_reason="abort"` counts only aborts the engine itself
    // makes (a pause in "abort" mode), which the mocker never does.
    let name = "vllm:request_success";
    let _ = writeln!(
        out,
        "# HELP {name} Count of successfully processed requests.\n# TYPE {name} counter"
    );
    for reason in VLLM_FINISH_REASONS {
        for s in ranks {
            let value = if reason == "length" {
                s.counters.finished
            } else {
                0
            };
            let l = labels(s.rank, &[("finished_reason", reason)]);
            let _ = writeln!(out, "{name}_total{{{l}}} {}", float(value as f64));
            let _ = writeln!(out, "{name}_created{{{l}}} {}", float(created));
        }
    }
    // With adapter slots, vLLM's LoRA info gauge: one series, current now (vLLM keeps the
    // earlier label sets too, each valued at the time it was last current; readers take the
    // newest). Without an `engine` label: vLLM mixes data-parallel ranks' into one.
    if let Some(slots) = ranks.first().and_then(|s| s.adapters.as_ref()) {
        let name = "vllm:lora_requests_info";
        let _ = writeln!(
            out,
            "# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge"
        );
        let _ = writeln!(
            out,
            "{name}{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
            slots.max_loaded,
            escape(&slots.loaded.join(",")),
            escape(&slots.waiting.join(",")),
            float(super::rank::unix_now().as_secs_f64()),
        );
    }
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

/// SGLang's `/metrics`: the scheduler's request gauges (one series per rank) and the
/// tokenizer's request counters (one per server). As its multiprocess collector writes them:
/// help `Multiprocess metric`, labels sorted, counters without `_created`, and a counter's
/// series only once it has counted. `sglang:num_aborted_requests_total` counts the aborts the
/// tokenizer sends (a client that left); `sglang:num_requests_total` counts every request that
/// ended, aborted ones included (the scheduler answers an abort with a finished output).
pub(crate) fn sglang_metrics(
    face: &FaceSettings,
    ranks: &[RankSnapshot],
    disagg: &DisaggCounters,
) -> String {
    let model = escape(&face.model);
    let mut out = String::new();
    let mut write = |name: &str, kind: &str, samples: &[(Vec<(&str, String)>, u64)]| {
        if samples.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "# HELP {name} Multiprocess metric\n# TYPE {name} {kind}"
        );
        let suffix = if kind == "counter" { "_total" } else { "" };
        for (labels, value) in samples {
            let mut labels = labels.clone();
            labels.push(("engine_type", "unified".into()));
            labels.push(("model_name", model.clone()));
            labels.sort_unstable();
            let l = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect::<Vec<_>>()
                .join(",");
            let _ = writeln!(out, "{name}{suffix}{{{l}}} {}", float(*value as f64));
        }
    };
    let scheduler = |s: &RankSnapshot| {
        let mut l = vec![
            ("moe_ep_rank", "0".to_string()),
            ("pp_rank", "0".into()),
            ("tp_rank", "0".into()),
        ];
        // SGLang labels its schedulers with a dp rank only when there are several.
        if face.dp_size > 1 {
            l.push(("dp_rank", s.rank.to_string()));
        }
        l
    };
    let per_rank = |value: &dyn Fn(&RankSnapshot) -> u64| -> Vec<_> {
        ranks.iter().map(|s| (scheduler(s), value(s))).collect()
    };
    write(
        "sglang:num_running_reqs",
        "gauge",
        &per_rank(&|s| s.load.active_requests),
    );
    write(
        "sglang:num_queue_reqs",
        "gauge",
        &per_rank(&|s| s.load.waiting_requests),
    );
    let sum = |value: &dyn Fn(&RankSnapshot) -> u64| ranks.iter().map(value).sum::<u64>();
    let ended = sum(&|s| s.counters.finished + s.counters.aborted);
    let streamed = sum(&|s| s.counters.streamed);
    let requests: Vec<_> = [("false", ended - streamed), ("true", streamed)]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(streaming, n)| (vec![("is_streaming", streaming.to_string())], n))
        .collect();
    write("sglang:num_requests", "counter", &requests);
    let aborted = sum(&|s| s.counters.aborted);
    let aborted: Vec<_> = (aborted > 0)
        .then(|| (Vec::new(), aborted))
        .into_iter()
        .collect();
    write("sglang:num_aborted_requests", "counter", &aborted);
    // A decode's failed hand-offs (disaggregation/decode.py counts both on the scheduler).
    for (name, n) in [
        ("sglang:num_bootstrap_failed_reqs", &disagg.bootstrap_failed),
        ("sglang:num_transfer_failed_reqs", &disagg.transfer_failed),
    ] {
        let n = n.load(std::sync::atomic::Ordering::Relaxed);
        let samples: Vec<_> = (n > 0).then(|| (Vec::new(), n)).into_iter().collect();
        write(name, "counter", &samples);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        assert_eq!(float(3.0), "3.0");
        assert_eq!(float(0.25), "0.25");
    }
}
