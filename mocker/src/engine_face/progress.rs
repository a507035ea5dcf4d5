//! Between a completions handler and the ranks running its prompts: the progress the ranks
//! report (one slot per prompt, overwritten in place).

use std::sync::Arc;

use tokio::sync::watch;

/// One prompt's progress, as its rank last wrote it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PromptProgress {
    /// Prompt tokens found in the cache; set with the first token.
    pub cached_tokens: Option<u64>,
    /// Tokens generated so far. A streamed prompt counts each one as its decode step ends;
    /// the others jump from 1 (the first token) to the total (the end).
    pub generated: u64,
    pub end: Option<End>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// The last token is out: `generated` is the total.
    Finished,
    /// The engine dropped the prompt (it is shutting down).
    Cancelled,
}

/// Where ranks write a request's progress. A watch channel: writing never blocks or
/// allocates, and a reader that falls behind catches up from the counts.
pub(crate) type ProgressTx = Arc<watch::Sender<Vec<PromptProgress>>>;
pub(crate) type ProgressRx = watch::Receiver<Vec<PromptProgress>>;

/// A progress channel for a request of `prompts` prompts. The handler keeps only the receiver,
/// so the channel closes when every rank is done with the request.
pub(crate) fn progress_channel(prompts: usize) -> (ProgressTx, ProgressRx) {
    let (tx, rx) = watch::channel(vec![PromptProgress::default(); prompts]);
    (Arc::new(tx), rx)
}
