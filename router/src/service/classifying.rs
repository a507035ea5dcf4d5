//! The request classifier's host: one classifier per (model, role) partition, built by the
//! configured factory on the partition's first request (and told when its workers change),
//! run on the replica that decides the partition, before its admission queue. The host
//! classifies each new request (a retry of a queued one is not classified again), classifies
//! deferred requests again after each dispatch round, and delivers the events: `Admitted`
//! when a classification admits, `Sent` with the worker a decision chose, `Completed` when the
//! worker reports `finished` (or its request left the queue unserved, or the worker left, or
//! no lifecycle event came within `--prediction-max-age-secs`). A request's `progress()`
//! rises with its lifecycle events (prompt plus generated tokens).
//!
//! Without a configured classifier nothing here runs (pass-through admission).

use std::collections::HashMap;

use kvroute_common::RequestId;
use kvroute_common::WorkerId;
use kvroute_common::messages::{LifecycleKind, RequestLifecycle, SelectRequest};

use crate::classify::{
    ClassifyEvent, ClassifyRequest, Completion, Progress, RequestClassifier,
    RequestClassifierContext, Verdict,
};
use crate::decide::candidates::Partition;
use crate::decide::candidates::PartitionKey;
use crate::registry::ResolvedClassifier;
use crate::worker::WorkerRank;

/// Requests followed at once; beyond it the oldest are completed as `Failed` (their lifecycle
/// events never came).
const MAX_TRACKED: usize = 65_536;

#[derive(Debug)]
struct Tracked {
    key: PartitionKey,
    worker: Option<WorkerRank>,
    progress: Progress,
    input_tokens: u64,
    since_ms: u64,
}

#[derive(Default)]
struct State {
    by_partition: HashMap<PartitionKey, Box<dyn RequestClassifier>>,
    tracked: HashMap<RequestId, Tracked>,
}

/// The configured classifier's instances and the requests they follow. Owned by the admission
/// state (`super::admission::Admission`), under its lock.
pub(super) struct Classifiers {
    resolved: Option<ResolvedClassifier>,
    state: State,
}

impl std::fmt::Debug for Classifiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifiers")
            .field(
                "type",
                &self.resolved.as_ref().map(ResolvedClassifier::type_name),
            )
            .finish_non_exhaustive()
    }
}

impl Classifiers {
    pub fn new(resolved: Option<ResolvedClassifier>) -> Self {
        Self {
            resolved,
            state: State::default(),
        }
    }

    /// Whether a classifier is configured.
    pub fn enabled(&self) -> bool {
        self.resolved.is_some()
    }

    /// The classification request of a new request.
    pub fn request(
        request: &SelectRequest,
        request_id: RequestId,
        input_tokens: u64,
        arrived_ms: u64,
    ) -> ClassifyRequest {
        let input = u32::try_from(input_tokens).unwrap_or(u32::MAX);
        ClassifyRequest::from_request(request, request_id, input, arrived_ms)
    }

    /// Classifies `request` with its partition's classifier (built on first use); `None`
    /// without a configured classifier. A request classified for the first time is followed
    /// until it completes; an admission is reported to the classifier as `Admitted`.
    pub fn classify(
        &mut self,
        key: &PartitionKey,
        partition: &Partition,
        request: &mut ClassifyRequest,
        now_ms: u64,
    ) -> Option<Verdict> {
        let resolved = self.resolved.as_ref()?;
        let state = &mut self.state;
        let classifier = state.by_partition.entry(key.clone()).or_insert_with(|| {
            tracing::info!(model = key.0, role = %key.1, classifier = resolved.type_name(), "built a request classifier");
            resolved.build(&RequestClassifierContext::from_partition(partition))
        });
        let verdict = classifier.classify(request, now_ms);
        let id = request.request_id();
        if let Verdict::Admit(_) = verdict {
            classifier.on_event(&ClassifyEvent::Admitted { request_id: id }, now_ms);
        }
        if !state.tracked.contains_key(&id) {
            if state.tracked.len() >= MAX_TRACKED {
                evict_oldest(state, now_ms);
            }
            state.tracked.insert(
                id,
                Tracked {
                    key: key.clone(),
                    worker: None,
                    progress: request.progress_handle().clone(),
                    input_tokens: u64::from(request.input_tokens()),
                    since_ms: now_ms,
                },
            );
        }
        Some(verdict)
    }

    /// A decision chose `worker` for a followed request.
    pub fn sent(&mut self, request_id: RequestId, worker: WorkerRank, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        let state = &mut self.state;
        let Some(tracked) = state.tracked.get_mut(&request_id) else {
            return;
        };
        tracked.worker = Some(worker);
        tracked.since_ms = now_ms;
        if let Some(c) = state.by_partition.get_mut(&tracked.key) {
            c.on_event(&ClassifyEvent::Sent { request_id, worker }, now_ms);
        }
    }

    /// A followed request is over.
    pub fn completed(&mut self, request_id: RequestId, outcome: Completion, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        let state = &mut self.state;
        complete(state, request_id, outcome, now_ms);
    }

    /// A lifecycle event: `finished` completes the request; every event raises its progress.
    pub fn lifecycle(&mut self, event: &RequestLifecycle, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        let state = &mut self.state;
        let Some(tracked) = state.tracked.get(&event.request_id) else {
            return;
        };
        match event.kind {
            LifecycleKind::Finished { output_tokens } => {
                tracked
                    .progress
                    .observe(tracked.input_tokens.saturating_add(output_tokens));
                complete(state, event.request_id, Completion::Finished, now_ms);
            }
            LifecycleKind::PrefillDone { .. } => {
                tracked.progress.observe(tracked.input_tokens);
            }
            LifecycleKind::Progress { output_tokens } => {
                tracked
                    .progress
                    .observe(tracked.input_tokens.saturating_add(output_tokens));
            }
        }
    }

    /// A worker left: its requests will not report.
    pub fn worker_departed(&mut self, worker_id: WorkerId, now_ms: u64) {
        if !self.enabled() {
            return;
        }
        let state = &mut self.state;
        let gone: Vec<RequestId> = state
            .tracked
            .iter()
            .filter(|(_, t)| t.worker.is_some_and(|w| w.worker_id == worker_id))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            complete(state, id, Completion::Failed, now_ms);
        }
    }

    /// Requests sent longer than `max_age_ms` ago without a `finished` are completed as
    /// `Failed` (the router's load view forgets them at the same age).
    pub fn expire(&mut self, now_ms: u64, max_age_ms: u64) {
        if !self.enabled() {
            return;
        }
        let state = &mut self.state;
        let old: Vec<RequestId> = state
            .tracked
            .iter()
            .filter(|(_, t)| t.worker.is_some() && now_ms.saturating_sub(t.since_ms) > max_age_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in old {
            complete(state, id, Completion::Failed, now_ms);
        }
    }

    /// The partitions' workers changed: each classifier hears its partition's new view.
    pub fn workers_changed(&mut self, partition_of: impl Fn(&PartitionKey) -> Option<Partition>) {
        if !self.enabled() {
            return;
        }
        let state = &mut self.state;
        for (key, classifier) in state.by_partition.iter_mut() {
            let context = partition_of(key)
                .map(|p| RequestClassifierContext::from_partition(&p))
                .unwrap_or_default();
            classifier.workers_changed(&context);
        }
    }

    /// Classifies a deferred request again (the dispatcher's), without following it anew.
    pub fn reclassify(
        &mut self,
        key: &PartitionKey,
        request: &mut ClassifyRequest,
        now_ms: u64,
    ) -> Option<Verdict> {
        self.resolved.as_ref()?;
        let state = &mut self.state;
        let classifier = state.by_partition.get_mut(key)?;
        let verdict = classifier.classify(request, now_ms);
        if let Verdict::Admit(_) = verdict {
            classifier.on_event(
                &ClassifyEvent::Admitted {
                    request_id: request.request_id(),
                },
                now_ms,
            );
        }
        Some(verdict)
    }

    /// Requests followed now (for tests and `/status`).
    pub fn tracked(&self) -> usize {
        self.state.tracked.len()
    }
}

fn complete(state: &mut State, request_id: RequestId, outcome: Completion, now_ms: u64) {
    let Some(tracked) = state.tracked.remove(&request_id) else {
        return;
    };
    if let Some(c) = state.by_partition.get_mut(&tracked.key) {
        c.on_event(
            &ClassifyEvent::Completed {
                request_id,
                worker: tracked.worker,
                outcome,
            },
            now_ms,
        );
    }
}

fn evict_oldest(state: &mut State, now_ms: u64) {
    if let Some(oldest) = state
        .tracked
        .iter()
        .min_by_key(|(_, t)| t.since_ms)
        .map(|(id, _)| *id)
    {
        complete(state, oldest, Completion::Failed, now_ms);
    }
}
