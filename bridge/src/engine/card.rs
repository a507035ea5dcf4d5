//! The engine's `WorkerCard`: the spec's overrides first, then what the engine reports.

use kvroute_common::messages::{WorkerCard, WorkerRole};
use kvroute_common::{DpRank, Names};

use crate::config::{EngineKind, EngineSpec};
use crate::engine_http::EngineInfo;

/// The card label naming the engine's kind (`vllm`, `sglang`).
pub const ENGINE_LABEL: &str = "kvroute.bridge/engine";

/// The card label giving an SGLang prefill server's bootstrap port (its host is the card's
/// `http_url` host): gateways send it to both hops of a disaggregated request.
pub const BOOTSTRAP_PORT_LABEL: &str = "kvroute.bridge/bootstrap-port";
/// SGLang's default `--disaggregation-bootstrap-port`.
const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// Facts neither the spec nor the engine gave; each names the flag and the YAML field to set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the engine does not report its {}: set {}", what(.missing), how(.missing))]
pub struct MissingFacts {
    pub missing: Vec<Fact>,
}

/// A card field that has no default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fact {
    Model,
    BlockSize,
    TotalKvBlocks,
}

impl Fact {
    fn what(self) -> &'static str {
        match self {
            Fact::Model => "model",
            Fact::BlockSize => "block size",
            Fact::TotalKvBlocks => "KV cache blocks",
        }
    }
    fn flag(self) -> &'static str {
        match self {
            Fact::Model => "--model (YAML: model)",
            Fact::BlockSize => "--block-size (YAML: block_size)",
            Fact::TotalKvBlocks => "--total-kv-blocks (YAML: total_kv_blocks)",
        }
    }
}

fn what(missing: &[Fact]) -> String {
    missing
        .iter()
        .map(|f| f.what())
        .collect::<Vec<_>>()
        .join(", ")
}

fn how(missing: &[Fact]) -> String {
    missing
        .iter()
        .map(|f| f.flag())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The card of `spec`'s engine serving `ranks` (consecutive, from `spec.dp_start_rank`).
pub fn build_card(
    spec: &EngineSpec,
    info: &EngineInfo,
    ranks: &[DpRank],
    names: &Names,
) -> Result<WorkerCard, MissingFacts> {
    let model = spec.model.clone().or_else(|| info.model.clone());
    let block_size = spec.block_size.or(info.block_size);
    let total_kv_blocks = spec.total_kv_blocks.or(info.num_gpu_blocks);
    let (Some(model), Some(block_size), Some(total_kv_blocks)) =
        (&model, block_size, total_kv_blocks)
    else {
        let mut missing = Vec::new();
        if model.is_none() {
            missing.push(Fact::Model);
        }
        if block_size.is_none() {
            missing.push(Fact::BlockSize);
        }
        if total_kv_blocks.is_none() {
            missing.push(Fact::TotalKvBlocks);
        }
        return Err(MissingFacts { missing });
    };
    let worker_id = spec.worker_id();
    let mut labels = spec.labels.clone();
    labels.insert(ENGINE_LABEL.to_owned(), spec.engine.to_string());
    if spec.engine == EngineKind::Sglang && spec.role == WorkerRole::Prefill {
        // The spec's label wins, then what the server says, then SGLang's default.
        let port = info.bootstrap_port.unwrap_or(SGLANG_BOOTSTRAP_PORT);
        labels
            .entry(BOOTSTRAP_PORT_LABEL.to_owned())
            .or_insert_with(|| port.to_string());
    }
    let software_version = match &info.version {
        Some(v) => format!("{} {v}", spec.engine),
        None => spec.engine.to_string(),
    };
    Ok(WorkerCard {
        v: Default::default(),
        worker_id,
        model: model.clone(),
        role: spec.role,
        block_size,
        total_kv_blocks,
        max_num_batched_tokens: spec
            .max_num_batched_tokens
            .or(info.max_num_batched_tokens)
            .unwrap_or(0),
        dp_start_rank: ranks.first().copied().unwrap_or(spec.dp_start_rank),
        dp_size: (ranks.len() as u32).max(1),
        taints: spec.taints.clone(),
        labels,
        request_subject: names.worker_requests(worker_id),
        software_version,
        http_url: Some(spec.engine_url.trim().trim_end_matches('/').to_owned()),
        kv_events: spec.kv_events,
        lora_adapters: card_adapters(info.lora_adapters.as_deref()),
    })
}

/// The engine's adapters as a card lists them: names a card cannot hold (empty, over
/// `WorkerCard::MAX_LORA_NAME_BYTES`) are left out, as no request can name them; more than
/// `WorkerCard::MAX_LORA_ADAPTERS` is `None` (not known: any adapter may be asked), which
/// only costs a 404 for an adapter the engine lacks.
pub fn card_adapters(adapters: Option<&[String]>) -> Option<Vec<String>> {
    let adapters: Vec<String> = adapters?
        .iter()
        .filter(|a| !a.is_empty() && a.len() <= WorkerCard::MAX_LORA_NAME_BYTES)
        .cloned()
        .collect();
    (adapters.len() <= WorkerCard::MAX_LORA_ADAPTERS).then_some(adapters)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_common::Namespace;

    fn spec(yaml: &str) -> EngineSpec {
        serde_norway::from_str(&format!(
            "engine: sglang\nengine_url: http://10.0.0.7:30000/\nzmq_endpoint: tcp://10.0.0.7:5557\n{yaml}"
        ))
        .unwrap()
    }

    fn names() -> Names {
        Names::new(&Namespace::new("t").unwrap())
    }

    fn info() -> EngineInfo {
        EngineInfo {
            model: Some("Qwen/Qwen3-0.6B".into()),
            block_size: Some(16),
            num_gpu_blocks: Some(26624),
            dp_size: Some(2),
            max_num_batched_tokens: Some(8192),
            version: Some("0.5.23".into()),
            bootstrap_port: None,
            lora_adapters: None,
            problems: Vec::new(),
        }
    }

    #[test]
    fn the_engines_facts_fill_what_the_spec_leaves_open() {
        let s = spec("labels: {zone: a}\ntaints: [gpu-h100]\n");
        let card = build_card(&s, &info(), &[0, 1], &names()).unwrap();
        assert_eq!(card.worker_id, s.worker_id());
        assert_eq!(card.model, "Qwen/Qwen3-0.6B");
        assert_eq!((card.block_size, card.total_kv_blocks), (16, 26624));
        assert_eq!(card.max_num_batched_tokens, 8192);
        assert_eq!((card.dp_start_rank, card.dp_size), (0, 2));
        assert_eq!(card.software_version, "sglang 0.5.23");
        assert_eq!(card.labels.get("zone").map(String::as_str), Some("a"));
        assert_eq!(
            card.labels.get(ENGINE_LABEL).map(String::as_str),
            Some("sglang")
        );
        assert_eq!(card.taints, ["gpu-h100"]);
        assert_eq!(card.request_subject, names().worker_requests(s.worker_id()));
        assert_eq!(card.http_url.as_deref(), Some("http://10.0.0.7:30000"));
        assert!(card.kv_events);
        assert_eq!(card.lora_adapters, None, "not known");
    }

    #[test]
    fn the_card_lists_the_engines_adapters_it_can_hold() {
        let mut i = info();
        let list = |names: &[&str]| Some(names.iter().map(|n| n.to_string()).collect());
        i.lora_adapters = list(&["poem", "sql"]);
        let card = build_card(&spec(""), &i, &[0], &names()).unwrap();
        assert_eq!(card.lora_adapters, list(&["poem", "sql"]));
        card.validate().unwrap();
        i.lora_adapters = list(&[]);
        let card = build_card(&spec(""), &i, &[0], &names()).unwrap();
        assert_eq!(card.lora_adapters, list(&[]), "serves none");
        let long = "x".repeat(WorkerCard::MAX_LORA_NAME_BYTES + 1);
        i.lora_adapters = list(&["sql", &long]);
        let card = build_card(&spec(""), &i, &[0], &names()).unwrap();
        assert_eq!(card.lora_adapters, list(&["sql"]), "no request can name it");
        i.lora_adapters = Some((0..=256).map(|n| format!("a{n}")).collect());
        let card = build_card(&spec(""), &i, &[0], &names()).unwrap();
        assert_eq!(card.lora_adapters, None, "too many to list: not known");
        card.validate().unwrap();
    }

    #[test]
    fn an_sglang_prefill_server_carries_its_bootstrap_port() {
        let mut i = info();
        let card = build_card(&spec(""), &i, &[0], &names()).unwrap();
        assert!(
            !card.labels.contains_key(BOOTSTRAP_PORT_LABEL),
            "aggregated"
        );
        let prefill = spec("role: prefill\n");
        let card = build_card(&prefill, &i, &[0], &names()).unwrap();
        assert_eq!(
            card.labels[BOOTSTRAP_PORT_LABEL], "8998",
            "SGLang's default"
        );
        i.bootstrap_port = Some(9100);
        let card = build_card(&prefill, &i, &[0], &names()).unwrap();
        assert_eq!(
            card.labels[BOOTSTRAP_PORT_LABEL], "9100",
            "what the server says"
        );
        let set = spec("role: prefill\nlabels: {kvroute.bridge/bootstrap-port: \"7000\"}\n");
        let card = build_card(&set, &i, &[0], &names()).unwrap();
        assert_eq!(
            card.labels[BOOTSTRAP_PORT_LABEL], "7000",
            "the spec's label"
        );
        let decode = spec("role: decode\n");
        let card = build_card(&decode, &i, &[0], &names()).unwrap();
        assert!(!card.labels.contains_key(BOOTSTRAP_PORT_LABEL));
    }

    #[test]
    fn an_engine_without_events_registers_so() {
        let s: EngineSpec = serde_norway::from_str(
            "engine: vllm\nengine_url: http://10.0.0.7:8000\nkv_events: false\n",
        )
        .unwrap();
        s.validate("engines[0]").unwrap();
        let card = build_card(&s, &info(), &[0], &names()).unwrap();
        assert!(!card.kv_events);
        assert_eq!(card.http_url.as_deref(), Some("http://10.0.0.7:8000"));
    }

    #[test]
    fn the_spec_overrides_the_engine() {
        let s = spec(
            "model: served\nblock_size: 64\ntotal_kv_blocks: 100\nmax_num_batched_tokens: 2048\ndp_start_rank: 4\n",
        );
        let card = build_card(&s, &info(), &[4], &names()).unwrap();
        assert_eq!(card.model, "served");
        assert_eq!((card.block_size, card.total_kv_blocks), (64, 100));
        assert_eq!(card.max_num_batched_tokens, 2048);
        assert_eq!((card.dp_start_rank, card.dp_size), (4, 1));
    }

    #[test]
    fn missing_facts_name_their_flags() {
        let unknown = EngineInfo {
            model: Some("m".into()),
            ..EngineInfo::default()
        };
        let e = build_card(&spec(""), &unknown, &[0], &names()).unwrap_err();
        assert_eq!(e.missing, [Fact::BlockSize, Fact::TotalKvBlocks]);
        assert_eq!(
            e.to_string(),
            "the engine does not report its block size, KV cache blocks: set --block-size (YAML: block_size), --total-kv-blocks (YAML: total_kv_blocks)"
        );
        let card = build_card(
            &spec("block_size: 16\ntotal_kv_blocks: 10\n"),
            &unknown,
            &[0],
            &names(),
        )
        .unwrap();
        assert_eq!(
            (card.max_num_batched_tokens, card.software_version.as_str()),
            (0, "sglang")
        );
        let e = build_card(&spec(""), &EngineInfo::default(), &[0], &names()).unwrap_err();
        assert_eq!(e.missing[0], Fact::Model);
    }
}
