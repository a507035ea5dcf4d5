//! `default`: the KV-cache-aware cost model.
//!
//! ```text
//! prefill_blocks  = active_prefill_tokens / block_size + request_blocks
//! adjusted        = max(prefill_blocks − credit·device − host_weight·host − disk_weight·disk
//!                       − shared_cache_multiplier·shared_beyond_device, 0)
//! cost            = (prefill_load_scale·adjusted + decode_blocks) · preferred_taint_multiplier
//! ```
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
//! `prefill_load_scale` defaults to 64: an uncomputed prompt block costs an engine far more
//! than a block held by a decoding request, and at 1 the decode term moves follow-up turns
//! away from the worker holding their prefix. `overlap_score_credit` defaults to 3, above the
//! routing-concepts range of 0..=1: at 1 a cached prefix only offsets its own prefill, so a
//! follow-up turn leaves its worker as soon as that worker has a little queued prefill, and the
//! conversation ends up cached twice; at 3 a cached block also offsets two blocks of queued
//! prefill. On the Mooncake conversation trace that raises the hit rate from 88 % to 95 % of
//! the finite oracle with TTFT p50/p90/p99 no worse (BENCHMARKS.md, "Routing quality").

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
    /// Credit per device-resident overlap block, ≥ 0 (above 1 a cached block also offsets
    /// queued prefill; the adjusted prefill is clamped at 0). Default 3.0.
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
        WorkerInputs::CACHE | WorkerInputs::LOAD | WorkerInputs::PREFERRED_TAINT
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
        let prefill_blocks =
            load.active_prefill_tokens as f64 / block_size + f64::from(context.request_blocks());
        let credit = p.overlap_score_credit * f64::from(overlap.device)
            + p.host_cache_hit_weight * f64::from(overlap.host)
            + p.disk_cache_hit_weight * f64::from(overlap.disk)
            + p.shared_cache_multiplier * f64::from(overlap.shared_beyond_device_blocks());
        let adjusted = (prefill_blocks - credit).max(0.0);
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
                active_requests: 0,
                output_blocks: 0.0,
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
