//! The three narrow contracts a worker-selection policy is made of: filters keep or reject a
//! row, scorers give one finite cost per row, and one picker returns a row index.
//!
//! Components may keep policy-local state (`&mut self`), but must not block, do I/O, or panic.

use rand::RngCore;

use super::candidate::{ScoredCandidate, WorkerCandidate};
use super::inputs::WorkerInputs;
use crate::request::RequestContext;

/// A component that could not decide.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ComponentError {
    /// The component read a signal group it did not declare in `required_inputs`.
    #[error("input {group:?} is unavailable (declare it in required_inputs)")]
    MissingInput { group: WorkerInputs },
    #[error("{message}")]
    Failed { message: String },
}

impl ComponentError {
    pub fn failed(message: impl Into<String>) -> Self {
        Self::Failed {
            message: message.into(),
        }
    }
}

/// The component's short name: the type name without its module path.
fn short_type_name<T: ?Sized>() -> &'static str {
    let full = std::any::type_name::<T>();
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base)
}

/// A hard requirement: a worker must pass every filter. Filters run in declaration order.
pub trait WorkerFilter: Send {
    /// Used in per-worker rejection reasons.
    fn name(&self) -> &str {
        short_type_name::<Self>()
    }

    /// The optional signal groups `keep` reads.
    fn required_inputs(&self) -> WorkerInputs;

    /// `true` keeps the worker, `false` rejects it.
    fn keep(
        &mut self,
        context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<bool, ComponentError>;
}

/// A preference: one finite cost per worker. Costs of all scorers are summed; lower is better.
pub trait WorkerScorer: Send {
    /// The key of this scorer's term in the reply's cost breakdown.
    fn name(&self) -> &str {
        short_type_name::<Self>()
    }

    /// The optional signal groups `score` reads.
    fn required_inputs(&self) -> WorkerInputs;

    /// A finite cost; a non-finite value fails the selection with a policy error.
    fn score(
        &mut self,
        context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<f64, ComponentError>;
}

/// The final choice among scored rows. Row order is unspecified: inspect values, not positions.
pub trait WorkerPicker: Send {
    /// The optional signal groups `pick` reads.
    fn required_inputs(&self) -> WorkerInputs;

    /// The index of the chosen row in `rows` (never empty); validated by the pipeline.
    fn pick(
        &mut self,
        context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Example;

    #[test]
    fn short_names_drop_the_module_path() {
        assert_eq!(short_type_name::<Example>(), "Example");
        assert_eq!(short_type_name::<Vec<u8>>(), "Vec");
    }
}
