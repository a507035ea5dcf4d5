//! Disaggregated serving's pure steps, shared by the service's pairing
//! (`service/pairing.rs`) and `kvroute-sim`: where a request is decided, whether its prefill
//! decision gets a decode hop, and the decode hop's request.

use std::sync::Arc;

use kvroute_common::messages::{Decision, Disaggregation, WorkerRole};

use super::candidates::Partition;
use super::prompt::Prepared;
use crate::registry::DisaggregationConfig;

/// The role a request of role `aggregated` is decided in, and its pairing, in `mode` when its
/// model `has` workers of a role: the prefill partition for a model with prefill and decode
/// workers (paired unless the mode is `never`), except in mode `never` when the model has
/// aggregated workers too; else the aggregated partition, unpaired.
pub fn plan_hops(
    mode: Disaggregation,
    has: impl Fn(WorkerRole) -> bool,
) -> (WorkerRole, Option<Disaggregation>) {
    let split = has(WorkerRole::Prefill) && has(WorkerRole::Decode);
    if !split || (mode == Disaggregation::Never && has(WorkerRole::Aggregated)) {
        return (WorkerRole::Aggregated, None);
    }
    (
        WorkerRole::Prefill,
        (mode != Disaggregation::Never).then_some(mode),
    )
}

/// Whether the prefill decision `prefill` of `prepared`'s request gets a decode hop in `mode`
/// ([`DisaggregationConfig::disaggregates`] on the prompt and the decision's uncached tokens).
/// `prefill_load` (the chosen prefill rank's prefill tokens in flight) is called only where
/// the rule uses it: the conditional mode with `busy_prefill_tokens` set.
pub fn gets_decode_hop(
    config: &DisaggregationConfig,
    mode: Disaggregation,
    prepared: &Prepared,
    prefill: &Decision,
    prefill_load: impl FnOnce() -> u64,
) -> bool {
    let reads_load = mode == Disaggregation::Conditional && config.busy_prefill_tokens.is_some();
    let load = if reads_load { prefill_load() } else { 0 };
    config.disaggregates(mode, prepared.prompt.tokens, prefill.prefill_tokens, load)
}

/// The decode hop of `prepared`'s request over the decode `partition`: role `decode`, no
/// session (the binding is the prefill's), and the request's `decode` rules as its pin, allowed
/// workers and rank range. The prompt is kept when the block sizes agree, else hashed again;
/// `None` when it cannot be.
pub fn decode_request(prepared: &Prepared, partition: Arc<Partition>) -> Option<Prepared> {
    let mut request = prepared.request.clone();
    request.role = WorkerRole::Decode;
    request.session = None;
    let rules = request.decode.take().unwrap_or_default();
    request.pin = rules.pin;
    request.allowed_workers = rules.allowed_workers;
    request.dp_rank_range = rules.dp_rank_range;
    if partition.block_size == prepared.partition.block_size {
        return Some(Prepared::with_prompt(
            request,
            prepared.request_id,
            partition,
            prepared.prompt.clone(),
        ));
    }
    Prepared::new(request, prepared.request_id, partition).ok()
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::{HopRules, SelectRequest};

    use super::*;
    use crate::decide::prompt::Prompt;

    fn prepared(block_size: u32) -> Prepared {
        let request = SelectRequest {
            model: "m".into(),
            role: WorkerRole::Prefill,
            allowed_workers: Some(vec![1]),
            decode: Some(HopRules {
                allowed_workers: Some(vec![7]),
                ..HopRules::default()
            }),
            ..SelectRequest::default()
        };
        let partition = Arc::new(Partition {
            cards: Vec::new(),
            block_size,
        });
        let prompt = Prompt {
            hashes: Vec::new(),
            tokens: 1000,
        };
        Prepared::with_prompt(request, uuid::Uuid::from_u128(1), partition, prompt)
    }

    #[test]
    fn a_model_with_prefill_and_decode_workers_is_decided_in_the_prefill_partition() {
        use Disaggregation::{Always, Conditional, Never};
        use WorkerRole::{Aggregated, Decode, Prefill};
        let split = |r| r != Aggregated;
        let mixed = |_| true;
        let aggregated = |r| r == Aggregated;
        assert_eq!(plan_hops(Always, split), (Prefill, Some(Always)));
        assert_eq!(plan_hops(Conditional, mixed), (Prefill, Some(Conditional)));
        assert_eq!(plan_hops(Never, split), (Prefill, None));
        assert_eq!(plan_hops(Never, mixed), (Aggregated, None));
        assert_eq!(plan_hops(Always, aggregated), (Aggregated, None));
        assert_eq!(plan_hops(Always, |r| r == Decode), (Aggregated, None));
    }

    #[test]
    fn the_decode_request_takes_the_decode_rules() {
        let p = prepared(64);
        let decode = Arc::new(Partition {
            cards: Vec::new(),
            block_size: 64,
        });
        let d = decode_request(&p, decode).unwrap();
        assert_eq!(d.request.role, WorkerRole::Decode);
        assert_eq!(d.request.allowed_workers, Some(vec![7]));
        assert_eq!((d.request.decode, d.request.session), (None, None));
        assert_eq!(d.prompt, p.prompt);
    }

    #[test]
    fn the_load_is_read_only_where_the_rule_uses_it() {
        let p = prepared(64);
        let d = crate::testing::decision(1, p.request_id, 16, 100);
        let busy = DisaggregationConfig {
            busy_prefill_tokens: Some(50),
            ..DisaggregationConfig::default()
        };
        let unread = || -> u64 { panic!("the load was read") };
        assert!(gets_decode_hop(
            &busy,
            Disaggregation::Always,
            &p,
            &d,
            unread
        ));
        let plain = DisaggregationConfig::default();
        assert!(!gets_decode_hop(
            &plain,
            Disaggregation::Conditional,
            &p,
            &d,
            unread
        ));
        // 100 of 1000 uncached: short, but the prefill worker is busy.
        assert!(gets_decode_hop(
            &busy,
            Disaggregation::Conditional,
            &p,
            &d,
            || 60
        ));
        assert!(!gets_decode_hop(
            &busy,
            Disaggregation::Conditional,
            &p,
            &d,
            || 40
        ));
    }
}
