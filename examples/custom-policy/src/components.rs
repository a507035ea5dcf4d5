//! The policy's three components: a hard cap on active requests (filter), active requests as
//! cost (scorer), and a picker that keeps the session's soft target until it gets busy.

use kvroute_router::pipeline::{
    ComponentError, ScoredCandidate, WorkerCandidate, WorkerFilter, WorkerInputs, WorkerPicker,
    WorkerScorer,
};
use kvroute_router::request::RequestContext;
use rand::RngCore;

fn active_requests(candidate: &WorkerCandidate<'_>) -> Result<u64, ComponentError> {
    candidate
        .load()
        .map(|load| load.active_requests)
        .ok_or(ComponentError::MissingInput {
            group: WorkerInputs::LOAD,
        })
}

/// Rejects ranks already running `limit` requests or more.
#[derive(Debug)]
pub struct MaxActiveRequestsFilter {
    pub limit: u64,
}

impl WorkerFilter for MaxActiveRequestsFilter {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    fn keep(
        &mut self,
        _context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<bool, ComponentError> {
        Ok(active_requests(candidate)? < self.limit)
    }
}

/// Cost = requests active on the rank.
#[derive(Debug)]
pub struct ActiveRequestsScorer;

impl WorkerScorer for ActiveRequestsScorer {
    fn name(&self) -> &str {
        "active_requests"
    }

    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    fn score(
        &mut self,
        _context: &RequestContext,
        candidate: &WorkerCandidate<'_>,
    ) -> Result<f64, ComponentError> {
        Ok(active_requests(candidate)? as f64)
    }
}

/// Keeps the affinity target while its cost is at most `busy_threshold`; otherwise the
/// lowest cost, ties to the lowest worker id (row order is unspecified, so compare values).
#[derive(Debug)]
pub struct StickyUntilBusyPicker {
    pub busy_threshold: f64,
}

impl WorkerPicker for StickyUntilBusyPicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    fn pick(
        &mut self,
        context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        _rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        if let Some(target) = context.affinity_target()
            && let Some(row) = (0..rows.len()).find(|i| target.matches(rows[*i].worker()))
            && rows[row].cost() <= self.busy_threshold
        {
            return Ok(row);
        }
        (0..rows.len())
            .min_by(|a, b| {
                rows[*a]
                    .cost()
                    .total_cmp(&rows[*b].cost())
                    .then(rows[*a].worker().cmp(&rows[*b].worker()))
            })
            .ok_or_else(|| ComponentError::failed("no rows"))
    }
}
