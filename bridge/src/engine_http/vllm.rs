//! What vLLM's `/metrics` says about its cache and its load (names as vLLM 0.32's
//! `vllm/v1/metrics/loggers.py` registers them). Per-engine series carry
//! `engine="<data-parallel rank>"` and `model_name`; a series without `engine` (older
//! versions) is taken to describe the first rank.

use kvroute_common::DpRank;
use kvroute_common::messages::AdapterSlots;

use super::prometheus::{Exposition, Sample, parse};
use super::{EngineInfo, EngineLoad};

pub const RUNNING: &str = "vllm:num_requests_running";
pub const WAITING: &str = "vllm:num_requests_waiting";
pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// The name of [`KV_USAGE`] before vLLM 0.10.
pub const KV_USAGE_OLD: &str = "vllm:gpu_cache_usage_perc";
/// Counters of prompt tokens looked up in the prefix cache, and of those found.
pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
/// An info gauge (always 1): every `CacheConfig` field is a label, values as Python's `str()`.
pub const CACHE_CONFIG: &str = "vllm:cache_config_info";
/// With LoRA enabled: one series per combination of labels `running_lora_adapters` and
/// `waiting_lora_adapters` (comma-separated names) and `max_lora` ever seen, whose value is
/// the time it was last current (`set_to_current_time`): the newest series is the state now.
/// It has no `engine` label: with several data-parallel ranks it mixes theirs.
pub const LORA_INFO: &str = "vllm:lora_requests_info";

fn wanted(name: &str) -> bool {
    matches!(
        name,
        RUNNING
            | WAITING
            | KV_USAGE
            | KV_USAGE_OLD
            | CACHE_CONFIG
            | PREFIX_QUERIES
            | PREFIX_HITS
            | LORA_INFO
    )
}

/// The adapter slots `lora_requests_info` says the engine has now (its newest series):
/// running requests' adapters as the resident ones (vLLM does not list idle resident
/// adapters there), waiting requests' adapters that are not running, and `max_lora`. `None`
/// without the gauge (LoRA disabled) or when its newest series has no readable `max_lora`.
pub fn adapters(page: &Exposition<'_>) -> Option<AdapterSlots> {
    let newest = page
        .named(LORA_INFO)
        .filter(|s| s.value.is_finite())
        .max_by(|a, b| a.value.total_cmp(&b.value))?;
    let max_loaded = newest.label("max_lora")?.trim().parse::<u32>().ok()?;
    let names = |label: &str| -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for name in newest.label(label).unwrap_or("").split(',').map(str::trim) {
            if !name.is_empty() && !out.iter().any(|n| n == name) {
                out.push(name.to_owned());
            }
        }
        out.truncate(AdapterSlots::MAX_NAMES);
        out
    };
    let loaded = names("running_lora_adapters");
    let mut waiting = names("waiting_lora_adapters");
    waiting.retain(|name| !loaded.contains(name));
    Some(AdapterSlots {
        loaded,
        waiting,
        max_loaded,
    })
}

/// Parses a `/metrics` page, keeping only the series the bridge reads.
pub fn parse_page(text: &str) -> Exposition<'_> {
    parse(text, wanted)
}

/// The cache facts of `cache_config_info` (the first engine's; every rank has the same).
/// `"None"` (not yet profiled) or a missing label leaves the field unknown.
pub fn info(page: &Exposition<'_>) -> EngineInfo {
    let Some(config) = page.named(CACHE_CONFIG).next() else {
        return EngineInfo::default();
    };
    let number = |label: &str| {
        config
            .label(label)
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    EngineInfo {
        block_size: number("block_size").and_then(|b| u32::try_from(b).ok()),
        num_gpu_blocks: number("num_gpu_blocks"),
        ..EngineInfo::default()
    }
}

/// The load of each rank of `ranks`; a rank vLLM has no series for gets an all-unknown load.
pub fn load(page: &Exposition<'_>, ranks: &[DpRank]) -> Vec<(DpRank, EngineLoad)> {
    let first = ranks.first().copied().unwrap_or(0);
    let value = |name: &str, rank: DpRank| -> Option<f64> {
        let of_rank = |s: &&Sample<'_>| match s.label("engine") {
            Some(e) => e.trim().parse::<DpRank>().ok() == Some(rank),
            None => rank == first,
        };
        page.named(name)
            .find(of_rank)
            .map(|s| s.value)
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    ranks
        .iter()
        .map(|&rank| {
            let count = |name| value(name, rank).map(|v| v.round() as u64);
            let kv_usage = value(KV_USAGE, rank)
                .or_else(|| value(KV_USAGE_OLD, rank))
                .map(|u| u.min(1.0));
            let load = EngineLoad {
                running: count(RUNNING),
                waiting: count(WAITING),
                kv_usage,
                prefix_cache_queries: count(PREFIX_QUERIES),
                prefix_cache_hits: count(PREFIX_HITS),
                // The gauge mixes the ranks of a data-parallel engine: only a lone rank's.
                adapters: if ranks.len() == 1 {
                    adapters(page)
                } else {
                    None
                },
                ..EngineLoad::default()
            };
            (rank, load)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_http::prometheus::tests::VLLM_PAGE;

    #[test]
    fn cache_facts_from_the_info_gauge() {
        let info = info(&parse_page(VLLM_PAGE));
        assert_eq!(info.block_size, Some(16));
        assert_eq!(info.num_gpu_blocks, Some(27153));
        assert_eq!(info.dp_size, None, "vLLM's /metrics does not say");
    }

    /// As prometheus_client prints vLLM's info gauge after three scheduler states: one series
    /// per label set, valued at the time it was last current.
    const LORA_PAGE: &str = "\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7649e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,chat\",waiting_lora_adapters=\"chat,math\"} 1.7649000052e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} 1.7649000031e+09
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0
";

    #[test]
    fn adapter_slots_come_from_the_newest_lora_series() {
        let page = parse_page(LORA_PAGE);
        let slots = adapters(&page).unwrap();
        assert_eq!(slots.loaded, ["sql", "chat"]);
        assert_eq!(slots.waiting, ["math"], "running adapters are not waiting");
        assert_eq!(slots.max_loaded, 2);
        assert_eq!(load(&page, &[0])[0].1.adapters, Some(slots));
        // Data-parallel ranks: the gauge mixes them, so no rank gets it.
        assert!(
            load(&page, &[0, 1])
                .iter()
                .all(|(_, l)| l.adapters.is_none())
        );
        // LoRA disabled (no gauge), or no readable max_lora: nothing.
        assert_eq!(adapters(&parse_page(VLLM_PAGE)), None);
        let bad = "vllm:lora_requests_info{max_lora=\"None\",running_lora_adapters=\"a\"} 5\n";
        assert_eq!(adapters(&parse_page(bad)), None);
    }

    #[test]
    fn unprofiled_or_missing_labels_stay_unknown() {
        let text = "vllm:cache_config_info{num_gpu_blocks=\"None\",engine=\"0\"} 1.0\n";
        let info = info(&parse_page(text));
        assert_eq!((info.block_size, info.num_gpu_blocks), (None, None));
        assert_eq!(super::info(&parse_page("")), EngineInfo::default());
    }

    #[test]
    fn per_engine_series_become_per_rank_loads() {
        let loads = load(&parse_page(VLLM_PAGE), &[0, 1, 2]);
        assert_eq!(
            loads[0],
            (
                0,
                EngineLoad {
                    running: Some(3),
                    waiting: Some(2),
                    kv_usage: Some(0.25),
                    prefix_cache_queries: Some(42120),
                    ..EngineLoad::default()
                }
            )
        );
        assert_eq!(loads[0].1.computed_prompt_tokens(), Some(42120));
        assert_eq!(loads[1].1.computed_prompt_tokens(), None);
        assert_eq!(
            (loads[1].1.running, loads[1].1.waiting, loads[1].1.kv_usage),
            (Some(1), Some(0), Some(0.0625))
        );
        assert_eq!(loads[2], (2, EngineLoad::default()), "no series for rank 2");
    }

    #[test]
    fn unlabelled_series_and_the_old_usage_name_describe_the_first_rank() {
        let text = "vllm:num_requests_running{model_name=\"m\"} 4\n\
                    vllm:num_requests_waiting{model_name=\"m\"} 1\n\
                    vllm:gpu_cache_usage_perc{model_name=\"m\"} 1.5\n";
        let loads = load(&parse_page(text), &[3, 4]);
        assert_eq!(
            (loads[0].1.running, loads[0].1.waiting, loads[0].1.kv_usage),
            (Some(4), Some(1), Some(1.0))
        );
        assert_eq!(loads[1].1, EngineLoad::default());
        let nan = load(&parse_page("vllm:num_requests_running NaN\n"), &[0]);
        assert_eq!(nan[0].1.running, None);
    }
}
