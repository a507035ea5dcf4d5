//! Router-owned selection settings (eligibility thresholds, the preferred-taint multiplier),
//! validated once at startup, and the materialization of candidate rows from signals.

use kvroute_common::messages::{SelectRequest, WorkerCard};

use crate::eligibility::{BusyThresholds, EligibleRank, InvalidThreshold};
use crate::pipeline::{LoadSignals, WorkerCandidate, WorkerInputs, WorkerSelectionPolicy};
use crate::request::RequestContext;
use crate::signals::SignalSource;

/// Settings the router applies around every policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelectionSettings {
    /// Overload thresholds; off by default.
    pub busy: BusyThresholds,
    /// The `preferred_taint_multiplier()` of a worker carrying at least one of the request's
    /// preferred taints, in (0, 1]; others get 1. Default 0.8.
    pub preferred_taint_multiplier: f64,
    /// Place LoRA adapters: a request naming an adapter is eligible only on the adapter's
    /// home ranks (sized by its share of demand, chosen by rendezvous hashing) and on ranks
    /// where it is resident ([`crate::eligibility::placement`]). Default on.
    pub adapter_placement: bool,
}

impl Default for SelectionSettings {
    fn default() -> Self {
        Self {
            busy: BusyThresholds::default(),
            preferred_taint_multiplier: 0.8,
            adapter_placement: true,
        }
    }
}

/// A selection setting that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectionSettingsError {
    #[error(transparent)]
    Busy(#[from] InvalidThreshold),
    #[error("preferred_taint_multiplier must be in (0, 1], got {value}")]
    TaintMultiplier { value: f64 },
}

impl SelectionSettings {
    pub fn validate(&self) -> Result<(), SelectionSettingsError> {
        self.busy.validate()?;
        let m = self.preferred_taint_multiplier;
        if !(m > 0.0 && m <= 1.0) {
            return Err(SelectionSettingsError::TaintMultiplier { value: m });
        }
        Ok(())
    }

    /// Every signal group one selection with `policy` may read: the policy's, plus `LOAD`
    /// when busy thresholds are set and `ADAPTER` when adapters are placed. Gather only these
    /// (no `CACHE`: skip the index query).
    pub fn required_inputs(&self, policy: &WorkerSelectionPolicy) -> WorkerInputs {
        let mut inputs = policy.required_inputs();
        if self.busy.is_enabled() {
            inputs |= WorkerInputs::LOAD;
        }
        if self.adapter_placement {
            inputs |= WorkerInputs::ADAPTER;
        }
        inputs
    }

    fn taint_multiplier(&self, request: &SelectRequest, card: &WorkerCard) -> Option<f64> {
        if request.preferred_taints.is_empty() {
            return None;
        }
        let preferred = card
            .taints
            .iter()
            .any(|t| request.preferred_taints.contains(t));
        Some(if preferred {
            self.preferred_taint_multiplier
        } else {
            1.0
        })
    }

    /// The candidate rows for `ranks`, with exactly the signal groups in `inputs`.
    pub(crate) fn rows<'a>(
        &self,
        request: &SelectRequest,
        context: &RequestContext,
        ranks: &[EligibleRank<'a>],
        signals: &dyn SignalSource,
        inputs: WorkerInputs,
    ) -> Vec<WorkerCandidate<'a>> {
        ranks
            .iter()
            .map(|rank| {
                let mut row = WorkerCandidate::new(rank.worker, rank.card);
                if inputs.contains(WorkerInputs::CACHE) {
                    row = row.with_cache(signals.overlap(rank.worker));
                }
                if inputs.contains(WorkerInputs::LOAD) {
                    let load = signals.load(rank.worker);
                    row = row.with_load(LoadSignals::project(load, context.request_blocks()));
                }
                if inputs.contains(WorkerInputs::PREFERRED_TAINT) {
                    row = row
                        .with_preferred_taint_multiplier(self.taint_multiplier(request, rank.card));
                }
                if inputs.contains(WorkerInputs::ADAPTER) {
                    row = row.with_adapter(signals.adapter(rank.worker));
                }
                row
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eligibility::PrefillLimit;
    use crate::policies::default::DefaultPolicyParameters;
    use crate::policies::least_busy;
    use crate::policies::tests::build;

    #[test]
    fn busy_thresholds_add_load_to_the_required_inputs() {
        let placing = SelectionSettings::default();
        let least_busy = build(least_busy::provider, "");
        assert_eq!(
            placing.required_inputs(&least_busy),
            WorkerInputs::LOAD | WorkerInputs::ADAPTER,
            "placing adapters reads where they are resident"
        );
        let settings = SelectionSettings {
            adapter_placement: false,
            ..SelectionSettings::default()
        };
        assert_eq!(settings.required_inputs(&least_busy), WorkerInputs::LOAD);
        let kv = DefaultPolicyParameters::default().policy();
        assert!(settings.required_inputs(&kv).contains(WorkerInputs::CACHE));
        let random = build(crate::policies::random::provider, "");
        assert!(settings.required_inputs(&random).is_empty());
        let busy = SelectionSettings {
            busy: BusyThresholds {
                prefill_tokens: Some(PrefillLimit::Tokens(10)),
                ..Default::default()
            },
            ..settings
        };
        assert_eq!(busy.required_inputs(&random), WorkerInputs::LOAD);
    }

    #[test]
    fn validation_names_the_bad_setting() {
        let bad = SelectionSettings {
            preferred_taint_multiplier: 0.0,
            ..SelectionSettings::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("preferred_taint_multiplier")
        );
        assert!(SelectionSettings::default().validate().is_ok());
    }
}
