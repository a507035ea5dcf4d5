//! What a classifier answers: admit with a classification (class, due time, cost), or defer.

use super::request::ClassifyRequest;

/// How the admission queue treats an admitted request: by `class` (lower served first), then
/// by `due_ms` (first come, first served), and `cost` slots of the queue's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    /// Policy class; lower is served first. Default 0.
    pub class: u8,
    /// The first-come-first-served key (the host's milliseconds). Default: arrival minus the
    /// request's `priority_jump_ms`, saturating at 0.
    pub due_ms: u64,
    /// Queue slots the request occupies; at least 1 (the host treats 0 as 1). Default 1.
    pub cost: u32,
}

impl Classification {
    /// The classification of a request nobody classified: class 0, due at arrival less its
    /// priority jump, cost 1.
    pub fn default_for(request: &ClassifyRequest) -> Self {
        Self {
            class: 0,
            due_ms: request
                .arrived_ms()
                .saturating_sub(request.priority_jump_ms()),
            cost: 1,
        }
    }

    /// As the host applies it: a cost of 0 counts as 1.
    pub fn normalized(self) -> Self {
        Self {
            cost: self.cost.max(1),
            ..self
        }
    }
}

/// A classifier's answer for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Queue the request with this classification.
    Admit(Classification),
    /// Hold admission. The host classifies deferred requests again after each
    /// `ClassifyEvent` and on a timer, until their queue deadline (then they expire).
    Defer,
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerRole;
    use uuid::Uuid;

    use super::*;

    #[test]
    fn the_default_is_class_0_due_at_arrival_less_the_jump_cost_1() {
        let plain = ClassifyRequest::new(Uuid::nil(), "m", WorkerRole::Aggregated, 10, 1_000);
        assert_eq!(
            Classification::default_for(&plain),
            Classification {
                class: 0,
                due_ms: 1_000,
                cost: 1
            }
        );
        let jumped = plain.clone().with_priority_jump_ms(300);
        assert_eq!(Classification::default_for(&jumped).due_ms, 700);
        let far = plain.with_priority_jump_ms(5_000);
        assert_eq!(Classification::default_for(&far).due_ms, 0, "saturates");
        let free = Classification {
            class: 2,
            due_ms: 5,
            cost: 0,
        };
        assert_eq!(free.normalized().cost, 1);
        assert_eq!(free.normalized().class, 2);
    }
}
