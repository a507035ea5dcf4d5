//! What vLLM's `/metrics` says about its cache and its load (names as vLLM 0.32's
//! `vllm/v1/metrics/loggers.py` registers them). Per-engine series carry
//! `engine="<data-parallel rank>"` and `model_name`; a series without `engine` (older
//! versions) is taken to describe the first rank.

use kvroute_common::DpRank;

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

fn wanted(name: &str) -> bool {
    matches!(
        name,
        RUNNING | WAITING | KV_USAGE | KV_USAGE_OLD | CACHE_CONFIG | PREFIX_QUERIES | PREFIX_HITS
    )
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
