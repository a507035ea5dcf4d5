//! `session-serial`, an example request classifier: at most `max_in_flight_per_session`
//! requests of one session in flight at once (later ones are deferred until one completes),
//! and each admitted request of a session is steered, softly, to the worker its session was
//! last sent to. `sticky-until-busy` honours that preference through its affinity target.
//!
//! Memory: one entry per request in flight (dropped at `Completed`) and one per session
//! remembered, at most `max_sessions`; beyond that the least recently used idle sessions are
//! forgotten, and a session's entry goes as soon as its final request completes.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvroute_common::{RequestId, SessionId};
use kvroute_router::classify::{
    Classification, ClassifierParameters, ClassifyEvent, ClassifyRequest, ProviderError,
    RequestClassifier, RequestClassifierContext, RequestClassifierFactory, Verdict,
};
use kvroute_router::worker::{WorkerRank, WorkerTarget};
use serde::Deserialize;

/// The type name in `request_classifier.type`.
pub const CLASSIFIER_TYPE_NAME: &str = "session-serial";

/// `request_classifier.parameters` of `session-serial`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionSerialParameters {
    /// Requests of one session in flight at once; at least 1. Required.
    pub max_in_flight_per_session: u32,
    /// Sessions remembered (their last worker); at least 1. Default 65 536.
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
}

fn default_max_sessions() -> usize {
    65_536
}

/// Parses and validates the parameters once, at startup; the factory builds one classifier per
/// partition.
pub fn classifier_provider(
    parameters: &ClassifierParameters,
) -> Result<RequestClassifierFactory, ProviderError> {
    let parameters: SessionSerialParameters = parameters.deserialize()?;
    if parameters.max_in_flight_per_session == 0 {
        return Err(ProviderError::new(
            "parameter `max_in_flight_per_session` must be at least 1",
        ));
    }
    if parameters.max_sessions == 0 {
        return Err(ProviderError::new(
            "parameter `max_sessions` must be at least 1",
        ));
    }
    Ok(Arc::new(move |context| {
        Box::new(SessionSerial::new(parameters, context))
    }))
}

/// The classifier of one partition.
#[derive(Debug)]
pub struct SessionSerial {
    parameters: SessionSerialParameters,
    /// The partition's ranks: a session's last worker is offered only while registered.
    workers: HashSet<WorkerRank>,
    sessions: HashMap<SessionId, Session>,
    /// Requests in flight (admitted here, not completed) and their session.
    requests: HashMap<RequestId, SessionId>,
}

#[derive(Debug, Default)]
struct Session {
    in_flight: u32,
    last_worker: Option<WorkerRank>,
    touched_ms: u64,
    /// A request marked final was admitted: forget the session once it is idle.
    ending: bool,
}

impl SessionSerial {
    pub fn new(parameters: SessionSerialParameters, context: &RequestClassifierContext) -> Self {
        let mut this = Self {
            parameters,
            workers: HashSet::new(),
            sessions: HashMap::new(),
            requests: HashMap::new(),
        };
        this.workers_changed(context);
        this
    }

    /// Sessions remembered.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Beyond `max_sessions`, forgets the least recently used idle sessions, down to 7/8 of it
    /// so the sort is paid once per many admissions.
    fn evict(&mut self) {
        if self.sessions.len() <= self.parameters.max_sessions {
            return;
        }
        let keep = self.parameters.max_sessions - self.parameters.max_sessions / 8;
        let mut idle: Vec<(u64, SessionId)> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.in_flight == 0)
            .map(|(id, s)| (s.touched_ms, id.clone()))
            .collect();
        idle.sort_unstable();
        let excess = self.sessions.len().saturating_sub(keep);
        for (_, id) in idle.into_iter().take(excess) {
            self.sessions.remove(&id);
        }
    }
}

impl RequestClassifier for SessionSerial {
    fn name(&self) -> &str {
        CLASSIFIER_TYPE_NAME
    }

    fn classify(&mut self, request: &mut ClassifyRequest, now_ms: u64) -> Verdict {
        let admit =
            |request: &ClassifyRequest| Verdict::Admit(Classification::default_for(request));
        let Some(session) = request.session_context() else {
            return admit(request);
        };
        if self.requests.contains_key(&request.request_id()) {
            return admit(request);
        }
        let (id, is_final) = (session.id.clone(), session.is_final);
        let state = self.sessions.entry(id.clone()).or_default();
        if state.in_flight >= self.parameters.max_in_flight_per_session {
            return Verdict::Defer;
        }
        state.in_flight += 1;
        state.touched_ms = now_ms;
        state.ending |= is_final;
        if let Some(worker) = state.last_worker
            && self.workers.contains(&worker)
        {
            request.set_worker_selection_target(WorkerTarget::exact(worker));
        }
        self.requests.insert(request.request_id(), id);
        self.evict();
        admit(request)
    }

    fn on_event(&mut self, event: &ClassifyEvent, now_ms: u64) {
        match *event {
            ClassifyEvent::Admitted { .. } => {}
            ClassifyEvent::Sent { request_id, worker } => {
                if let Some(id) = self.requests.get(&request_id)
                    && let Some(state) = self.sessions.get_mut(id)
                {
                    state.last_worker = Some(worker);
                    state.touched_ms = now_ms;
                }
            }
            ClassifyEvent::Completed { request_id, .. } => {
                let Some(id) = self.requests.remove(&request_id) else {
                    return;
                };
                if let Some(state) = self.sessions.get_mut(&id) {
                    state.in_flight = state.in_flight.saturating_sub(1);
                    state.touched_ms = now_ms;
                    if state.in_flight == 0 && state.ending {
                        self.sessions.remove(&id);
                    }
                }
            }
        }
    }

    fn workers_changed(&mut self, context: &RequestClassifierContext) {
        self.workers = context.workers().iter().map(|w| w.worker).collect();
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::{SessionContext, WorkerRole};
    use kvroute_router::classify::{ClassifierWorker, Completion};

    use super::*;

    fn context(ids: &[u64]) -> RequestClassifierContext {
        RequestClassifierContext::new(
            16,
            ids.iter()
                .map(|id| ClassifierWorker::new(WorkerRank::new(*id, 0), Some(1000)))
                .collect(),
        )
    }

    fn build(yaml: &str) -> Result<Box<dyn RequestClassifier>, ProviderError> {
        let factory = classifier_provider(&ClassifierParameters::from_yaml(yaml).unwrap())?;
        Ok(factory(&context(&[1, 2])))
    }

    fn request(n: u128, session: Option<&str>) -> ClassifyRequest {
        let request =
            ClassifyRequest::new(RequestId::from_u128(n), "m", WorkerRole::Aggregated, 64, 0);
        match session {
            Some(id) => request.with_session(SessionContext {
                id: id.into(),
                ..SessionContext::default()
            }),
            None => request,
        }
    }

    /// Some(target worker id, 0 for none) when admitted.
    fn classify(c: &mut dyn RequestClassifier, n: u128, session: Option<&str>) -> Option<u64> {
        let mut request = request(n, session);
        match c.classify(&mut request, n as u64) {
            Verdict::Admit(_) => Some(request.worker_selection_target().map_or(0, |t| t.worker_id)),
            Verdict::Defer => None,
        }
    }

    fn sent(c: &mut dyn RequestClassifier, n: u128, worker: u64) {
        let worker = WorkerRank::new(worker, 0);
        c.on_event(
            &ClassifyEvent::Sent {
                request_id: RequestId::from_u128(n),
                worker,
            },
            0,
        );
    }

    fn completed(c: &mut dyn RequestClassifier, n: u128) {
        let event = ClassifyEvent::Completed {
            request_id: RequestId::from_u128(n),
            worker: None,
            outcome: Completion::Finished,
        };
        c.on_event(&event, 0);
    }

    #[test]
    fn a_sessions_second_request_waits_for_the_first_to_complete() {
        let mut c = build("max_in_flight_per_session: 1").unwrap();
        assert_eq!(classify(&mut *c, 1, Some("a")), Some(0));
        assert_eq!(classify(&mut *c, 2, Some("a")), None, "deferred");
        assert_eq!(classify(&mut *c, 2, Some("a")), None, "still deferred");
        assert_eq!(
            classify(&mut *c, 3, Some("b")),
            Some(0),
            "other sessions go on"
        );
        assert_eq!(
            classify(&mut *c, 4, None),
            Some(0),
            "sessionless requests too"
        );
        sent(&mut *c, 1, 2);
        assert_eq!(classify(&mut *c, 2, Some("a")), None);
        completed(&mut *c, 1);
        assert_eq!(
            classify(&mut *c, 2, Some("a")),
            Some(2),
            "released, and steered"
        );
    }

    #[test]
    fn the_target_is_the_worker_the_session_was_last_sent_to_while_registered() {
        let mut c = build("max_in_flight_per_session: 2").unwrap();
        assert_eq!(classify(&mut *c, 1, Some("a")), Some(0), "no history yet");
        sent(&mut *c, 1, 1);
        assert_eq!(classify(&mut *c, 2, Some("a")), Some(1));
        sent(&mut *c, 2, 2);
        completed(&mut *c, 1);
        assert_eq!(
            classify(&mut *c, 3, Some("a")),
            Some(2),
            "the last Sent wins"
        );
        completed(&mut *c, 2);
        completed(&mut *c, 3);
        c.workers_changed(&context(&[1]));
        assert_eq!(
            classify(&mut *c, 4, Some("a")),
            Some(0),
            "worker 2 departed"
        );
    }

    #[test]
    fn final_sessions_and_idle_sessions_beyond_the_cap_are_forgotten() {
        let mut c = SessionSerial::new(
            SessionSerialParameters {
                max_in_flight_per_session: 1,
                max_sessions: 8,
            },
            &context(&[1]),
        );
        let mut last = request(1, None).with_session(SessionContext {
            id: "done".into(),
            is_final: true,
            ..SessionContext::default()
        });
        assert!(matches!(c.classify(&mut last, 0), Verdict::Admit(_)));
        assert_eq!(c.sessions(), 1);
        completed(&mut c, 1);
        assert_eq!(c.sessions(), 0, "a final session goes once idle");
        for n in 10..40u128 {
            let session = format!("s{n}");
            assert!(classify(&mut c, n, Some(&session)).is_some());
            completed(&mut c, n);
            assert!(c.sessions() <= 8, "{}", c.sessions());
        }
        // A session with a request in flight is never forgotten.
        assert!(classify(&mut c, 100, Some("busy")).is_some());
        for n in 200..230u128 {
            let session = format!("t{n}");
            assert!(classify(&mut c, n, Some(&session)).is_some());
            completed(&mut c, n);
        }
        assert_eq!(classify(&mut c, 101, Some("busy")), None, "still counted");
    }

    #[test]
    fn bad_parameters_name_the_parameter() {
        let err = |yaml: &str| build(yaml).err().unwrap().to_string();
        assert_eq!(
            err("max_in_flight_per_session: 0"),
            "parameter `max_in_flight_per_session` must be at least 1"
        );
        assert_eq!(
            err("{}"),
            "parameter `max_in_flight_per_session` is required"
        );
        assert!(
            err("max_in_flight_per_session: 1\nmax_session: 3")
                .starts_with("unknown parameter `max_session`"),
            "{}",
            err("max_in_flight_per_session: 1\nmax_session: 3")
        );
        assert_eq!(
            err("max_in_flight_per_session: 1\nmax_sessions: 0"),
            "parameter `max_sessions` must be at least 1"
        );
    }
}
