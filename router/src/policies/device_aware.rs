//! `device-aware-weighted`: for fleets mixing CPU and accelerator workers. Compares the two
//! device groups by capability-normalized load, then takes the least-loaded rank of the
//! winning group.
//!
//! ```text
//! normalized_load(group) = (in_flight(group) + 1) / (ranks(group) · weight(group))
//! weight(cpu) = 1,  weight(accelerator) = accelerator_to_cpu_ratio
//! ```
//!
//! `in_flight` is the sum of the group's ranks' `active_requests` (the LOAD input: reports
//! plus the router's own decisions). The `+ 1` counts the new request in the group being
//! compared — the load that group would have if it took the request — so with both groups
//! idle the faster group wins, and requests split in the ratio of the groups' capacities
//! (`ratio · accelerator ranks : cpu ranks`) instead of alternating. Equal loads go to the
//! accelerator group. Within the group: the fewest active requests, ties to a random one of
//! them (the pipeline's seeded generator, drawn in rank order). One group present: plain
//! least-loaded over it.
//!
//! A rank is a CPU rank when its card's label `device_label` (default `kvroute.io/device`)
//! is `cpu` (any case); any other value, or no label, is an accelerator.

use std::sync::Arc;

use rand::{Rng, RngCore};
use serde::Deserialize;

use super::load_metric::{LoadMetric, LoadScorer};
use crate::pipeline::{
    ComponentError, ScoredCandidate, WorkerCandidate, WorkerInputs, WorkerPicker,
    WorkerSelectionPolicy,
};
use crate::registry::{PolicyFactory, PolicyParameters, ProviderError};
use crate::request::RequestContext;

/// The registered type name.
pub const TYPE: &str = "device-aware-weighted";

/// The default card label naming a worker's device.
pub const DEVICE_LABEL: &str = "kvroute.io/device";

/// Parameters; every field is optional in YAML.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceAwareParameters {
    /// The card label whose value `cpu` marks a CPU worker. Default `kvroute.io/device`.
    pub device_label: String,
    /// Throughput of one accelerator rank in CPU ranks, > 0 (finite). Default 4.
    pub accelerator_to_cpu_ratio: f64,
}

impl Default for DeviceAwareParameters {
    fn default() -> Self {
        Self {
            device_label: DEVICE_LABEL.to_owned(),
            accelerator_to_cpu_ratio: 4.0,
        }
    }
}

impl DeviceAwareParameters {
    pub fn validate(&self) -> Result<(), ProviderError> {
        let ratio = self.accelerator_to_cpu_ratio;
        if !ratio.is_finite() || ratio <= 0.0 {
            return Err(ProviderError::new(format!(
                "accelerator_to_cpu_ratio must be a finite number > 0, got {ratio}"
            )));
        }
        if self.device_label.is_empty() {
            return Err(ProviderError::new("device_label must not be empty"));
        }
        Ok(())
    }

    /// The policy these parameters describe: the `active_requests` term (for the reply's
    /// cost breakdown) and the group picker.
    pub fn policy(&self) -> WorkerSelectionPolicy {
        WorkerSelectionPolicy::new(
            vec![Box::new(LoadScorer {
                metric: LoadMetric::ActiveRequests,
            })],
            Box::new(DeviceAwarePicker {
                parameters: self.clone(),
            }),
        )
        .named(TYPE)
    }
}

/// The provider registered as `device-aware-weighted`.
pub fn provider(parameters: &PolicyParameters) -> Result<PolicyFactory, ProviderError> {
    let parameters: DeviceAwareParameters = parameters.deserialize()?;
    parameters.validate()?;
    Ok(Arc::new(move |_context| Ok(parameters.policy())))
}

/// A rank's device group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Accelerator,
}

/// The device a candidate's card declares under `label`.
pub fn device_of(candidate: &WorkerCandidate<'_>, label: &str) -> Device {
    match candidate.label(label) {
        Some(v) if v.eq_ignore_ascii_case("cpu") => Device::Cpu,
        _ => Device::Accelerator,
    }
}

/// One group's ranks and requests in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupLoad {
    pub ranks: u64,
    pub in_flight: u64,
}

impl GroupLoad {
    /// `(in_flight + 1) / (ranks · weight)`: the group's load per unit of capacity if it took
    /// the new request; `None` for an empty group.
    pub fn normalized_with_request(&self, weight: f64) -> Option<f64> {
        (self.ranks > 0).then(|| (self.in_flight + 1) as f64 / (self.ranks as f64 * weight))
    }
}

/// The group a request goes to: the lower normalized load counting the request, ties to the
/// accelerators; `None` when both are empty.
pub fn choose_group(cpu: GroupLoad, accelerator: GroupLoad, ratio: f64) -> Option<Device> {
    match (
        cpu.normalized_with_request(1.0),
        accelerator.normalized_with_request(ratio),
    ) {
        (Some(c), Some(a)) if c < a => Some(Device::Cpu),
        (_, Some(_)) => Some(Device::Accelerator),
        (Some(_), None) => Some(Device::Cpu),
        (None, None) => None,
    }
}

/// Chooses the group, then the least-loaded rank in it.
#[derive(Debug, Clone)]
pub struct DeviceAwarePicker {
    pub parameters: DeviceAwareParameters,
}

impl WorkerPicker for DeviceAwarePicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }

    fn pick(
        &mut self,
        _context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        rng: &mut dyn RngCore,
    ) -> Result<usize, ComponentError> {
        let label = self.parameters.device_label.as_str();
        let mut rows_of = Vec::with_capacity(rows.len());
        let (mut cpu, mut accelerator) = (GroupLoad::default(), GroupLoad::default());
        for row in rows {
            let requests = row
                .load()
                .ok_or(ComponentError::MissingInput {
                    group: WorkerInputs::LOAD,
                })?
                .active_requests;
            let device = device_of(row.candidate(), label);
            let group = match device {
                Device::Cpu => &mut cpu,
                Device::Accelerator => &mut accelerator,
            };
            group.ranks += 1;
            group.in_flight += requests;
            rows_of.push((device, requests));
        }
        let Some(chosen) = choose_group(cpu, accelerator, self.parameters.accelerator_to_cpu_ratio)
        else {
            return Err(ComponentError::failed("no rows"));
        };
        let least = rows_of
            .iter()
            .filter(|(d, _)| *d == chosen)
            .map(|(_, r)| *r)
            .min()
            .unwrap_or(0);
        let mut tied: Vec<usize> = (0..rows.len())
            .filter(|&i| rows_of[i] == (chosen, least))
            .collect();
        tied.sort_by_key(|&i| rows[i].worker());
        Ok(match tied.len() {
            1 => tied[0],
            n => tied[rng.random_range(0..n)],
        })
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerCard;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::pipeline::LoadSignals;
    use crate::policies::tests::build;
    use crate::signals::ObservedLoad;
    use crate::testing::card;
    use crate::worker::WorkerRank;

    fn group(ranks: u64, in_flight: u64) -> GroupLoad {
        GroupLoad { ranks, in_flight }
    }

    #[test]
    fn normalized_loads_follow_the_seed_formula_with_the_request_counted() {
        // 2 CPU ranks with 3 in flight: (3 + 1) / (2 · 1) = 2.
        assert_eq!(group(2, 3).normalized_with_request(1.0), Some(2.0));
        // 2 accelerator ranks at ratio 4 with 11 in flight: 12 / 8 = 1.5.
        assert_eq!(group(2, 11).normalized_with_request(4.0), Some(1.5));
        assert_eq!(group(0, 0).normalized_with_request(4.0), None);
    }

    #[test]
    fn the_group_with_the_lower_normalized_load_wins_and_ties_go_to_the_accelerators() {
        let r = 4.0;
        // Idle: 1/1 against 1/4.
        assert_eq!(
            choose_group(group(1, 0), group(1, 0), r),
            Some(Device::Accelerator)
        );
        // Accelerator at 3 in flight: 4/4 = 1 ties with the idle CPU's 1/1.
        assert_eq!(
            choose_group(group(1, 0), group(1, 3), r),
            Some(Device::Accelerator)
        );
        // At 4: 5/4 > 1.
        assert_eq!(choose_group(group(1, 0), group(1, 4), r), Some(Device::Cpu));
        // One group present: it, whatever its load.
        assert_eq!(
            choose_group(group(0, 0), group(3, 90), r),
            Some(Device::Accelerator)
        );
        assert_eq!(
            choose_group(group(2, 50), group(0, 0), r),
            Some(Device::Cpu)
        );
        assert_eq!(choose_group(group(0, 0), group(0, 0), r), None);
    }

    fn device_card(id: u64, device: Option<&str>) -> WorkerCard {
        let mut c = card(id);
        if let Some(d) = device {
            c.labels.insert(DEVICE_LABEL.to_owned(), d.to_owned());
        }
        c
    }

    /// Picks among `cards` with `requests` active each; returns the chosen worker id.
    fn pick(
        policy: &mut WorkerSelectionPolicy,
        cards: &[WorkerCard],
        requests: &[u64],
        seed: u64,
    ) -> u64 {
        let rows = cards
            .iter()
            .zip(requests)
            .map(|(c, &n)| {
                let load = ObservedLoad {
                    active_requests: n,
                    ..ObservedLoad::default()
                };
                WorkerCandidate::new(WorkerRank::new(c.worker_id, 0), c)
                    .with_load(LoadSignals::project(Some(load), 1))
            })
            .collect();
        let mut rng = StdRng::seed_from_u64(seed);
        policy
            .run(&RequestContext::new(1, 16), rows, &mut rng)
            .unwrap()
            .row
            .worker()
            .worker_id
    }

    #[test]
    fn the_least_loaded_rank_of_the_chosen_group_is_picked() {
        let mut policy = build(provider, "");
        assert_eq!(policy.required_inputs(), WorkerInputs::LOAD);
        let cards = [
            device_card(1, Some("cpu")),
            device_card(2, Some("CPU")),
            device_card(3, Some("gpu")),
            device_card(4, None),
        ];
        // CPU (0+1+1)/2 = 1; accelerators (5+3+1)/(2·4) = 1.125: the CPU group, its idle rank,
        // although accelerator 4 has fewer requests than CPU rank 2.
        assert_eq!(pick(&mut policy, &cards, &[0, 1, 5, 3], 0), 1);
        // Accelerators (2+1+1)/8 = 0.5 < CPU (4+4+1)/2: the less loaded accelerator.
        assert_eq!(pick(&mut policy, &cards, &[4, 4, 2, 1], 0), 4);
        // Ties within the group go to either, by seed, and both are reachable.
        let picks: std::collections::BTreeSet<u64> = (0..32)
            .map(|s| pick(&mut policy, &cards, &[9, 9, 1, 1], s))
            .collect();
        assert_eq!(picks, [3, 4].into());
        // The cost breakdown still says what the rank carried.
        let row =
            WorkerCandidate::new(WorkerRank::new(1, 0), &cards[0]).with_load(LoadSignals::project(
                Some(ObservedLoad {
                    active_requests: 7,
                    ..ObservedLoad::default()
                }),
                1,
            ));
        let cost = policy
            .score_exact(&RequestContext::new(1, 16), row)
            .unwrap()
            .cost;
        assert_eq!(cost.terms["active_requests"], 7.0);
    }

    #[test]
    fn a_fleet_of_one_device_is_plain_least_loaded() {
        let mut policy = build(provider, "");
        let gpus: Vec<WorkerCard> = (1..=3).map(|i| device_card(i, None)).collect();
        assert_eq!(pick(&mut policy, &gpus, &[5, 2, 9], 0), 2);
        let cpus: Vec<WorkerCard> = (1..=3).map(|i| device_card(i, Some("cpu"))).collect();
        assert_eq!(pick(&mut policy, &cpus, &[5, 9, 2], 0), 3);
    }

    #[test]
    fn requests_split_in_the_ratio_of_capacities() {
        // One CPU rank and one accelerator rank at ratio 3, no request ever finishing: the
        // accelerator takes 3 of every 4.
        let mut policy = build(provider, "accelerator_to_cpu_ratio: 3");
        let cards = [device_card(1, Some("cpu")), device_card(2, None)];
        let mut requests = [0u64, 0];
        for i in 0..400 {
            let w = pick(&mut policy, &cards, &requests, i);
            requests[w as usize - 1] += 1;
        }
        assert_eq!(requests, [100, 300]);
    }

    #[test]
    fn the_label_is_a_parameter_and_parameters_are_validated() {
        let mut policy = build(provider, "device_label: example.com/kind");
        let mut cpu = card(1);
        cpu.labels.insert("example.com/kind".into(), "cpu".into());
        let cards = [cpu, device_card(2, Some("cpu"))];
        // Worker 2's `kvroute.io/device: cpu` is not the configured label: an accelerator.
        assert_eq!(pick(&mut policy, &cards, &[0, 0], 0), 2);
        let bad = |yaml: &str| provider(&PolicyParameters::from_yaml(yaml).unwrap()).err();
        for yaml in [
            "accelerator_to_cpu_ratio: 0",
            "accelerator_to_cpu_ratio: -2",
            "accelerator_to_cpu_ratio: .inf",
        ] {
            assert!(
                bad(yaml)
                    .unwrap()
                    .message
                    .contains("accelerator_to_cpu_ratio"),
                "{yaml}"
            );
        }
        assert!(
            bad("device_label: ''")
                .unwrap()
                .message
                .contains("device_label")
        );
        assert!(bad("ratio: 2").is_some());
        assert!(bad("").is_none());
    }
}
