//! The simulated engine's parameters: cache size, batch limits and the step-time model.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Parameters of one simulated engine. Defaults approximate an ~8B model on one 80 GB GPU
/// (KV ≈ 128 KiB per token, so about 0.5 M tokens of cache; prefill ≈ 25 k tokens/s;
/// a decode step of ≈ 10 ms at batch 1 and ≈ 25 ms at batch 64 with 8 k-token contexts).
///
/// All times are simulated; the process shell maps them onto real time (`--speedup`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block. Default 64.
    pub block_size: u32,
    /// KV blocks on device. Default 8192 (512 Ki tokens at 64 tokens per block).
    pub num_blocks: u64,
    /// Most requests in the running batch. Default 256.
    pub max_num_seqs: u32,
    /// Most tokens computed in one step (decode tokens plus prefill chunks). Default 8192.
    pub max_num_batched_tokens: u32,
    /// Fixed cost of every step (weights read, scheduling, sampling), µs. Default 10,000.
    pub step_overhead_us: u64,
    /// Cost of each prompt token prefilled in a step, ns. Default 40,000.
    pub prefill_ns_per_token: u64,
    /// Cost of each request decoding one token in a step, ns. Default 100,000.
    pub decode_ns_per_seq: u64,
    /// Cost of each context token attended by a decoding request in a step, ns. Default 20.
    pub decode_ns_per_context_token: u64,
    /// Cost of each prompt token loaded from the shared tier instead of prefilled, ns (a
    /// remote store at about 12 GB/s for 128 KiB of KV per token). Default 10,000.
    pub shared_load_ns_per_token: u64,
    /// LoRA adapters resident at once (vLLM's `max_loras`); a request naming another adapter
    /// waits until one of them is idle. Default 0: adapters are not modelled (every adapter
    /// is always resident, at no cost).
    pub max_loras: u32,
    /// Cost of loading an adapter into a slot, µs, added to the step that first runs it.
    /// Default 50,000.
    pub lora_load_us: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            num_blocks: 8192,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            step_overhead_us: 10_000,
            prefill_ns_per_token: 40_000,
            decode_ns_per_seq: 100_000,
            decode_ns_per_context_token: 20,
            shared_load_ns_per_token: 10_000,
            max_loras: 0,
            lora_load_us: 50_000,
        }
    }
}

/// A configuration field with an unusable value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine config: {field}: {reason}")]
pub struct InvalidEngineConfig {
    pub field: &'static str,
    pub reason: String,
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), InvalidEngineConfig> {
        let bad = |field, reason: &str| {
            Err(InvalidEngineConfig {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.block_size == 0 {
            return bad("block_size", "must be at least 1");
        }
        if self.num_blocks == 0 {
            return bad("num_blocks", "must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs", "must be at least 1");
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return bad(
                "max_num_batched_tokens",
                "must be at least max_num_seqs (every running request decodes each step)",
            );
        }
        if self.step_overhead_us == 0 {
            return bad("step_overhead_us", "must be positive");
        }
        Ok(())
    }

    /// How long one step takes, given what it computes.
    pub fn step_duration(&self, work: StepWork) -> Duration {
        let nanos = self.step_overhead_us.saturating_mul(1000)
            + work
                .prefill_tokens
                .saturating_mul(self.prefill_ns_per_token)
            + work.decode_seqs.saturating_mul(self.decode_ns_per_seq)
            + work
                .decode_context_tokens
                .saturating_mul(self.decode_ns_per_context_token)
            + work
                .shared_load_tokens
                .saturating_mul(self.shared_load_ns_per_token)
            + work
                .lora_loads
                .saturating_mul(self.lora_load_us.saturating_mul(1000));
        Duration::from_nanos(nanos)
    }
}

/// What one engine step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepWork {
    /// Prompt tokens prefilled (chunks of any number of requests).
    pub prefill_tokens: u64,
    /// Requests that decode one token.
    pub decode_seqs: u64,
    /// Context tokens those requests attend to, summed.
    pub decode_context_tokens: u64,
    /// Prompt tokens loaded from the shared tier (requests admitted in this step).
    pub shared_load_tokens: u64,
    /// LoRA adapters loaded into a slot for requests admitted in this step.
    pub lora_loads: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_in_range() {
        let c = EngineConfig::default();
        c.validate().unwrap();
        let one = c.step_duration(StepWork {
            decode_seqs: 1,
            decode_context_tokens: 8192,
            ..StepWork::default()
        });
        let many = c.step_duration(StepWork {
            decode_seqs: 64,
            decode_context_tokens: 64 * 8192,
            ..StepWork::default()
        });
        assert!(one >= Duration::from_millis(10) && one <= Duration::from_millis(12));
        assert!(many >= Duration::from_millis(20) && many <= Duration::from_millis(30));
        let prefill = c.step_duration(StepWork {
            prefill_tokens: 8192,
            ..StepWork::default()
        });
        assert!(prefill > Duration::from_millis(200) && prefill < Duration::from_millis(500));
    }

    #[test]
    fn validate_names_the_bad_field() {
        let c = EngineConfig {
            max_num_batched_tokens: 8,
            max_num_seqs: 16,
            ..EngineConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "max_num_batched_tokens");
        let c = EngineConfig {
            block_size: 0,
            ..EngineConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "block_size");
        let parsed: EngineConfig = serde_json::from_str(r#"{"num_blocks": 16}"#).unwrap();
        assert_eq!(parsed.num_blocks, 16);
        assert_eq!(parsed.block_size, 64);
        assert!(serde_json::from_str::<EngineConfig>(r#"{"num_blcks": 16}"#).is_err());
    }
}
