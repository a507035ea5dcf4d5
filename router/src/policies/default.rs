//! `default`: the KV-cache-aware cost model.
//!
//! ```text
//! queued_blocks   = active_prefill_tokens / block_size + unsized_waiting · request_blocks
//! own             = max(request_blocks − min(credit, 1)·device − host_weight·host
//!                       − disk_weight·disk − shared_cache_multiplier·shared_beyond_device, 0)
//! adapter         = adapter_miss_blocks · (1 − affinity)      (requests naming a LoRA adapter)
//! adjusted        = own + adapter + max(queued_blocks − max(credit − 1, 0)·device, 0)
//! cost            = (prefill_load_scale·adjusted + decode_blocks) · preferred_taint_multiplier
//! ```
//!
//! This is routing-concepts' `adjusted_prefill_blocks = max(prefill_blocks − credit·overlap, 0)`
//! with `prefill_blocks = queued_blocks + request_blocks`, unchanged for a credit in its range
//! 0..=1. A credit above 1 is split: up to 1 per cached block offsets the request's own prefill,
//! the rest only the queued prefill, each part clamped at 0 on its own. So a cached block
//! always lowers the cost: a worker holding more of the prompt wins whenever load is otherwise
//! equal. (With one clamp over the sum, credit 3 and no queued prefill, any worker holding a
//! third of the prompt cost 0 prefill, the costs tied and a random worker won.)
//!
//! `unsized_waiting` is the rank's waiting requests whose tokens its report does not count
//! (`ObservedLoad::unsized_waiting_requests`: vLLM reports waiting requests but not their
//! tokens); each is charged as a prompt the size of this one.
//!
//! `decode_blocks` is the rank's active decode blocks plus the request's blocks. The overlap
//! tiers are disjoint (the index counts each leading block in the best tier holding it), so no
//! block is credited twice by them. `shared_beyond_device` (`Overlap::shared_beyond_device_blocks`:
//! the prompt's shared-tier prefix past the rank's device prefix) is not disjoint from host and
//! disk: a block a rank holds in host memory that is also in the shared tier earns both credits,
//! so keep `shared_cache_multiplier` at most what loading a block from the shared tier saves,
//! which is less than a host hit saves. Off (0) by default. Temperature 0 picks the lowest cost (costs within `tie_tolerance`
//! of it tie, and a tie goes to a random one of them, seeded); above 0 it samples.
//!
//! `affinity` is how the rank stands for the request's LoRA adapter (`AdapterAffinity`: 1
//! resident, 0.8 a free slot, 0.6 waiting, 0 every slot taken), from the load view's LRU of the
//! adapters decisions sent each rank and its reports listed (`load_view::adapters`); a rank
//! that reports no adapter slots counts as a free slot. Loading an adapter delays the request like prefill does, so the term is in
//! prompt blocks: `adapter_miss_blocks` (default 16) is what a load into a full rank costs.
//! It keeps an adapter's requests together, but a rank holding the adapter still loses to an
//! idle one once it has that many blocks more of queued prefill. 0 turns it off (the policy then
//! does not read the adapter signal).
//!
//! `prefill_load_scale` defaults to 64: an uncomputed prompt block costs an engine far more
//! than a block held by a decoding request, and at 1 the decode term moves follow-up turns
//! away from the worker holding their prefix. `overlap_score_credit` defaults to 3, above the
//! routing-concepts range of 0..=1: at 1 a cached prefix only offsets its own prefill, so a
//! follow-up turn leaves its worker as soon as that worker has a little queued prefill, and the
//! conversation ends up cached twice; at 3 a cached block also offsets two blocks of queued
//! prefill (BENCHMARKS.md, "Routing quality").

use std::sync::Arc;

use serde::Deserialize;

use super::pickers::SoftmaxPicker;
use crate::pipeline::{
    ComponentError, WorkerCandidate, WorkerInputs, WorkerScorer, WorkerSelectionPolicy,
};
use crate::registry::{PolicyFactory, PolicyParameters, ProviderError};
use crate::request::RequestContext;

/// The cost model's knobs. Every field is optional in YAML.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DefaultPolicyParameters {
    /// Credit per device-resident overlap block, ≥ 0 (up to 1 offsets the request's own
    /// prefill; the rest offsets queued prefill, clamped at 0). Default 3.0.
    pub overlap_score_credit: f64,
    /// Credit per overlap block whose best tier is host memory, 0..=1. Default 0.75.
    pub host_cache_hit_weight: f64,
    /// Credit per overlap block whose best tier is disk, 0..=1. Default 0.5.
    pub disk_cache_hit_weight: f64,
    /// Credit per block of the prompt's shared-tier prefix beyond the rank's device prefix
    /// (`shared_beyond_device_blocks`), ≥ 0. Default 0: shared-cache hits are not credited.
    pub shared_cache_multiplier: f64,
    /// Weight of the adjusted prefill blocks relative to decode blocks, ≥ 0. Default 64.
    pub prefill_load_scale: f64,
    /// 0: lowest cost; above 0: softmax sampling. Default 0.
    pub temperature: f64,
    /// Prompt blocks that loading the request's LoRA adapter into a rank with no free slot
    /// costs (scaled by `1 − affinity`), ≥ 0. Default 16; 0: adapters are not considered.
    pub adapter_miss_blocks: f64,
    /// At temperature 0, costs within this fraction of the lowest tie (a tie is broken at
    /// random), ≥ 0. Default 0 (only equal costs tie); 0.02–0.05 spreads bursts of requests
    /// that several router replicas receive at the same moment.
    pub tie_tolerance: f64,
}

impl Default for DefaultPolicyParameters {
    fn default() -> Self {
        Self {
            overlap_score_credit: 3.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.5,
            shared_cache_multiplier: 0.0,
            prefill_load_scale: 64.0,
            adapter_miss_blocks: 16.0,
            temperature: 0.0,
            tie_tolerance: 0.0,
        }
    }
}

impl DefaultPolicyParameters {
    pub fn validate(&self) -> Result<(), ProviderError> {
        let fields = [
            ("overlap_score_credit", self.overlap_score_credit, None),
            (
                "host_cache_hit_weight",
                self.host_cache_hit_weight,
                Some(1.0),
            ),
            (
                "disk_cache_hit_weight",
                self.disk_cache_hit_weight,
                Some(1.0),
            ),
            (
                "shared_cache_multiplier",
                self.shared_cache_multiplier,
                None,
            ),
            ("prefill_load_scale", self.prefill_load_scale, None),
            ("adapter_miss_blocks", self.adapter_miss_blocks, None),
            ("temperature", self.temperature, None),
            ("tie_tolerance", self.tie_tolerance, None),
        ];
        for (name, value, max) in fields {
            if !value.is_finite() || value < 0.0 || max.is_some_and(|m| value > m) {
                let range = max.map_or("a finite number ≥ 0".to_owned(), |m| {
                    format!("in 0..={m}")
                });
                return Err(ProviderError::new(format!(
                    "{name} must be {range}, got {value}"
                )));
            }
        }
        Ok(())
    }

    /// The policy these parameters describe.
    pub fn policy(&self) -> WorkerSelectionPolicy {
        WorkerSelectionPolicy::new(
            vec![
                Box::new(PrefillCostScorer { parameters: *self }),
                Box::new(DecodeCostScorer),
            ],
            Box::new(SoftmaxPicker {
                temperature: self.temperature,
                tie_tolerance: self.tie_tolerance,
            }),
        )
        .named(super::DEFAULT_TYPE)
    }
}

/// The provider registered as `default`.
pub fn provider(parameters: &PolicyParameters) -> Result<PolicyFactory, ProviderError> {
    let parameters: DefaultPolicyParameters = parameters.deserialize()?;
    parameters.validate()?;
    Ok(Arc::new(move |_context| Ok(parameters.policy())))
}

fn taint_multiplier(candidate: &WorkerCandidate<'_>) -> f64 {
    candidate.preferred_taint_multiplier().unwrap_or(1.0)
}

/// `prefill_load_scale · adjusted_prefill_blocks`, term `prefill`.
#[derive(Debug, Clone, Copy)]
pub struct PrefillCostScorer {
    pub parameters: DefaultPolicyParameters,
}

impl WorkerScorer for PrefillCostScorer {
    fn name(&self) -> &str {
        "prefill"
    }

    fn required_inputs(&self) -> WorkerInputs {
        let inputs = WorkerInputs::CACHE | WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT;
        if self.parameters.adapter_miss_blocks > 0.0 {
            inputs | WorkerInputs::ADAPTER
        } else {
            inputs
        }
    }

    fn score(
        &mut self,
        context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<f64, ComponentError> {
        let p = &self.parameters;
        let overlap = candidate.cache().ok_or(ComponentError::MissingInput {
            group: WorkerInputs::CACHE,
        })?;
        let load = candidate.load().ok_or(ComponentError::MissingInput {
            group: WorkerInputs::LOAD,
        })?;
        let block_size = f64::from(context.block_size().max(1));
        let request_blocks = f64::from(context.request_blocks());
        let queued_blocks = load.active_prefill_tokens as f64 / block_size
            + load.unsized_waiting_requests as f64 * request_blocks;
        let device = f64::from(overlap.device);
        let own_credit = p.overlap_score_credit.min(1.0) * device
            + p.host_cache_hit_weight * f64::from(overlap.host)
            + p.disk_cache_hit_weight * f64::from(overlap.disk)
            + p.shared_cache_multiplier * f64::from(overlap.shared_beyond_device_blocks());
        let queued_credit = (p.overlap_score_credit - 1.0).max(0.0) * device;
        // `None`: no adapter named, or the signal not read (adapter_miss_blocks 0).
        let adapter = candidate
            .adapter()
            .map_or(0.0, |a| p.adapter_miss_blocks * (1.0 - a.score()));
        let adjusted = (request_blocks - own_credit).max(0.0)
            + adapter
            + (queued_blocks - queued_credit).max(0.0);
        Ok(p.prefill_load_scale * adjusted * taint_multiplier(candidate))
    }
}

/// Projected decode blocks, term `decode`.
#[derive(Debug, Clone, Copy)]
pub struct DecodeCostScorer;

impl WorkerScorer for DecodeCostScorer {
    fn name(&self) -> &str {
        "decode"
    }

    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT
    }

    fn score(
        &mut self,
        _context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<f64, ComponentError> {
        let load = candidate.load().ok_or(ComponentError::MissingInput {
            group: WorkerInputs::LOAD,
        })?;
        Ok(load.decode_cost_blocks * taint_multiplier(candidate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::LoadSignals;
    use crate::signals::{ObservedLoad, Overlap};
    use crate::testing::card;
    use crate::worker::WorkerRank;

    /// The cost at `prefill_load_scale` 1 (the seed document's worked example).
    fn cost(overlap: Overlap, decode: u64, prefill_tokens: u64) -> f64 {
        let card = card(1);
        let ctx = RequestContext::new(10, 16);
        let load = LoadSignals::project(
            Some(ObservedLoad {
                active_prefill_tokens: prefill_tokens,
                active_decode_blocks: decode,
                ..ObservedLoad::default()
            }),
            0,
        );
        let row = WorkerCandidate::new(WorkerRank::new(1, 0), &card)
            .with_cache(overlap)
            .with_load(load);
        // The routing-concepts worked example: scale 1, credit 1.
        let mut policy = DefaultPolicyParameters {
            prefill_load_scale: 1.0,
            overlap_score_credit: 1.0,
            ..DefaultPolicyParameters::default()
        }
        .policy();
        policy.score_exact(&ctx, row).unwrap().cost.total
    }

    fn device(blocks: u32) -> Overlap {
        Overlap {
            device: blocks,
            ..Overlap::default()
        }
    }

    #[test]
    fn the_worked_example_of_the_cost_model() {
        // 10 request blocks, credit 1.0 (decode here excludes the request's own blocks).
        assert_eq!(cost(device(2), 10, 0), 18.0);
        assert_eq!(cost(device(5), 5, 0), 10.0);
        assert_eq!(cost(device(8), 9, 0), 11.0);
    }

    #[test]
    fn active_prefill_counts_in_blocks_and_lower_tiers_earn_partial_credit() {
        assert_eq!(cost(device(0), 0, 32), 12.0, "32 tokens = 2 blocks");
        let tiers = Overlap {
            device: 2,
            host: 4,
            disk: 4,
            shared: 0,
            cached_blocks: 0,
        };
        // 10 - 2 - 0.75·4 - 0.5·4 = 3
        assert_eq!(cost(tiers, 0, 0), 3.0);
        assert_eq!(cost(device(20), 0, 0), 0.0, "clamped at zero");
    }

    /// The cost with `shared_cache_multiplier` = `multiplier` (scale 1, credit 1).
    fn cost_with_shared(overlap: Overlap, decode: u64, multiplier: f64) -> f64 {
        let card = card(1);
        let ctx = RequestContext::new(10, 16);
        let load = LoadSignals::project(
            Some(ObservedLoad {
                active_decode_blocks: decode,
                ..ObservedLoad::default()
            }),
            0,
        );
        let row = WorkerCandidate::new(WorkerRank::new(1, 0), &card)
            .with_cache(overlap)
            .with_load(load);
        let mut policy = DefaultPolicyParameters {
            prefill_load_scale: 1.0,
            overlap_score_credit: 1.0,
            shared_cache_multiplier: multiplier,
            ..DefaultPolicyParameters::default()
        }
        .policy();
        policy.score_exact(&ctx, row).unwrap().cost.total
    }

    #[test]
    fn shared_hits_beyond_the_device_prefix_reduce_the_prefill_inside_the_clamp() {
        let shared = |device, shared| Overlap {
            device,
            shared,
            ..Overlap::default()
        };
        // Off by default: the shared tier changes nothing.
        assert_eq!(cost(shared(2, 8), 0, 0), 8.0);
        assert_eq!(cost_with_shared(shared(2, 8), 0, 0.0), 8.0);
        // 10 − 1·2 − 0.5·(8 − 2) = 5.
        assert_eq!(shared(2, 8).shared_beyond_device_blocks(), 6);
        assert_eq!(cost_with_shared(shared(2, 8), 0, 0.5), 5.0);
        // A device prefix deeper than the shared one: nothing beyond it.
        assert_eq!(shared(9, 4).shared_beyond_device_blocks(), 0);
        assert_eq!(cost_with_shared(shared(9, 4), 3, 0.5), 1.0 + 3.0);
        // No device overlap: the whole shared prefix counts; the clamp holds (decode 3 stays).
        assert_eq!(cost_with_shared(shared(0, 10), 3, 0.5), 5.0 + 3.0);
        assert_eq!(cost_with_shared(shared(0, 10), 3, 2.0), 3.0);
        // Host and disk are not device: their blocks also earn the shared credit.
        let tiers = Overlap {
            device: 2,
            host: 4,
            disk: 0,
            shared: 6,
            cached_blocks: 0,
        };
        // 10 − 2 − 0.75·4 − 0.25·(6 − 2) = 4.
        assert_eq!(cost_with_shared(tiers, 0, 0.25), 4.0);
    }

    /// The default parameters' cost of one rank; `waiting` are unsized waiting requests.
    fn default_cost(device_blocks: u32, prefill_tokens: u64, waiting: u64, decode: u64) -> f64 {
        let card = card(1);
        let ctx = RequestContext::new(12, 16);
        let load = LoadSignals::project(
            Some(ObservedLoad {
                active_prefill_tokens: prefill_tokens,
                active_decode_blocks: decode,
                unsized_waiting_requests: waiting,
                ..ObservedLoad::default()
            }),
            12,
        );
        let row = WorkerCandidate::new(WorkerRank::new(1, 0), &card)
            .with_cache(device(device_blocks))
            .with_load(load);
        let mut policy = DefaultPolicyParameters::default().policy();
        policy.score_exact(&ctx, row).unwrap().cost.total
    }

    #[test]
    fn more_cached_prompt_costs_less_when_load_is_equal() {
        // A 12-block prompt at the default credit 3. With one clamp over the sum every overlap
        // of 4 blocks or more cost 0 prefill, so a worker holding 4 tied with one holding 12.
        for (queued_tokens, waiting, decode) in [(0, 0, 0), (0, 0, 40), (16 * 5, 0, 7), (0, 2, 3)] {
            let costs: Vec<f64> = (0..=12)
                .map(|d| default_cost(d, queued_tokens, waiting, decode))
                .collect();
            assert!(
                costs.windows(2).all(|w| w[1] < w[0]),
                "queued {queued_tokens} waiting {waiting} decode {decode}: {costs:?}"
            );
        }
        // Idle ranks: 64 per uncached block of the prompt, plus its 12 decode blocks.
        assert_eq!(default_cost(4, 0, 0, 0), 64.0 * 8.0 + 12.0);
        assert_eq!(default_cost(12, 0, 0, 0), 12.0);
    }

    #[test]
    fn credit_above_one_offsets_queued_prefill_but_no_more() {
        // 10 cached blocks at credit 3 also offset 20 blocks of queued prefill.
        let queued = |blocks: u64| blocks * 16;
        assert_eq!(default_cost(10, queued(15), 0, 0), 64.0 * 2.0 + 12.0);
        assert_eq!(default_cost(10, queued(20), 0, 0), 64.0 * 2.0 + 12.0);
        assert_eq!(default_cost(10, queued(25), 0, 0), 64.0 * 7.0 + 12.0);
        // So a long cached prefix outweighs a short queue, not a long one.
        let idle_uncached = default_cost(0, 0, 0, 0);
        assert!(default_cost(10, queued(15), 0, 0) < idle_uncached);
        assert!(default_cost(10, queued(40), 0, 0) > idle_uncached);
    }

    #[test]
    fn unsized_waiting_requests_count_as_prompts_of_this_size() {
        // 2 waiting requests of unknown size: 24 queued blocks, as if 24 blocks of tokens.
        assert_eq!(default_cost(0, 0, 2, 0), default_cost(0, 24 * 16, 0, 0));
        assert_eq!(default_cost(0, 0, 2, 0), 64.0 * 36.0 + 12.0);
        // A cached prefix offsets them like any queued prefill.
        assert_eq!(default_cost(12, 0, 2, 0), default_cost(12, 24 * 16, 0, 0));
    }

    #[test]
    fn the_worker_holding_the_longer_prefix_wins_every_seed() {
        let cards = [card(1), card(2), card(3)];
        let ctx = RequestContext::new(12, 16);
        for seed in 0..64 {
            let rows = cards
                .iter()
                .zip([4, 11, 6])
                .map(|(c, d)| {
                    WorkerCandidate::new(WorkerRank::new(c.worker_id, 0), c)
                        .with_cache(device(d))
                        .with_load(LoadSignals::project(None, 12))
                })
                .collect();
            let mut policy = DefaultPolicyParameters::default().policy();
            let mut rng = rand::SeedableRng::seed_from_u64(seed);
            let picked: &mut rand::rngs::StdRng = &mut rng;
            let selection = policy.run(&ctx, rows, picked).unwrap();
            assert_eq!(selection.row.worker().worker_id, 2, "seed {seed}");
        }
    }

    #[test]
    fn parameters_are_validated() {
        let bad = |yaml: &str| provider(&PolicyParameters::from_yaml(yaml).unwrap()).err();
        assert!(bad("overlap_score_credit: 2.0").is_none());
        assert!(
            bad("host_cache_hit_weight: 1.5")
                .unwrap()
                .message
                .contains("host_cache_hit_weight")
        );
        assert!(bad("temperature: -1").is_some());
        assert!(bad("shared_cache_multiplier: 0.8").is_none());
        assert!(
            bad("shared_cache_multiplier: -0.5")
                .unwrap()
                .message
                .contains("shared_cache_multiplier")
        );
        assert!(bad("shared_cache_multiplier: .nan").is_some());
        assert!(
            bad("tie_tolerance: -0.1")
                .unwrap()
                .message
                .contains("tie_tolerance")
        );
        assert!(bad("temprature: 1").unwrap().message.contains("temprature"));
        assert!(bad("").is_none());
    }
}
