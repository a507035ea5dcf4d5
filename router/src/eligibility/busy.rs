//! Busy thresholds: a rank above any configured threshold is overloaded and not eligible.
//! Unknown load (no report yet) is never busy.

use kvroute_common::messages::WorkerCard;

use crate::signals::ObservedLoad;

/// When a rank counts as overloaded. Both thresholds are off by default.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BusyThresholds {
    /// Busy when active decode blocks exceed this fraction of the card's `total_kv_blocks`
    /// (e.g. `0.9`). Ignored for cards advertising no capacity.
    pub decode_blocks_fraction: Option<f64>,
    /// Busy when active prefill tokens exceed this limit.
    pub prefill_tokens: Option<PrefillLimit>,
}

/// The active-prefill-token limit, absolute or relative to the engine's batch budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillLimit {
    /// Tokens.
    Tokens(u64),
    /// A fraction of the card's `max_num_batched_tokens` (ignored when that is unknown, 0).
    FractionOfBatch(f64),
}

/// A threshold that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("busy threshold {field} must be a finite number above 0, got {value}")]
pub struct InvalidThreshold {
    pub field: &'static str,
    pub value: f64,
}

/// Which threshold a rank exceeded, with the numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Busy {
    DecodeBlocks { active: u64, limit: f64 },
    PrefillTokens { active: u64, limit: f64 },
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Busy::DecodeBlocks { active, limit } => {
                write!(f, "busy: {active} active decode blocks > limit {limit}")
            }
            Busy::PrefillTokens { active, limit } => {
                write!(f, "busy: {active} active prefill tokens > limit {limit}")
            }
        }
    }
}

impl BusyThresholds {
    pub fn validate(&self) -> Result<(), InvalidThreshold> {
        let positive = |field, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(InvalidThreshold { field, value })
            }
        };
        if let Some(fraction) = self.decode_blocks_fraction {
            positive("decode_blocks_fraction", fraction)?;
        }
        match self.prefill_tokens {
            Some(PrefillLimit::FractionOfBatch(fraction)) => {
                positive("prefill_tokens_fraction", fraction)
            }
            Some(PrefillLimit::Tokens(0)) => Err(InvalidThreshold {
                field: "prefill_tokens",
                value: 0.0,
            }),
            _ => Ok(()),
        }
    }

    /// Whether any threshold is set (eligibility then needs the load signals).
    pub fn is_enabled(&self) -> bool {
        self.decode_blocks_fraction.is_some() || self.prefill_tokens.is_some()
    }

    /// The first threshold `load` exceeds on the rank described by `card`.
    pub fn check(&self, card: &WorkerCard, load: Option<ObservedLoad>) -> Result<(), Busy> {
        let Some(load) = load else {
            return Ok(());
        };
        if let Some(fraction) = self.decode_blocks_fraction
            && card.total_kv_blocks > 0
        {
            let limit = fraction * card.total_kv_blocks as f64;
            if load.decode_blocks() > limit {
                return Err(Busy::DecodeBlocks {
                    active: load.decode_blocks().ceil() as u64,
                    limit,
                });
            }
        }
        let limit = match self.prefill_tokens {
            Some(PrefillLimit::Tokens(tokens)) => Some(tokens as f64),
            Some(PrefillLimit::FractionOfBatch(fraction)) if card.max_num_batched_tokens > 0 => {
                Some(fraction * card.max_num_batched_tokens as f64)
            }
            _ => None,
        };
        match limit {
            Some(limit) if load.active_prefill_tokens as f64 > limit => Err(Busy::PrefillTokens {
                active: load.active_prefill_tokens,
                limit,
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::card;

    fn load(decode: u64, prefill: u64) -> Option<ObservedLoad> {
        Some(ObservedLoad {
            active_prefill_tokens: prefill,
            active_decode_blocks: decode,
            active_requests: 1,
            ..ObservedLoad::default()
        })
    }

    #[test]
    fn decode_fraction_is_relative_to_capacity() {
        let busy = BusyThresholds {
            decode_blocks_fraction: Some(0.5),
            ..Default::default()
        };
        let card = card(1); // 1000 blocks
        assert!(busy.check(&card, load(500, 0)).is_ok());
        assert!(matches!(
            busy.check(&card, load(501, 0)),
            Err(Busy::DecodeBlocks { active: 501, .. })
        ));
        assert!(busy.check(&card, None).is_ok(), "unknown load is not busy");
    }

    #[test]
    fn prefill_limit_is_absolute_or_a_fraction_of_the_batch_budget() {
        let card = card(1); // 8192 batched tokens
        let absolute = BusyThresholds {
            prefill_tokens: Some(PrefillLimit::Tokens(1000)),
            ..Default::default()
        };
        assert!(absolute.check(&card, load(0, 1000)).is_ok());
        assert!(absolute.check(&card, load(0, 1001)).is_err());
        let relative = BusyThresholds {
            prefill_tokens: Some(PrefillLimit::FractionOfBatch(2.0)),
            ..Default::default()
        };
        assert!(relative.check(&card, load(0, 16384)).is_ok());
        assert!(matches!(
            relative.check(&card, load(0, 16385)),
            Err(Busy::PrefillTokens { .. })
        ));
    }

    #[test]
    fn validation_refuses_non_positive_or_non_finite_thresholds() {
        let bad = BusyThresholds {
            decode_blocks_fraction: Some(f64::NAN),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = BusyThresholds {
            prefill_tokens: Some(PrefillLimit::FractionOfBatch(0.0)),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        assert!(BusyThresholds::default().validate().is_ok());
    }
}
