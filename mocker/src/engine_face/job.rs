//! A request's prompts submitted to the engine, and what its answer (whole or streamed) needs.

use std::sync::Arc;

use super::abort::AbortOnDrop;
use super::face::WorkerFace;
use super::progress::{ProgressRx, PromptProgress};
use super::shapes::{Api, Usage};

/// The finish reason of every request: the simulated engine always runs to `max_tokens`.
pub(super) const FINISH_REASON: &str = "length";

/// A request's prompts submitted to the engine, and what its answer needs.
pub(super) struct Job {
    pub face: Arc<WorkerFace>,
    pub api: Api,
    pub id: String,
    pub created: u64,
    /// The model the answer names: the request's adapter, else the base model (vLLM answers
    /// with the name asked for).
    pub model: String,
    /// Per prompt.
    pub prompt_tokens: Vec<u64>,
    /// Of each prompt.
    pub max_tokens: u32,
    pub progress: ProgressRx,
    /// Aborts the prompts if the job is dropped before they end.
    pub requests: AbortOnDrop,
}

impl Job {
    /// The usage of the prompts, from their progress.
    pub fn usage(&self, progress: &[PromptProgress]) -> Usage {
        Usage::new(
            self.face.settings.engine_api,
            self.prompt_tokens.iter().sum(),
            progress.iter().map(|p| p.generated).sum(),
            progress.iter().filter_map(|p| p.cached_tokens).sum(),
        )
    }
}
