//! `max-in-flight`: caps the requests in flight per worker rank and per partition. A request
//! counts from its admission (`classify` answering Admit, or an `Admitted` event) through
//! `Sent` until `Completed`, so a burst admitted before any dispatch cannot overshoot.
//!
//! Memory: one entry per request in flight, dropped at its `Completed` (which the host sends
//! for every admitted request, also when its worker departs), plus a counter per rank with
//! requests in flight. Admission keeps the entries within the limits (`per_model`, or
//! `per_worker` × ranks), except for requests the host reports `Sent` without this
//! classifier's admission, which are counted too.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_common::RequestId;
use serde::Deserialize;

use super::{
    Classification, ClassifierParameters, ClassifyEvent, ClassifyRequest, ProviderError,
    RequestClassifier, RequestClassifierContext, RequestClassifierFactory, Verdict,
};
use crate::worker::{WorkerRank, WorkerTarget};

/// The type name in `request_classifier.type`.
pub const TYPE_NAME: &str = "max-in-flight";

/// `request_classifier.parameters` of `max-in-flight`; at least one is required.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parameters {
    /// Requests in flight on one rank; a request is deferred while every rank of the
    /// partition has this many, and otherwise steered (softly) to the rank with the fewest.
    #[serde(default)]
    pub per_worker: Option<u32>,
    /// Requests in flight in the partition (one model and role); more are deferred.
    #[serde(default)]
    pub per_model: Option<u32>,
}

impl Parameters {
    /// Each limit given is at least 1, and at least one is given.
    pub fn validate(&self) -> Result<(), ProviderError> {
        for (name, limit) in [
            ("per_worker", self.per_worker),
            ("per_model", self.per_model),
        ] {
            if limit == Some(0) {
                return Err(ProviderError::new(format!(
                    "parameter `{name}` must be at least 1"
                )));
            }
        }
        if self.per_worker.is_none() && self.per_model.is_none() {
            return Err(ProviderError::new(
                "set parameter `per_worker`, `per_model` or both",
            ));
        }
        Ok(())
    }
}

/// Parses and validates the parameters; the factory builds one [`MaxInFlight`] per partition.
pub fn provider(
    parameters: &ClassifierParameters,
) -> Result<RequestClassifierFactory, ProviderError> {
    let limits: Parameters = parameters.deserialize()?;
    limits.validate()?;
    Ok(Arc::new(move |context| {
        Box::new(MaxInFlight::new(limits, context))
    }))
}

/// The classifier of one partition.
#[derive(Debug)]
pub struct MaxInFlight {
    limits: Parameters,
    /// The partition's ranks, sorted (ties go to the lowest).
    workers: Vec<WorkerRank>,
    /// Requests in flight: admitted (no worker yet) or sent to a rank.
    requests: HashMap<RequestId, Option<WorkerRank>>,
    /// Requests in flight per rank; ranks with none are absent.
    per_worker: HashMap<WorkerRank, u32>,
}

impl MaxInFlight {
    pub fn new(limits: Parameters, context: &RequestClassifierContext) -> Self {
        let mut this = Self {
            limits,
            workers: Vec::new(),
            requests: HashMap::new(),
            per_worker: HashMap::new(),
        };
        this.workers_changed(context);
        this
    }

    /// Requests in flight in the partition.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Requests sent to `worker` and not completed.
    pub fn in_flight_on(&self, worker: WorkerRank) -> u32 {
        self.per_worker.get(&worker).copied().unwrap_or(0)
    }

    /// The rank with the fewest requests in flight below `limit`; `None` when all are full.
    fn least_loaded_below(&self, limit: u32) -> Option<WorkerRank> {
        self.workers
            .iter()
            .map(|w| (self.in_flight_on(*w), *w))
            .filter(|(n, _)| *n < limit)
            .min()
            .map(|(_, w)| w)
    }

    fn add(&mut self, worker: WorkerRank) {
        *self.per_worker.entry(worker).or_default() += 1;
    }

    fn remove(&mut self, worker: WorkerRank) {
        if let Some(n) = self.per_worker.get_mut(&worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_worker.remove(&worker);
            }
        }
    }
}

impl RequestClassifier for MaxInFlight {
    fn name(&self) -> &str {
        TYPE_NAME
    }

    fn classify(&mut self, request: &mut ClassifyRequest, _now_ms: u64) -> Verdict {
        let id = request.request_id();
        if !self.requests.contains_key(&id) {
            if let Some(limit) = self.limits.per_model
                && self.requests.len() >= limit as usize
            {
                return Verdict::Defer;
            }
            // With no ranks registered, admit: selection answers `no_workers` at once rather
            // than the request waiting out its queue deadline.
            if let Some(limit) = self.limits.per_worker
                && !self.workers.is_empty()
            {
                let Some(worker) = self.least_loaded_below(limit) else {
                    return Verdict::Defer;
                };
                request.set_worker_selection_target(WorkerTarget::exact(worker));
            }
            self.requests.insert(id, None);
        }
        Verdict::Admit(Classification::default_for(request))
    }

    fn on_event(&mut self, event: &ClassifyEvent, _now_ms: u64) {
        match *event {
            ClassifyEvent::Admitted { request_id } => {
                self.requests.entry(request_id).or_insert(None);
            }
            ClassifyEvent::Sent { request_id, worker } => {
                match self.requests.insert(request_id, Some(worker)) {
                    Some(Some(previous)) if previous == worker => {}
                    Some(Some(previous)) => {
                        self.remove(previous);
                        self.add(worker);
                    }
                    Some(None) | None => self.add(worker),
                }
            }
            ClassifyEvent::Completed { request_id, .. } => {
                if let Some(Some(worker)) = self.requests.remove(&request_id) {
                    self.remove(worker);
                }
            }
        }
    }

    /// Counts of departed ranks stay until their requests complete.
    fn workers_changed(&mut self, context: &RequestClassifierContext) {
        self.workers = context.workers().iter().map(|w| w.worker).collect();
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerRole;
    use uuid::Uuid;

    use super::*;
    use crate::classify::{ClassifierWorker, Completion};

    fn context(ranks: &[u64]) -> RequestClassifierContext {
        RequestClassifierContext::new(
            16,
            ranks
                .iter()
                .map(|id| ClassifierWorker::new(WorkerRank::new(*id, 0), Some(1000)))
                .collect(),
        )
    }

    fn build(yaml: &str, ranks: &[u64]) -> Box<dyn RequestClassifier> {
        let factory = provider(&ClassifierParameters::from_yaml(yaml).unwrap()).unwrap();
        factory(&context(ranks))
    }

    fn request(n: u128) -> ClassifyRequest {
        ClassifyRequest::new(
            Uuid::from_u128(n),
            "m",
            WorkerRole::Aggregated,
            32,
            n as u64,
        )
    }

    /// Classifies request `n`; on Admit, returns the target's worker id (0 when none).
    fn admit(classifier: &mut dyn RequestClassifier, n: u128) -> Option<u64> {
        let mut request = request(n);
        match classifier.classify(&mut request, 0) {
            Verdict::Admit(c) => {
                assert_eq!(c, Classification::default_for(&request));
                Some(request.worker_selection_target().map_or(0, |t| t.worker_id))
            }
            Verdict::Defer => None,
        }
    }

    fn sent(classifier: &mut dyn RequestClassifier, n: u128, worker: u64) {
        classifier.on_event(
            &ClassifyEvent::Sent {
                request_id: Uuid::from_u128(n),
                worker: WorkerRank::new(worker, 0),
            },
            0,
        );
    }

    fn completed(classifier: &mut dyn RequestClassifier, n: u128, outcome: Completion) {
        classifier.on_event(
            &ClassifyEvent::Completed {
                request_id: Uuid::from_u128(n),
                worker: None,
                outcome,
            },
            0,
        );
    }

    #[test]
    fn per_model_defers_at_the_limit_counting_admitted_requests_and_releases_on_completion() {
        let mut c = build("per_model: 2", &[1, 2]);
        assert_eq!(admit(&mut *c, 1), Some(0), "no per-worker limit: no target");
        assert_eq!(admit(&mut *c, 2), Some(0));
        assert_eq!(admit(&mut *c, 3), None, "two admitted, none sent yet: full");
        assert_eq!(
            admit(&mut *c, 1),
            Some(0),
            "classifying an admitted request again"
        );
        sent(&mut *c, 1, 1);
        assert_eq!(admit(&mut *c, 3), None, "still two in flight");
        completed(&mut *c, 2, Completion::Rejected);
        assert_eq!(admit(&mut *c, 3), Some(0));
        completed(&mut *c, 1, Completion::Finished);
        completed(&mut *c, 1, Completion::Finished);
        assert_eq!(
            admit(&mut *c, 4),
            Some(0),
            "a repeated completion is harmless"
        );
        assert_eq!(admit(&mut *c, 5), None);
    }

    #[test]
    fn per_worker_steers_to_the_least_loaded_rank_and_defers_when_all_are_full() {
        let mut c = build("per_worker: 2", &[1, 2]);
        assert_eq!(admit(&mut *c, 1), Some(1), "ties go to the lowest rank");
        sent(&mut *c, 1, 1);
        assert_eq!(admit(&mut *c, 2), Some(2));
        sent(&mut *c, 2, 2);
        assert_eq!(admit(&mut *c, 3), Some(1));
        // The policy may place elsewhere: the count follows `Sent`, not the target.
        sent(&mut *c, 3, 2);
        assert_eq!(admit(&mut *c, 4), Some(1));
        sent(&mut *c, 4, 1);
        assert_eq!(admit(&mut *c, 5), None, "every rank at 2");
        completed(&mut *c, 3, Completion::Failed);
        assert_eq!(admit(&mut *c, 5), Some(2));
    }

    #[test]
    fn a_retry_moves_the_count_and_departed_ranks_stop_counting_for_admission() {
        let mut c = build("per_worker: 1\nper_model: 10", &[1, 2]);
        assert_eq!(admit(&mut *c, 1), Some(1));
        sent(&mut *c, 1, 1);
        sent(&mut *c, 1, 2);
        assert_eq!(admit(&mut *c, 2), Some(1), "the retry left rank 1");
        sent(&mut *c, 2, 1);
        assert_eq!(admit(&mut *c, 3), None);
        c.workers_changed(&context(&[1, 2, 3]));
        assert_eq!(admit(&mut *c, 3), Some(3), "a new rank takes requests");
        c.workers_changed(&context(&[]));
        assert_eq!(
            admit(&mut *c, 4),
            Some(0),
            "no ranks: admitted, selection answers"
        );
    }

    #[test]
    fn a_request_sent_without_admission_counts_and_memory_is_released() {
        let mut c = MaxInFlight::new(
            Parameters {
                per_worker: None,
                per_model: Some(1),
            },
            &context(&[1]),
        );
        sent(&mut c, 9, 1);
        assert_eq!(
            (c.in_flight(), c.in_flight_on(WorkerRank::new(1, 0))),
            (1, 1)
        );
        assert_eq!(admit(&mut c, 1), None);
        completed(&mut c, 9, Completion::Finished);
        assert_eq!((c.in_flight(), c.per_worker.len()), (0, 0));
        assert_eq!(admit(&mut c, 1), Some(0));
    }

    #[test]
    fn parameters_are_validated_naming_the_parameter() {
        let err = |yaml: &str| {
            provider(&ClassifierParameters::from_yaml(yaml).unwrap())
                .err()
                .unwrap()
                .to_string()
        };
        assert_eq!(
            err("per_worker: 0"),
            "parameter `per_worker` must be at least 1"
        );
        assert_eq!(
            err("per_model: 0\nper_worker: 3"),
            "parameter `per_model` must be at least 1"
        );
        assert!(err("{}").contains("`per_worker`, `per_model`"));
        assert!(err("per_wroker: 2").contains("unknown parameter `per_wroker`"));
        assert!(
            err("per_model: -1").contains("per_model"),
            "{}",
            err("per_model: -1")
        );
    }
}
