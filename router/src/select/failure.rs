//! Why a selection failed, typed per stage, mapped onto the wire's `ErrorCode`.

use std::collections::BTreeMap;

use kvroute_common::RequestId;
use kvroute_common::messages::{ErrorCode, SchemaVersion, SelectError};

use crate::eligibility::EligibilityError;
use crate::pipeline::PipelineError;
use crate::session::SessionError;

/// A selection that produced no worker.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectFailure {
    #[error("bad request: {message}")]
    BadRequest { message: String },
    #[error(transparent)]
    Eligibility(#[from] EligibilityError),
    #[error(transparent)]
    Policy(#[from] PipelineError),
    #[error(transparent)]
    Session(#[from] SessionError),
}

impl SelectFailure {
    pub fn code(&self) -> ErrorCode {
        match self {
            SelectFailure::BadRequest { .. } => ErrorCode::BadRequest,
            SelectFailure::Eligibility(e) => e.code(),
            SelectFailure::Policy(e) => e.code(),
            SelectFailure::Session(_) => ErrorCode::Unavailable,
        }
    }

    /// Per-rank reasons (`"<worker>/<rank>"` → why), when every candidate was rejected.
    pub fn reasons(&self) -> BTreeMap<String, String> {
        match self {
            SelectFailure::Eligibility(e) => e.reasons(),
            SelectFailure::Policy(PipelineError::AllFiltered { rejected }) => rejected
                .iter()
                .map(|(worker, filter)| {
                    (worker.to_string(), format!("rejected by filter {filter}"))
                })
                .collect(),
            _ => BTreeMap::new(),
        }
    }

    /// The wire error for this failure.
    pub fn to_select_error(&self, request_id: Option<RequestId>) -> SelectError {
        SelectError {
            v: SchemaVersion::CURRENT,
            request_id,
            code: self.code(),
            message: self.to_string(),
            reasons: self.reasons(),
        }
    }
}
