//! The policy pipeline: [`WorkerFilter`]s → [`WorkerScorer`]s → one [`WorkerPicker`], bundled
//! in a [`WorkerSelectionPolicy`]. Components declare the optional [`WorkerInputs`] they read.

mod candidate;
mod component;
mod error;
mod inputs;
mod policy;
#[cfg(test)]
mod tests;

pub use candidate::{LoadSignals, ScoredCandidate, WorkerCandidate};
pub use component::{ComponentError, WorkerFilter, WorkerPicker, WorkerScorer};
pub use error::{PipelineError, Stage};
pub use inputs::WorkerInputs;
pub use policy::{PolicyChoice, WorkerSelectionPolicy};
