//! The request as a classifier sees it: identity, partition, sizes, priorities, session,
//! arrival time and progress, and the soft worker preference a classifier may set.

use kvroute_common::RequestId;
use kvroute_common::messages::{SelectRequest, SessionContext, WorkerRole};

use super::progress::Progress;
use crate::worker::WorkerTarget;

/// One request waiting for admission; the host builds it from a `SelectRequest`.
#[derive(Debug, Clone)]
pub struct ClassifyRequest {
    request_id: RequestId,
    model: String,
    role: WorkerRole,
    input_tokens: u32,
    expected_output_tokens: Option<u32>,
    strict_priority: i32,
    priority_jump_ms: u64,
    session: Option<SessionContext>,
    arrived_ms: u64,
    progress: Progress,
    target: Option<WorkerTarget>,
}

impl ClassifyRequest {
    /// A request with only its identity and size; add the rest with the `with_*` methods. Its
    /// progress starts at `input_tokens`.
    pub fn new(
        request_id: RequestId,
        model: &str,
        role: WorkerRole,
        input_tokens: u32,
        arrived_ms: u64,
    ) -> Self {
        Self {
            request_id,
            model: model.to_owned(),
            role,
            input_tokens,
            expected_output_tokens: None,
            strict_priority: 0,
            priority_jump_ms: 0,
            session: None,
            arrived_ms,
            progress: Progress::new(u64::from(input_tokens)),
            target: None,
        }
    }

    /// Takes the model, role, expected output, priority (as the strict priority),
    /// `priority_jump_ms` (negative as 0) and session of a wire request.
    pub fn from_request(
        request: &SelectRequest,
        request_id: RequestId,
        input_tokens: u32,
        arrived_ms: u64,
    ) -> Self {
        let mut this = Self::new(
            request_id,
            &request.model,
            request.role,
            input_tokens,
            arrived_ms,
        );
        this.expected_output_tokens = request.expected_output_tokens;
        this.strict_priority = request.priority.unwrap_or(0);
        this.priority_jump_ms = crate::request::jump_ms(request.priority_jump_ms);
        this.session = request.session.clone();
        this
    }

    pub fn with_expected_output_tokens(mut self, tokens: u32) -> Self {
        self.expected_output_tokens = Some(tokens);
        self
    }

    pub fn with_strict_priority(mut self, priority: i32) -> Self {
        self.strict_priority = priority;
        self
    }

    pub fn with_priority_jump_ms(mut self, jump_ms: u64) -> Self {
        self.priority_jump_ms = jump_ms;
        self
    }

    pub fn with_session(mut self, session: SessionContext) -> Self {
        self.session = Some(session);
        self
    }

    /// Shares `progress` with an earlier attempt of the same request lifecycle; it is raised
    /// to at least this request's input tokens.
    pub fn with_progress(mut self, progress: Progress) -> Self {
        progress.observe(u64::from(self.input_tokens));
        self.progress = progress;
        self
    }

    pub fn request_id(&self) -> RequestId {
        self.request_id
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn role(&self) -> WorkerRole {
        self.role
    }

    /// Prompt tokens.
    pub fn input_tokens(&self) -> u32 {
        self.input_tokens
    }

    pub fn expected_output_tokens(&self) -> Option<u32> {
        self.expected_output_tokens
    }

    /// The request's strict priority: larger is served first; 0 when the client gave none.
    pub fn strict_priority(&self) -> i32 {
        self.strict_priority
    }

    /// Milliseconds the request moves forward in its first-come-first-served order.
    pub fn priority_jump_ms(&self) -> u64 {
        self.priority_jump_ms
    }

    pub fn session_context(&self) -> Option<&SessionContext> {
        self.session.as_ref()
    }

    /// When the request arrived (the host's milliseconds, the clock `now_ms` comes from).
    pub fn arrived_ms(&self) -> u64 {
        self.arrived_ms
    }

    /// The request's logical tokens so far (prompt plus generated; see [`Progress`]).
    pub fn progress(&self) -> u64 {
        self.progress.get()
    }

    /// The shared counter, for the host to raise and to hand to a retry.
    pub fn progress_handle(&self) -> &Progress {
        &self.progress
    }

    /// Replaces the request's soft worker preference: the host offers it to the worker
    /// selection policy as its affinity target. Pins, hard bindings and eligibility still
    /// decide; a policy may place the request elsewhere.
    pub fn set_worker_selection_target(&mut self, target: WorkerTarget) {
        self.target = Some(target);
    }

    pub fn clear_worker_selection_target(&mut self) {
        self.target = None;
    }

    pub fn worker_selection_target(&self) -> Option<WorkerTarget> {
        self.target
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::SessionTrigger;
    use uuid::Uuid;

    use super::*;
    use crate::worker::WorkerRank;

    fn wire() -> SelectRequest {
        SelectRequest {
            model: "m".into(),
            role: WorkerRole::Decode,
            expected_output_tokens: Some(64),
            priority: Some(3),
            priority_jump_ms: Some(250),
            session: Some(SessionContext {
                id: "s".into(),
                trigger: SessionTrigger::ToolResult,
                ..SessionContext::default()
            }),
            ..SelectRequest::default()
        }
    }

    #[test]
    fn from_request_takes_the_wire_fields() {
        let id = Uuid::from_u128(7);
        let request = ClassifyRequest::from_request(&wire(), id, 100, 5_000);
        assert_eq!(request.request_id(), id);
        assert_eq!(request.model(), "m");
        assert_eq!(request.role(), WorkerRole::Decode);
        assert_eq!(request.input_tokens(), 100);
        assert_eq!(request.expected_output_tokens(), Some(64));
        assert_eq!(request.strict_priority(), 3);
        assert_eq!(request.priority_jump_ms(), 250);
        assert_eq!(request.session_context().unwrap().id, "s");
        assert_eq!(request.arrived_ms(), 5_000);
        assert_eq!(request.progress(), 100, "progress starts at the prompt");
        assert_eq!(request.worker_selection_target(), None);
    }

    #[test]
    fn absent_and_negative_wire_values_are_neutral() {
        let mut request = wire();
        request.priority = None;
        request.priority_jump_ms = Some(-40);
        let classify = ClassifyRequest::from_request(&request, Uuid::nil(), 1, 0);
        assert_eq!(classify.strict_priority(), 0);
        assert_eq!(classify.priority_jump_ms(), 0, "negative is no jump");
        request.priority_jump_ms = None;
        assert_eq!(
            ClassifyRequest::from_request(&request, Uuid::nil(), 1, 0).priority_jump_ms(),
            0
        );
    }

    #[test]
    fn a_shared_progress_is_raised_to_the_prompt_and_the_target_can_be_cleared() {
        let earlier = Progress::new(10);
        let mut request = ClassifyRequest::new(Uuid::nil(), "m", WorkerRole::Aggregated, 50, 0)
            .with_progress(earlier.clone());
        assert_eq!(earlier.get(), 50);
        request.progress_handle().observe(80);
        assert_eq!(earlier.get(), 80, "the retry shares the counter");
        let target = WorkerTarget::exact(WorkerRank::new(3, 0));
        request.set_worker_selection_target(target);
        assert_eq!(request.worker_selection_target(), Some(target));
        request.clear_worker_selection_target();
        assert_eq!(request.worker_selection_target(), None);
    }
}
