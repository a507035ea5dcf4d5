//! A worker-selection policy: filters (declaration order) → scorers (summed, validated) →
//! picker (validated row). Running it has no effect outside the policy's own components.

use std::fmt;

use kvroute_common::messages::CostBreakdown;
use rand::RngCore;

use super::candidate::{ScoredCandidate, WorkerCandidate};
use super::component::{WorkerFilter, WorkerPicker, WorkerScorer};
use super::error::{PipelineError, Stage};
use super::inputs::WorkerInputs;
use crate::request::RequestContext;

/// Filters, scorers and one picker, built once per (role, partition) by a policy factory.
pub struct WorkerSelectionPolicy {
    name: String,
    filters: Vec<Box<dyn WorkerFilter>>,
    scorers: Vec<Box<dyn WorkerScorer>>,
    picker: Box<dyn WorkerPicker>,
    required: WorkerInputs,
}

/// The picker's row with its cost, term by term.
#[derive(Debug, Clone)]
pub struct PolicyChoice<'a> {
    pub row: ScoredCandidate<'a>,
    pub cost: CostBreakdown,
}

impl WorkerSelectionPolicy {
    /// A policy without filters. The name is replaced by the configured instance name when the
    /// policy is built through the registry.
    pub fn new(scorers: Vec<Box<dyn WorkerScorer>>, picker: Box<dyn WorkerPicker>) -> Self {
        let mut policy = Self {
            name: "unnamed".to_owned(),
            filters: Vec::new(),
            scorers,
            picker,
            required: WorkerInputs::NONE,
        };
        policy.required = policy.collect_required_inputs();
        policy
    }

    /// Adds filters, run in the given order before scoring.
    pub fn with_filters(mut self, filters: Vec<Box<dyn WorkerFilter>>) -> Self {
        self.filters = filters;
        self.required = self.collect_required_inputs();
        self
    }

    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The configured instance name, reported in replies and decisions.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Union of the signal groups every component reads (computed once, at construction).
    /// The caller skips gathering what is not in here, e.g. the index query without `CACHE`.
    pub fn required_inputs(&self) -> WorkerInputs {
        self.required
    }

    fn collect_required_inputs(&self) -> WorkerInputs {
        let mut inputs = self.picker.required_inputs();
        for filter in &self.filters {
            inputs |= filter.required_inputs();
        }
        for scorer in &self.scorers {
            inputs |= scorer.required_inputs();
        }
        inputs
    }

    /// Filters, scores and picks one of `rows` (router-eligible ranks).
    pub fn run<'a>(
        &mut self,
        context: &RequestContext,
        rows: Vec<WorkerCandidate<'a>>,
        rng: &mut dyn RngCore,
    ) -> Result<PolicyChoice<'a>, PipelineError> {
        let rows = self.filter(context, rows)?;
        let mut scored = Vec::with_capacity(rows.len());
        // Every row's terms in one buffer (row-major), not one allocation per row.
        let per_row = self.scorers.len();
        let mut terms = Vec::with_capacity(rows.len() * per_row);
        for row in rows {
            let cost = self.score(context, &row, &mut terms)?;
            scored.push(ScoredCandidate::new(row, cost));
        }
        let index =
            self.picker
                .pick(context, &scored, rng)
                .map_err(|source| PipelineError::Component {
                    stage: Stage::Picker,
                    name: "picker".to_owned(),
                    worker: None,
                    source,
                })?;
        if index >= scored.len() {
            return Err(PipelineError::InvalidPick {
                row: index,
                rows: scored.len(),
            });
        }
        let row = scored[index];
        let cost = self.breakdown(row.cost(), &terms[index * per_row..(index + 1) * per_row]);
        Ok(PolicyChoice { row, cost })
    }

    /// The exact-target path (pins, hard session bindings): no filters and no picker; the row
    /// is only scored, so the reply still carries a cost breakdown.
    pub fn score_exact<'a>(
        &mut self,
        context: &RequestContext,
        row: WorkerCandidate<'a>,
    ) -> Result<PolicyChoice<'a>, PipelineError> {
        let mut terms = Vec::with_capacity(self.scorers.len());
        let cost = self.score(context, &row, &mut terms)?;
        Ok(PolicyChoice {
            row: ScoredCandidate::new(row, cost),
            cost: self.breakdown(cost, &terms),
        })
    }

    fn filter<'a>(
        &mut self,
        context: &RequestContext,
        mut rows: Vec<WorkerCandidate<'a>>,
    ) -> Result<Vec<WorkerCandidate<'a>>, PipelineError> {
        let mut rejected = Vec::new();
        for filter in &mut self.filters {
            let mut kept = Vec::with_capacity(rows.len());
            for row in rows {
                let keep =
                    filter
                        .keep(context, &row)
                        .map_err(|source| PipelineError::Component {
                            stage: Stage::Filter,
                            name: filter.name().to_owned(),
                            worker: Some(row.worker()),
                            source,
                        })?;
                if keep {
                    kept.push(row);
                } else {
                    rejected.push((row.worker(), filter.name().to_owned()));
                }
            }
            rows = kept;
        }
        if rows.is_empty() {
            return Err(PipelineError::AllFiltered { rejected });
        }
        Ok(rows)
    }

    /// The row's total cost; its terms, one per scorer, are appended to `terms`.
    fn score(
        &mut self,
        context: &RequestContext,
        row: &WorkerCandidate<'_>,
        terms: &mut Vec<f64>,
    ) -> Result<f64, PipelineError> {
        let mut total = 0.0;
        for scorer in &mut self.scorers {
            let cost = scorer
                .score(context, row)
                .map_err(|source| PipelineError::Component {
                    stage: Stage::Scorer,
                    name: scorer.name().to_owned(),
                    worker: Some(row.worker()),
                    source,
                })?;
            if !cost.is_finite() {
                return Err(PipelineError::NonFiniteCost {
                    scorer: scorer.name().to_owned(),
                    worker: row.worker(),
                    cost,
                });
            }
            total += cost;
            terms.push(cost);
        }
        if !total.is_finite() {
            return Err(PipelineError::NonFiniteCost {
                scorer: "sum".to_owned(),
                worker: row.worker(),
                cost: total,
            });
        }
        Ok(total)
    }

    fn breakdown(&self, total: f64, terms: &[f64]) -> CostBreakdown {
        let mut breakdown = CostBreakdown {
            total,
            ..CostBreakdown::default()
        };
        for (scorer, cost) in self.scorers.iter().zip(terms.iter().copied()) {
            *breakdown
                .terms
                .entry(scorer.name().to_owned())
                .or_insert(0.0) += cost;
        }
        breakdown
    }
}

impl fmt::Debug for WorkerSelectionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerSelectionPolicy")
            .field("name", &self.name)
            .field(
                "filters",
                &self.filters.iter().map(|c| c.name()).collect::<Vec<_>>(),
            )
            .field(
                "scorers",
                &self.scorers.iter().map(|c| c.name()).collect::<Vec<_>>(),
            )
            .field("required", &self.required)
            .finish_non_exhaustive()
    }
}
