//! Pipeline contract tests: filter order, typed failures, required inputs, breakdowns.

use kvroute_common::messages::WorkerCard;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::request::RequestContext;
use crate::testing::cards;
use crate::worker::WorkerRank;

/// Rejects odd worker ids.
struct EvenOnly;
impl WorkerFilter for EvenOnly {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }
    fn keep(
        &mut self,
        _: &RequestContext,
        c: &WorkerCandidate<'_>,
    ) -> Result<bool, ComponentError> {
        Ok(c.worker().worker_id.is_multiple_of(2))
    }
}

/// Rejects everything, and counts how often it was asked.
struct Nothing(usize);
impl WorkerFilter for Nothing {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::CACHE
    }
    fn keep(
        &mut self,
        _: &RequestContext,
        _: &WorkerCandidate<'_>,
    ) -> Result<bool, ComponentError> {
        self.0 += 1;
        Ok(false)
    }
}

/// Cost = the worker id times a factor.
struct IdCost(f64);
impl WorkerScorer for IdCost {
    fn name(&self) -> &str {
        "id"
    }
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }
    fn score(
        &mut self,
        _: &RequestContext,
        c: &WorkerCandidate<'_>,
    ) -> Result<f64, ComponentError> {
        Ok(c.worker().worker_id as f64 * self.0)
    }
}

/// Picks the lowest cost (first on ties), or a fixed row.
struct Fixed(Option<usize>);
impl WorkerPicker for Fixed {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::PREFERRED_TAINT
    }
    fn pick(
        &mut self,
        _: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        _: &mut dyn rand::RngCore,
    ) -> Result<usize, ComponentError> {
        Ok(self.0.unwrap_or_else(|| {
            (0..rows.len())
                .min_by(|a, b| rows[*a].cost().total_cmp(&rows[*b].cost()))
                .unwrap_or(0)
        }))
    }
}

fn rows(cards: &[WorkerCard]) -> Vec<WorkerCandidate<'_>> {
    cards
        .iter()
        .map(|c| WorkerCandidate::new(WorkerRank::new(c.worker_id, 0), c))
        .collect()
}

fn run(
    policy: &mut WorkerSelectionPolicy,
    cards: &[WorkerCard],
) -> Result<WorkerRank, PipelineError> {
    let mut rng = StdRng::seed_from_u64(1);
    let ctx = RequestContext::new(4, 16);
    policy
        .run(&ctx, rows(cards), &mut rng)
        .map(|c| c.row.worker())
}

#[test]
fn required_inputs_is_the_union_of_all_components() {
    let policy = WorkerSelectionPolicy::new(vec![Box::new(IdCost(1.0))], Box::new(Fixed(None)))
        .with_filters(vec![Box::new(Nothing(0))]);
    let inputs = policy.required_inputs();
    assert!(inputs.contains(WorkerInputs::CACHE | WorkerInputs::LOAD));
    assert!(inputs.contains(WorkerInputs::PREFERRED_TAINT));
    let bare = WorkerSelectionPolicy::new(Vec::new(), Box::new(LowestFirst));
    assert!(bare.required_inputs().is_empty());
}

struct LowestFirst;
impl WorkerPicker for LowestFirst {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }
    fn pick(
        &mut self,
        _: &RequestContext,
        _: &[ScoredCandidate<'_>],
        _: &mut dyn rand::RngCore,
    ) -> Result<usize, ComponentError> {
        Ok(0)
    }
}

#[test]
fn filters_run_in_order_and_costs_sum_over_scorers() {
    let cards = cards(5);
    let mut policy = WorkerSelectionPolicy::new(
        vec![Box::new(IdCost(1.0)), Box::new(IdCost(0.5))],
        Box::new(Fixed(None)),
    )
    .with_filters(vec![Box::new(EvenOnly)]);
    let ctx = RequestContext::new(4, 16);
    let mut rng = StdRng::seed_from_u64(1);
    let choice = policy.run(&ctx, rows(&cards), &mut rng).unwrap();
    assert_eq!(choice.row.worker(), WorkerRank::new(2, 0));
    assert_eq!(choice.cost.total, 3.0);
    assert_eq!(choice.cost.terms["id"], 3.0, "same-named terms add up");
}

#[test]
fn a_later_filter_sees_only_survivors_and_rejecting_all_is_typed() {
    let cards = cards(4);
    let mut policy = WorkerSelectionPolicy::new(Vec::new(), Box::new(Fixed(None)))
        .with_filters(vec![Box::new(EvenOnly), Box::new(Nothing(0))]);
    let err = run(&mut policy, &cards).unwrap_err();
    let PipelineError::AllFiltered { rejected } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(rejected.len(), 4);
    let by_nothing = rejected.iter().filter(|(_, f)| f == "Nothing").count();
    assert_eq!(
        by_nothing, 2,
        "only the even survivors reach the second filter"
    );
    assert_eq!(err.code(), kvroute_common::messages::ErrorCode::AllFiltered);
}

#[test]
fn non_finite_costs_and_invalid_picks_are_policy_errors() {
    let cards = cards(2);
    let mut nan =
        WorkerSelectionPolicy::new(vec![Box::new(IdCost(f64::NAN))], Box::new(Fixed(None)));
    assert!(matches!(
        run(&mut nan, &cards),
        Err(PipelineError::NonFiniteCost { .. })
    ));
    let mut inf = WorkerSelectionPolicy::new(
        vec![Box::new(IdCost(f64::MAX)), Box::new(IdCost(f64::MAX))],
        Box::new(Fixed(None)),
    );
    assert!(matches!(
        run(&mut inf, &cards),
        Err(PipelineError::NonFiniteCost { .. })
    ));
    let mut bad = WorkerSelectionPolicy::new(Vec::new(), Box::new(Fixed(Some(2))));
    let err = run(&mut bad, &cards).unwrap_err();
    assert_eq!(err, PipelineError::InvalidPick { row: 2, rows: 2 });
    assert_eq!(err.code(), kvroute_common::messages::ErrorCode::PolicyError);
}

#[test]
fn the_exact_path_scores_without_filtering_or_picking() {
    let cards = cards(1);
    let mut policy =
        WorkerSelectionPolicy::new(vec![Box::new(IdCost(2.0))], Box::new(Fixed(Some(9))))
            .with_filters(vec![Box::new(Nothing(0))]);
    let ctx = RequestContext::new(4, 16);
    let choice = policy.score_exact(&ctx, rows(&cards)[0]).unwrap();
    assert_eq!(choice.cost.total, 2.0);
}
