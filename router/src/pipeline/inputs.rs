//! The optional per-worker signal groups a policy component can ask for. The core gathers and
//! materializes only the groups that some component of the policy (or eligibility) reads.

use std::fmt;
use std::ops::{BitOr, BitOrAssign};

/// A set of optional signal groups; combine with `|`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WorkerInputs(u8);

impl WorkerInputs {
    /// No optional input: worker identity and the request context only.
    pub const NONE: WorkerInputs = WorkerInputs(0);
    /// Prefix overlap per tier (device, host, disk) and the rank's cached-block count.
    pub const CACHE: WorkerInputs = WorkerInputs(1);
    /// Active prefill tokens, projected decode blocks and active requests.
    pub const LOAD: WorkerInputs = WorkerInputs(1 << 1);
    /// The cost multiplier from the request's preferred taints.
    pub const PREFERRED_TAINT: WorkerInputs = WorkerInputs(1 << 2);
    /// How the rank stands for the request's LoRA adapter (loaded, free slot, waiting, full).
    pub const ADAPTER: WorkerInputs = WorkerInputs(1 << 3);

    /// Whether every group of `other` is in `self`.
    pub fn contains(self, other: WorkerInputs) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl BitOr for WorkerInputs {
    type Output = WorkerInputs;
    fn bitor(self, rhs: WorkerInputs) -> WorkerInputs {
        WorkerInputs(self.0 | rhs.0)
    }
}

impl BitOrAssign for WorkerInputs {
    fn bitor_assign(&mut self, rhs: WorkerInputs) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for WorkerInputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [
            (WorkerInputs::CACHE, "CACHE"),
            (WorkerInputs::LOAD, "LOAD"),
            (WorkerInputs::PREFERRED_TAINT, "PREFERRED_TAINT"),
            (WorkerInputs::ADAPTER, "ADAPTER"),
        ]
        .into_iter()
        .filter(|(group, _)| self.contains(*group))
        .map(|(_, name)| name)
        .collect();
        if names.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&names.join(" | "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_combine_and_are_tested_by_containment() {
        let both = WorkerInputs::CACHE | WorkerInputs::LOAD;
        assert!(both.contains(WorkerInputs::CACHE));
        assert!(both.contains(WorkerInputs::LOAD));
        assert!(!both.contains(WorkerInputs::PREFERRED_TAINT));
        assert!(both.contains(WorkerInputs::NONE));
        assert!(WorkerInputs::NONE.is_empty());
        assert_eq!(format!("{both:?}"), "CACHE | LOAD");
    }
}
