//! A scorer whose cost is one load signal; shared by `least-busy` and `power-of-two`.

use serde::Deserialize;

use crate::pipeline::{ComponentError, WorkerCandidate, WorkerInputs, WorkerScorer};
use crate::request::RequestContext;

/// Which load signal is the cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMetric {
    /// Requests active on the rank.
    #[default]
    ActiveRequests,
    /// Projected decode blocks (active plus this request's).
    DecodeBlocks,
    /// Prompt tokens in the rank's prefill stage.
    PrefillTokens,
}

/// Cost = the chosen load signal.
#[derive(Debug, Clone, Copy)]
pub struct LoadScorer {
    pub metric: LoadMetric,
}

impl WorkerScorer for LoadScorer {
    fn name(&self) -> &str {
        match self.metric {
            LoadMetric::ActiveRequests => "active_requests",
            LoadMetric::DecodeBlocks => "decode_blocks",
            LoadMetric::PrefillTokens => "prefill_tokens",
        }
    }

    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    fn score(
        &mut self,
        _context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<f64, ComponentError> {
        let load = candidate.load().ok_or(ComponentError::MissingInput {
            group: WorkerInputs::LOAD,
        })?;
        Ok(match self.metric {
            LoadMetric::ActiveRequests => load.active_requests as f64,
            LoadMetric::DecodeBlocks => load.decode_cost_blocks,
            LoadMetric::PrefillTokens => load.active_prefill_tokens as f64,
        })
    }
}

/// Parameters of the load-based built-ins.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadParameters {
    pub metric: LoadMetric,
}
