//! The load view's optional models as flags (`--track-output-blocks`, `--prefill-load-model`,
//! `--prefill-tokens-per-sec`); `kvroute-sim` takes the same settings under its own names and
//! validates them here too.

use kvroute_common::config::ConfigError;

use crate::decide::load_view::models::{
    LoadModels, MAX_PREFILL_TOKENS_PER_SEC, MIN_PREFILL_TOKENS_PER_SEC, PrefillLoadModel,
};

/// How predicted prefill counts until `prefill_done`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PrefillModelArg {
    /// At full value until the request's `prefill_done`.
    #[default]
    Full,
    /// Each rank's oldest prefill decays linearly over its predicted duration.
    Decay,
}

/// The flags of the load view's models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::Args)]
pub struct LoadModelArgs {
    /// Count predicted requests' output as it is generated: a placeholder decode block per
    /// block of output (from the workers' `progress` lifecycle events), weighted by the share
    /// of the request's `expected_output_tokens` still to come (full weight without one).
    #[arg(long = "track-output-blocks", env = "KVROUTE_TRACK_OUTPUT_BLOCKS")]
    pub track_output_blocks: bool,
    /// How predicted prefill counts until `prefill_done`: `full`, or `decay` (each rank's
    /// oldest prefill falls linearly to 0 over tokens ÷ rate from its decision).
    #[arg(
        long = "prefill-load-model",
        env = "KVROUTE_PREFILL_LOAD_MODEL",
        value_enum,
        default_value_t = PrefillModelArg::Full
    )]
    pub prefill_load_model: PrefillModelArg,
    /// The decay's prefill rate in tokens per second (100..=10,000,000); by default fitted
    /// per rank from the time between decisions and their `prefill_done` (10,000 until the
    /// rank's first).
    #[arg(
        long = "prefill-tokens-per-sec",
        env = "KVROUTE_PREFILL_TOKENS_PER_SEC"
    )]
    pub prefill_tokens_per_sec: Option<u64>,
}

impl LoadModelArgs {
    /// The validated models; the error names the flag.
    pub fn models(&self) -> Result<LoadModels, ConfigError> {
        let prefill = match self.prefill_load_model {
            PrefillModelArg::Full if self.prefill_tokens_per_sec.is_some() => {
                return Err(ConfigError::new(
                    "prefill-tokens-per-sec",
                    "applies only with --prefill-load-model decay",
                ));
            }
            PrefillModelArg::Full => PrefillLoadModel::Full,
            PrefillModelArg::Decay => PrefillLoadModel::Decay {
                tokens_per_sec: self.prefill_tokens_per_sec,
            },
        };
        let models = LoadModels {
            track_output_blocks: self.track_output_blocks,
            prefill,
        };
        models.validate().map_err(|_| {
            ConfigError::new(
                "prefill-tokens-per-sec",
                format!("must be in {MIN_PREFILL_TOKENS_PER_SEC}..={MAX_PREFILL_TOKENS_PER_SEC}"),
            )
        })?;
        Ok(models)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_off_and_a_rate_needs_the_decay() {
        assert_eq!(LoadModelArgs::default().models(), Ok(LoadModels::OFF));
        let args = |model, rate| LoadModelArgs {
            track_output_blocks: true,
            prefill_load_model: model,
            prefill_tokens_per_sec: rate,
        };
        let fitted = args(PrefillModelArg::Decay, None).models().unwrap();
        assert!(fitted.track_output_blocks);
        assert_eq!(
            fitted.prefill,
            PrefillLoadModel::Decay {
                tokens_per_sec: None
            }
        );
        for bad in [
            args(PrefillModelArg::Full, Some(5_000)),
            args(PrefillModelArg::Decay, Some(99)),
            args(PrefillModelArg::Decay, Some(10_000_001)),
        ] {
            assert_eq!(bad.models().unwrap_err().field, "prefill-tokens-per-sec");
        }
    }
}
