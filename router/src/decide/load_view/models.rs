//! The load view's optional models of a predicted request's load (routing-concepts, "Active
//! Load Modeling"), both off by default:
//!
//! - **output blocks**: as a request's generation crosses block boundaries (`progress`
//!   lifecycle events), its prediction adds `floor(output_tokens / block_size)` placeholder
//!   decode blocks, weighted by `max(0, 1 − output_tokens / expected_output_tokens)` when the
//!   request gave an expected output length, at full weight otherwise;
//! - **prefill decay**: a rank's oldest prediction still in prefill counts
//!   `max(0, tokens − rate · (now − decided))` instead of all its tokens until `prefill_done`,
//!   so it reaches zero after its predicted duration `tokens / rate`. The rate is configured, or
//!   fitted per rank from the observed time from decision to `prefill_done` ([`PrefillRate`]).
//!
//! Pure arithmetic: the view keeps the state and passes the time.

/// How a prediction's prompt tokens count until its `prefill_done`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillLoadModel {
    /// At full value (the default).
    #[default]
    Full,
    /// The rank's oldest prefill decays linearly from its decision; `tokens_per_sec`: the
    /// configured rate, or `None` to fit it per rank ([`PrefillRate`]).
    Decay { tokens_per_sec: Option<u64> },
}

/// The load view's models (`LoadViewConfig::models`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadModels {
    /// Count output blocks from `progress` events (off by default).
    pub track_output_blocks: bool,
    pub prefill: PrefillLoadModel,
}

/// An invalid [`LoadModels`] setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "prefill tokens per second must be in {MIN_PREFILL_TOKENS_PER_SEC}..={MAX_PREFILL_TOKENS_PER_SEC}, got {0}"
)]
pub struct InvalidPrefillRate(pub u64);

impl LoadModels {
    /// Both models off (the default), for constants.
    pub const OFF: Self = Self {
        track_output_blocks: false,
        prefill: PrefillLoadModel::Full,
    };

    pub fn validate(&self) -> Result<(), InvalidPrefillRate> {
        match self.prefill {
            PrefillLoadModel::Decay {
                tokens_per_sec: Some(rate),
            } if !(MIN_PREFILL_TOKENS_PER_SEC..=MAX_PREFILL_TOKENS_PER_SEC).contains(&rate) => {
                Err(InvalidPrefillRate(rate))
            }
            _ => Ok(()),
        }
    }
}

/// Output blocks are summed in thousandths of a block, exactly (a float total would drift as
/// contributions are added and taken away).
pub(super) const MILLIBLOCKS: u64 = 1000;

/// What a request that has generated `output_tokens` adds to its rank, in thousandths of a
/// block: its full output blocks, weighted by the share of its expected output still to come
/// (full weight without an expected length). `block_size` 0 (a decision from a router that
/// does not say it): nothing.
pub fn output_milliblocks(output_tokens: u64, block_size: u32, expected: Option<u32>) -> u64 {
    if block_size == 0 {
        return 0;
    }
    let blocks = output_tokens / u64::from(block_size);
    let weight = match expected {
        Some(expected) if expected > 0 => {
            (1.0 - output_tokens as f64 / f64::from(expected)).max(0.0)
        }
        _ => 1.0,
    };
    (blocks as f64 * weight * MILLIBLOCKS as f64).round() as u64
}

/// The slowest prefill rate the view assumes or fits, tokens per second.
pub const MIN_PREFILL_TOKENS_PER_SEC: u64 = 100;
/// The fastest.
pub const MAX_PREFILL_TOKENS_PER_SEC: u64 = 10_000_000;
/// The rate assumed for a rank before its first observed prefill (fitted rate only).
pub const DEFAULT_PREFILL_TOKENS_PER_SEC: u64 = 10_000;

/// Prefill tokens of a prediction decided `elapsed_ms` ago that still count under the decay,
/// at `tokens_per_sec`.
pub fn remaining_prefill(tokens: u64, elapsed_ms: u64, tokens_per_sec: f64) -> u64 {
    let done = (tokens_per_sec * elapsed_ms as f64 / 1e3).floor();
    if done >= tokens as f64 {
        0
    } else {
        tokens - done as u64
    }
}

/// A rank's prefill rate fitted from observed prefills: exponentially weighted sums of the
/// effective prefill tokens and of the milliseconds from decision to `prefill_done` (each
/// observation moves both by 1/8 of the way), whose ratio is the rate, clamped to
/// [`MIN_PREFILL_TOKENS_PER_SEC`]..=[`MAX_PREFILL_TOKENS_PER_SEC`]. A ratio of sums, not a mean
/// of ratios: one tiny prefill that took no measurable time cannot make the rate infinite.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillRate {
    /// (weighted tokens, weighted milliseconds), after the first observation.
    sums: Option<(f64, f64)>,
}

impl PrefillRate {
    /// `tokens` of prefill done `elapsed_ms` after the decision. Requests with nothing to
    /// prefill tell nothing of the rate and are skipped.
    pub fn observe(&mut self, tokens: u64, elapsed_ms: u64) {
        if tokens == 0 {
            return;
        }
        let (t, ms) = (tokens as f64, elapsed_ms as f64);
        self.sums = Some(match self.sums {
            None => (t, ms),
            Some((st, sms)) => (st + (t - st) / 8.0, sms + (ms - sms) / 8.0),
        });
    }

    /// Whether any prefill was observed.
    pub fn is_fitted(&self) -> bool {
        self.sums.is_some()
    }

    /// The fitted rate, or `default` before any observation.
    pub fn tokens_per_sec(&self, default: u64) -> f64 {
        let rate = match self.sums {
            None => default as f64,
            Some((_, ms)) if ms <= 0.0 => f64::INFINITY,
            Some((tokens, ms)) => tokens * 1e3 / ms,
        };
        rate.clamp(
            MIN_PREFILL_TOKENS_PER_SEC as f64,
            MAX_PREFILL_TOKENS_PER_SEC as f64,
        )
    }
}
