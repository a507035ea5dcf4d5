//! One policy per (role, model), built on first use from the resolved selection and kept for
//! the process's life (policies may hold state, e.g. a round-robin cursor), each with its own
//! seeded random generator.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvroute_common::messages::WorkerRole;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::decide::PartitionPolicy;
use crate::pipeline::WorkerInputs;
use crate::registry::{ConfigError, ResolvedPolicies};
use crate::select::SelectionSettings;

/// A partition's policy, with the signal groups a selection must gather for it. The lock is
/// held only for the decision itself (no I/O happens under it), so it is a plain mutex.
pub struct PolicySlot {
    pub inputs: WorkerInputs,
    state: Mutex<PartitionPolicy>,
}

impl PolicySlot {
    pub fn lock(&self) -> MutexGuard<'_, PartitionPolicy> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for PolicySlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicySlot")
            .field("inputs", &self.inputs)
            .finish_non_exhaustive()
    }
}

/// (role, model, the policy a request asked for by name).
type SlotKey = (WorkerRole, String, Option<String>);

/// The policies built so far.
#[derive(Debug)]
pub struct Policies {
    resolved: ResolvedPolicies,
    seed: u64,
    slots: Mutex<HashMap<SlotKey, Arc<PolicySlot>>>,
}

impl Policies {
    pub fn new(resolved: ResolvedPolicies, seed: u64) -> Self {
        Self {
            resolved,
            seed,
            slots: Mutex::new(HashMap::new()),
        }
    }

    pub fn resolved(&self) -> &ResolvedPolicies {
        &self.resolved
    }

    /// The slot of (role, model) — or of the policy `requested` by name — built on first use.
    /// Call only for partitions that exist, so the map stays bounded by the models ever
    /// registered times the policies known at startup. `Ok(None)`: no policy of that name.
    pub fn slot(
        &self,
        role: WorkerRole,
        model: &str,
        requested: Option<&str>,
        settings: &SelectionSettings,
    ) -> Result<Option<Arc<PolicySlot>>, ConfigError> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let key = (role, model.to_owned(), requested.map(str::to_owned));
        if let Some(slot) = slots.get(&key) {
            return Ok(Some(slot.clone()));
        }
        let policy = match requested {
            None => self.resolved.build(role, model)?,
            Some(name) => match self.resolved.build_named(name, role, model) {
                Some(policy) => policy?,
                None => return Ok(None),
            },
        };
        tracing::info!(%role, model, policy = policy.name(), "built a policy");
        // Distinct, reproducible streams per partition.
        let partition_seed = model
            .bytes()
            .chain(requested.unwrap_or("").bytes())
            .fold(self.seed ^ (role as u64), |h, b| {
                h.rotate_left(5) ^ u64::from(b)
            });
        let state = PartitionPolicy::new(policy, StdRng::seed_from_u64(partition_seed), settings);
        let slot = Arc::new(PolicySlot {
            inputs: state.inputs,
            state: Mutex::new(state),
        });
        slots.insert(key, slot.clone());
        Ok(Some(slot))
    }
}
