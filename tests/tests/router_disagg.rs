//! Disaggregated prefill and decode through the router service: a request of a model with
//! prefill and decode workers gets a pair — the prefill worker by the KV-aware cost, the decode
//! worker by the decode role's policy and the request's decode rules — published as one
//! decision that charges both workers; the conditional rule serves a mostly cached prompt on
//! its prefill worker alone; a retry gets the same pair.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::decode;
use kvroute_common::messages::{
    Decision, Disaggregation, HopRules, Pin, SelectRequest, StorageTier, WorkerRole,
};
use kvroute_router::service::metrics as rm;
use kvroute_tests::{
    IndexerProcess, PromptWorker, RouterProcess, TestEnv, continuing, expect_worker, labelled,
    request, select, select_until_overlap, worker_card,
};

const POLICY: &str = "worker_selection:
  decode: least-busy
disaggregation:
  mode: conditional
  min_uncached_tokens: 64
  min_uncached_fraction: 0.5
";

fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| seed * 100_000 + i).collect()
}

fn asking(tokens: Vec<u32>, mode: Disaggregation) -> SelectRequest {
    SelectRequest {
        disaggregation: Some(mode),
        ..request("m", tokens)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paired_decision_takes_the_cache_for_prefill_and_load_for_decode() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let mut fleet = Vec::new();
    for (id, role) in [
        (1, WorkerRole::Prefill),
        (2, WorkerRole::Prefill),
        (3, WorkerRole::Decode),
        (4, WorkerRole::Decode),
    ] {
        let card = kvroute_common::messages::WorkerCard {
            role,
            ..worker_card(&names, id, "m")
        };
        fleet.push(PromptWorker::start(&env, card, 10).await.unwrap());
    }
    let path = env.nats.data_dir().join("disagg.yaml");
    std::fs::write(&path, POLICY).unwrap();
    let router =
        RouterProcess::start(&env, "r1", &["--policy-config", path.to_str().unwrap()]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let mut decisions = nats.subscribe(names.decisions()).await.unwrap();

    // Prefill where the prompt is cached; decode on a decode worker.
    let cached = prompt(1, 8);
    fleet[1].store_prompt(&cached).await;
    let always = asking(continuing(&cached), Disaggregation::Always);
    let pair = select_until_overlap(&nats, &names, &always, 8, Duration::from_secs(30)).await;
    assert_eq!((pair.worker_id, pair.role), (2, WorkerRole::Prefill));
    let hop = pair.decode.clone().expect("a decode hop");
    assert!([3, 4].contains(&hop.worker_id), "{hop:?}");
    assert_eq!(hop.request_subject, names.worker_requests(hop.worker_id));
    assert_eq!(hop.policy, "least-busy");
    assert!(hop.bootstrap_room < 1 << 63);
    assert_ne!(hop.decision_id, pair.decision_id);

    // Published as one decision carrying the hop.
    let published = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let msg = decisions.next().await.expect("decisions");
            let d: Decision = decode(&msg.payload).unwrap();
            if d.decision_id == pair.decision_id {
                return d;
            }
        }
    })
    .await
    .expect("the paired decision is published");
    assert_eq!(published.role, WorkerRole::Prefill);
    assert_eq!(published.decode.as_ref(), Some(&hop));

    // A retry gets the same pair.
    let retry = SelectRequest {
        request_id: Some(pair.request_id),
        attempt: 1,
        ..always.clone()
    };
    let again = expect_worker(select(&nats, &names, &retry).await.unwrap());
    assert_eq!(again.decision_id, pair.decision_id);
    assert_eq!(again.decode, Some(hop.clone()));

    // The decode worker is charged: least-busy sends the next pair to the other one.
    let next = expect_worker(
        select(
            &nats,
            &names,
            &asking(prompt(2, 20), Disaggregation::Always),
        )
        .await
        .unwrap(),
    );
    let other = next.decode.expect("a decode hop");
    assert_ne!(
        other.worker_id, hop.worker_id,
        "the first hop's load counts"
    );

    // Conditional: a prompt cached on its prefill worker is served there end to end; a long
    // uncached one is paired.
    let conditional = asking(continuing(&cached), Disaggregation::Conditional);
    // (On worker 2, or on worker 1 when the attempts above predicted the prompt there too.)
    let alone = expect_worker(select(&nats, &names, &conditional).await.unwrap());
    assert_eq!(alone.role, WorkerRole::Prefill);
    assert_eq!(alone.overlap_blocks.get(&StorageTier::Device), Some(&8));
    assert_eq!(alone.decode, None);
    let long = expect_worker(
        select(
            &nats,
            &names,
            &asking(prompt(3, 16), Disaggregation::Conditional),
        )
        .await
        .unwrap(),
    );
    assert!(long.decode.is_some(), "{long:?}");
    // The configured mode is conditional: a request that names none follows it.
    let default = expect_worker(
        select(&nats, &names, &request("m", continuing(&cached)))
            .await
            .unwrap(),
    );
    assert_eq!(default.decode, None);

    // The decode hop's own rules.
    let pinned = SelectRequest {
        decode: Some(HopRules {
            pin: Some(Pin {
                worker_id: 4,
                dp_rank: None,
            }),
            ..HopRules::default()
        }),
        ..asking(prompt(4, 4), Disaggregation::Always)
    };
    assert_eq!(
        expect_worker(select(&nats, &names, &pinned).await.unwrap())
            .decode
            .map(|h| h.worker_id),
        Some(4)
    );
    let allowed = SelectRequest {
        decode: Some(HopRules {
            allowed_workers: Some(vec![3]),
            ..HopRules::default()
        }),
        ..asking(prompt(5, 4), Disaggregation::Always)
    };
    assert_eq!(
        expect_worker(select(&nats, &names, &allowed).await.unwrap())
            .decode
            .map(|h| h.worker_id),
        Some(3)
    );
    // A decode rule no worker meets: the prefill worker serves it end to end.
    let impossible = SelectRequest {
        decode: Some(HopRules {
            allowed_workers: Some(vec![9]),
            ..HopRules::default()
        }),
        ..asking(prompt(6, 4), Disaggregation::Always)
    };
    let fallback = expect_worker(select(&nats, &names, &impossible).await.unwrap());
    assert_eq!(
        (fallback.role, fallback.decode),
        (WorkerRole::Prefill, None)
    );

    // Never, with no aggregated worker: one prefill worker end to end.
    let never = expect_worker(
        select(&nats, &names, &asking(prompt(7, 4), Disaggregation::Never))
            .await
            .unwrap(),
    );
    assert_eq!((never.role, never.decode), (WorkerRole::Prefill, None));

    let outcomes: BTreeMap<&str, f64> = [
        rm::labels::DISAGG_PAIRED,
        rm::labels::DISAGG_PREFILL_ONLY,
        rm::labels::DISAGG_DECODE_UNAVAILABLE,
    ]
    .into_iter()
    .map(|o| (o, router.metric(&labelled(rm::labels::DISAGGREGATION, o))))
    .collect();
    assert!(outcomes[rm::labels::DISAGG_PAIRED] >= 5.0, "{outcomes:?}");
    assert_eq!(
        outcomes[rm::labels::DISAGG_PREFILL_ONLY],
        2.0,
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes[rm::labels::DISAGG_DECODE_UNAVAILABLE],
        1.0,
        "{outcomes:?}"
    );
}
