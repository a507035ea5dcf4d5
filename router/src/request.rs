//! The request as filters, scorers and pickers see it: sizes, session metadata, the soft
//! affinity hint and per-request knobs. Built by the core from a `SelectRequest`.

use kvroute_common::messages::{SelectRequest, SessionContext};

use crate::worker::WorkerTarget;

/// Read-only request context handed to every policy component.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestContext {
    request_blocks: u32,
    block_size: u32,
    session: Option<SessionContext>,
    affinity_target: Option<WorkerTarget>,
    expected_output_tokens: Option<u32>,
    priority: Option<i32>,
    priority_jump_ms: u64,
    temperature_override: Option<f64>,
}

impl RequestContext {
    /// A context with only the prompt size; add the rest with the `with_*` methods.
    pub fn new(request_blocks: u32, block_size: u32) -> Self {
        Self {
            request_blocks,
            block_size,
            ..Self::default()
        }
    }

    /// Takes the session, expected output, priority, priority jump (negative as 0) and
    /// temperature of a wire request.
    pub fn from_request(request: &SelectRequest, request_blocks: u32, block_size: u32) -> Self {
        Self {
            request_blocks,
            block_size,
            session: request.session.clone(),
            affinity_target: None,
            expected_output_tokens: request.expected_output_tokens,
            priority: request.priority,
            priority_jump_ms: jump_ms(request.priority_jump_ms),
            temperature_override: request.temperature,
        }
    }

    pub fn with_session(mut self, session: SessionContext) -> Self {
        self.session = Some(session);
        self
    }

    pub fn with_affinity_target(mut self, target: Option<WorkerTarget>) -> Self {
        self.affinity_target = target;
        self
    }

    pub fn with_expected_output_tokens(mut self, tokens: u32) -> Self {
        self.expected_output_tokens = Some(tokens);
        self
    }

    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = Some(priority);
        self
    }

    pub fn with_priority_jump_ms(mut self, jump_ms: u64) -> Self {
        self.priority_jump_ms = jump_ms;
        self
    }

    pub fn with_temperature_override(mut self, temperature: f64) -> Self {
        self.temperature_override = Some(temperature);
        self
    }

    /// Full KV blocks in the prompt.
    pub fn request_blocks(&self) -> u32 {
        self.request_blocks
    }

    /// Tokens in one KV block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Session metadata, when the request belongs to a session.
    pub fn session_context(&self) -> Option<&SessionContext> {
        self.session.as_ref()
    }

    /// The session's current binding, offered as a hint in soft affinity mode. It may be absent
    /// from the candidate rows (ineligible, or rejected by a filter).
    pub fn affinity_target(&self) -> Option<WorkerTarget> {
        self.affinity_target
    }

    pub fn expected_output_tokens(&self) -> Option<u32> {
        self.expected_output_tokens
    }

    /// Larger is more urgent; `None` when the client gave none.
    pub fn priority(&self) -> Option<i32> {
        self.priority
    }

    /// The same as [`priority`](Self::priority), by the name classifiers use: the admission
    /// queue serves larger values first.
    pub fn strict_priority(&self) -> Option<i32> {
        self.priority
    }

    /// Milliseconds the request moved forward in its first-come-first-served order; 0 when
    /// absent or negative on the wire.
    pub fn priority_jump_ms(&self) -> u64 {
        self.priority_jump_ms
    }

    /// Replaces the policy's temperature for this request (0 = deterministic).
    pub fn temperature_override(&self) -> Option<f64> {
        self.temperature_override
    }
}

/// A wire `priority_jump_ms` as the router uses it: absent or negative is no jump.
pub(crate) fn jump_ms(wire: Option<i64>) -> u64 {
    wire.map_or(0, |ms| u64::try_from(ms).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_request_takes_the_priorities_and_a_negative_jump_is_none() {
        let mut wire = SelectRequest {
            priority: Some(4),
            priority_jump_ms: Some(120),
            ..SelectRequest::default()
        };
        let context = RequestContext::from_request(&wire, 3, 16);
        assert_eq!(context.priority(), Some(4));
        assert_eq!(context.strict_priority(), Some(4));
        assert_eq!(context.priority_jump_ms(), 120);
        wire.priority_jump_ms = Some(-5);
        assert_eq!(
            RequestContext::from_request(&wire, 3, 16).priority_jump_ms(),
            0
        );
        assert_eq!(RequestContext::new(1, 16).priority_jump_ms(), 0);
    }
}
