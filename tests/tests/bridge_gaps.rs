//! kvroute-bridge's gap handling against the engines' own publisher code (see
//! `bridge_events.rs`): a gap replayed from the engine's replay buffer, one that cannot be
//! replayed (no replay endpoint, or a buffer that no longer reaches back to it), an engine
//! restart, and a bridge started after the engine's history — each time the indexer fed
//! through the bridge must hold the reference state.

mod bridge_reference;

use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::decode;
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::messages::{KvEventBatch, KvEventData, StorageTier, StoredBlock};
use kvroute_tests::{Engine, EngineOptions, EnginePublisher, IndexerProcess, TestEnv};
use serde_json::json;

use bridge_reference::*;

/// A batch lost on the PUB socket is fetched from the engine's replay buffer; without a replay
/// endpoint the rank is cleared and rebuilt from the following events; an engine restart (seq
/// back to 0) is a new incarnation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_replayed_or_clear_the_rank_and_restarts_clear_it() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let (t1, t2, t3) = (tokens(100, 1), tokens(200, 1), tokens(300, 1));

    // With replay.
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher.drop_next(0).unwrap();
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[3], Some(2), &t3, "GPU", None)]))
        .unwrap();
    let expected = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[2], Some(1), &t2, StorageTier::Device, None)),
        (0, chain(e, &[3], Some(2), &t3, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, expected.digest(), "a dropped batch replayed").await;
    // One gap (the dropped batch), filled from the replay socket (the start-up catch-up may
    // have fetched the first batch too).
    let m = |name: &'static str, extra: &str| bridged.metrics.get(name, "e", Some(0), extra);
    assert_eq!(m("kvroute_bridge_gaps_total", ""), 1.0);
    assert!(m("kvroute_bridge_replays_total", "ok") >= 1.0);
    assert_eq!(m("kvroute_bridge_ranks_cleared_total", ""), 0.0);

    // The engine restarts: its new seq 0 clears the rank.
    publisher.restart().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    publisher
        .publish(0, json!([stored(e, &[5], None, &t2, "GPU", None)]))
        .unwrap();
    // Should the resubscription have missed seq 0, seq 1 still shows the restart (and replay
    // brings seq 0 back).
    publisher.publish(0, json!([])).unwrap();
    let expected = reference(&[(0, chain(e, &[5], None, &t2, StorageTier::Device, None))]);
    wait_digest(&indexer, expected.digest(), "a restarted engine").await;
    drop(bridged);
    drop(publisher);

    // Without replay: the gap clears the rank, later events rebuild it.
    let mut options = EngineOptions::new(e);
    options.replay = false;
    let mut publisher = EnginePublisher::start(options).unwrap();
    let bridged = bridge(&env, &publisher).await;
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher.drop_next(0).unwrap();
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[4], None, &t3, "GPU", None)]))
        .unwrap();
    let expected = reference(&[(0, chain(e, &[4], None, &t3, StorageTier::Device, None))]);
    wait_digest(&indexer, expected.digest(), "a gap without replay").await;
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_ranks_cleared_total", "e", Some(0), ""),
        1.0
    );
}

/// A bridge started (or restarted) next to an engine that already has a history learns it from
/// the engine's replay buffer at once, without waiting for the engine's next batch — an engine
/// at rest may send none for a long time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_started_late_learns_the_history_without_a_new_batch() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let e = Engine::Sglang;
    let (t1, t2) = (tokens(100, 2), tokens(200, 1));
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    publisher
        .publish(0, json!([stored(e, &[1, 2], None, &t1, "GPU", None)]))
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[3], None, &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([removed(e, &[2], "GPU")]))
        .unwrap();
    let bridged = bridge(&env, &publisher).await;
    let local = local_block_hashes(&t1, BS as usize, seed_for_lora(None));
    let expected = reference(&[
        (
            0,
            KvEventData::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: hv(e, 1),
                    tokens_hash: local[0],
                }],
                tier: StorageTier::Device,
            },
        ),
        (1, chain(e, &[3], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(
        &indexer,
        expected.digest(),
        "the engine's history, learnt at start",
    )
    .await;
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_replays_total", "e", Some(0), "ok"),
        1.0
    );
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_gaps_total", "e", Some(0), ""),
        0.0
    );
    // The engine goes on; its next batch continues the numbering.
    publisher
        .publish(0, json!([removed(e, &[1], "GPU")]))
        .unwrap();
    let expected = reference(&[(1, chain(e, &[3], None, &t2, StorageTier::Device, None))]);
    wait_digest(
        &indexer,
        expected.digest(),
        "the next batch after the catch-up",
    )
    .await;
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_gaps_total", "e", Some(0), ""),
        0.0
    );
}

/// A gap the engine's replay buffer no longer reaches back to (it keeps the last 2 batches; 3
/// in a row were lost) cannot be filled: the bridge publishes `Cleared` for that rank only,
/// counts it, and rebuilds the rank from the following events — the blocks stored before the
/// gap are lost to routing until the engine stores them again.
async fn gap_older_than_the_replay_buffer(e: Engine) {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut options = EngineOptions::new(e);
    options.buffer_steps = 2;
    let mut publisher = EnginePublisher::start(options).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let mut events = nats.subscribe(names.kv_events(WORKER)).await.unwrap();
    let (t1, t2, t3) = (tokens(100, 1), tokens(200, 1), tokens(300, 1));
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[20], None, &t2, "GPU", None)]))
        .unwrap();
    let before = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (1, chain(e, &[20], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, before.digest(), "before the gap").await;
    // Seqs 1-3 never leave the PUB socket; by seq 4 the buffer holds only seqs 3 and 4.
    for _ in 0..3 {
        publisher.drop_next(0).unwrap();
    }
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[3], None, &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([removed(e, &[3], "GPU")]))
        .unwrap();
    let seq = publisher
        .publish(0, json!([stored(e, &[4], None, &t3, "GPU", None)]))
        .unwrap();
    assert_eq!(seq, 4);
    let expected = reference(&[
        (0, chain(e, &[4], None, &t3, StorageTier::Device, None)),
        (1, chain(e, &[20], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(
        &indexer,
        expected.digest(),
        "a gap the buffer no longer covers",
    )
    .await;
    let probes = [
        probe("rank 0's block from before the gap", t1.clone(), None, &[]),
        probe(
            "rank 0's block from after the gap",
            t3.clone(),
            None,
            &[(0, 1, 0)],
        ),
        probe("rank 1's block", t2.clone(), None, &[(1, 1, 0)]),
    ];
    check_queries(&nats, &names, &indexer, &expected, &probes, "after the gap").await;

    let m =
        |rank, name: &'static str, extra: &str| bridged.metrics.get(name, "e", Some(rank), extra);
    assert_eq!(m(0, "kvroute_bridge_gaps_total", ""), 1.0);
    // (The start-up catch-up may have replayed seq 0 as "ok": it races the first publish.)
    assert_eq!(m(0, "kvroute_bridge_replays_total", "not_covered"), 1.0);
    assert_eq!(m(0, "kvroute_bridge_ranks_cleared_total", ""), 1.0);
    assert_eq!(m(1, "kvroute_bridge_ranks_cleared_total", ""), 0.0);

    // What the bridge published for rank 0 up to block 4: `Cleared`, then block 4 — nothing of
    // the lost batches, nor of seq 3, which the buffer still had. (What came before the gap may
    // be missing: the subscription raced its publication.)
    let last = chain(e, &[4], None, &t3, StorageTier::Device, None);
    let mut seen = Vec::new();
    let start = Instant::now();
    while seen.last() != Some(&last) {
        let left = Duration::from_secs(10).saturating_sub(start.elapsed());
        let msg = tokio::time::timeout(left, events.next())
            .await
            .unwrap_or_else(|_| panic!("rank 0's events never reached block 4: {seen:?}"))
            .unwrap();
        let batch: KvEventBatch = decode(&msg.payload).unwrap();
        assert_eq!(batch.worker_id, WORKER);
        if batch.dp_rank == 0 {
            seen.extend(batch.events.into_iter().map(|event| event.data));
        }
    }
    assert_eq!(seen[seen.len() - 2], KvEventData::Cleared, "{seen:?}");
    let lost = [hv(e, 2), hv(e, 3)];
    let names_lost = |d: &KvEventData| match d {
        KvEventData::Stored { blocks, .. } => blocks.iter().any(|b| lost.contains(&b.block_hash)),
        KvEventData::Removed { block_hashes, .. } => block_hashes.iter().any(|h| lost.contains(h)),
        KvEventData::Cleared => false,
    };
    assert!(!seen.iter().any(names_lost), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_gap_older_than_the_replay_buffer_clears_the_rank() {
    gap_older_than_the_replay_buffer(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_gap_older_than_the_replay_buffer_clears_the_rank() {
    gap_older_than_the_replay_buffer(Engine::Sglang).await;
}
