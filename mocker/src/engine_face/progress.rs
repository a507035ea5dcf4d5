//! Between a completions handler and the ranks running its prompts: the progress the ranks
//! report (one slot per prompt, overwritten in place) and the guard that aborts the prompts
//! still in flight when the handler goes away (its client disconnected).

use std::sync::Arc;
use std::time::Duration;

use kvroute_common::RequestId;
use tokio::sync::watch;

use super::rank::Rank;

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

/// The prompts a handler submitted. Dropped while armed — the handler future or the streamed
/// body was dropped because the client went away — it aborts those still in flight, at once
/// or after `delay`.
#[derive(Debug)]
pub(crate) struct AbortOnDrop {
    requests: Vec<(Arc<Rank>, RequestId)>,
    delay: Duration,
    armed: bool,
}

impl AbortOnDrop {
    pub fn new(delay: Duration) -> Self {
        Self {
            requests: Vec::new(),
            delay,
            armed: true,
        }
    }

    pub fn push(&mut self, rank: Arc<Rank>, request_id: RequestId) {
        self.requests.push((rank, request_id));
    }

    /// Every prompt has ended: nothing is left to abort.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed || self.requests.is_empty() {
            return;
        }
        let requests = std::mem::take(&mut self.requests);
        let abort = move || {
            for (rank, id) in &requests {
                rank.abort(*id);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if !self.delay.is_zero() => {
                let delay = self.delay;
                rt.spawn(async move {
                    tokio::time::sleep(delay).await;
                    abort();
                });
            }
            _ => abort(),
        }
    }
}
