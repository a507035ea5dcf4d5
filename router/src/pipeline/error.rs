//! How a policy run can fail, typed so the caller can map each case onto a wire error code.

use kvroute_common::messages::ErrorCode;

use super::component::ComponentError;
use crate::worker::WorkerRank;

/// A policy run that produced no valid choice.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// Filters rejected every row; each rejected rank with the filter that rejected it.
    #[error("policy filters rejected all {} eligible workers", rejected.len())]
    AllFiltered { rejected: Vec<(WorkerRank, String)> },
    #[error("scorer {scorer} returned a non-finite cost {cost} for worker {worker}")]
    NonFiniteCost {
        scorer: String,
        worker: WorkerRank,
        cost: f64,
    },
    #[error("picker returned row {row} of {rows}")]
    InvalidPick { row: usize, rows: usize },
    #[error("{stage} {name} failed for worker {worker:?}: {source}")]
    Component {
        stage: Stage,
        name: String,
        worker: Option<WorkerRank>,
        source: ComponentError,
    },
}

/// Which contract a failing component implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Filter,
    Scorer,
    Picker,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Filter => "filter",
            Stage::Scorer => "scorer",
            Stage::Picker => "picker",
        })
    }
}

impl PipelineError {
    pub fn code(&self) -> ErrorCode {
        match self {
            PipelineError::AllFiltered { .. } => ErrorCode::AllFiltered,
            _ => ErrorCode::PolicyError,
        }
    }
}
