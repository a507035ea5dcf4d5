//! kvroute-bridge's event path against the engines' own publisher code (vLLM 0.32 and SGLang
//! 0.5.23 `ZmqEventPublisher`, run by tests/engines/engine_publisher.py): two data-parallel
//! ranks, stored / removed / cleared, LoRA, offloaded tiers, a second physical copy and a
//! resync from the mirror — the indexer fed through the bridge must hold exactly the state
//! built from the same events by hand with kvroute's hashing: the same digest, and the same
//! answers to overlap queries. Gaps and restarts: `bridge_gaps.rs`.

mod bridge_reference;

use kvroute_common::Names;
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_tests::{Engine, EngineOptions, EnginePublisher, IndexerProcess, TestEnv};
use serde_json::json;

use bridge_reference::*;

/// Stored, removed, LoRA, offload to the host, a second copy, cleared — over two ranks; checked
/// once with LoRA blocks and an offloaded chain present, and again after removals, clears and
/// more LoRA blocks (the final state, which the mirror also recreates for a fresh indexer).
async fn full_history(engine: Engine) {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let mut publisher = EnginePublisher::start(EngineOptions::new(engine)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let e = engine;
    let t1 = tokens(100, 2);
    let t2 = tokens(200, 1);
    let t3 = tokens(300, 1);
    // Rank 0: a chain, a LoRA block holding t2, the chain offloaded to the host. Rank 1: a
    // plain block holding the same t2.
    publisher
        .publish(
            0,
            json!([
                stored(e, &[1, 2], None, &t1, "GPU", None),
                stored(e, &[3], None, &t2, "GPU", ADAPTER)
            ]),
        )
        .unwrap();
    publisher
        .publish(
            0,
            json!([stored(e, &[1, 2], None, &[], "CPU_PINNED", None)]),
        )
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[10], None, &t2, "GPU", None)]))
        .unwrap();
    let expected = reference(&[
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[3], None, &t2, StorageTier::Device, ADAPTER)),
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Host, None)),
        (1, chain(e, &[10], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, expected.digest(), "with LoRA blocks").await;
    let probes = [
        probe("the chain", t1.clone(), None, &[(0, 2, 0)]),
        probe(
            "its first block, then a new one",
            first_block_then_new(&t1, 2),
            None,
            &[(0, 1, 0)],
        ),
        // The same tokens under the adapter and without it are different blocks.
        probe("t2 without the adapter", t2.clone(), None, &[(1, 1, 0)]),
        probe("t2 with the adapter", t2.clone(), ADAPTER, &[(0, 1, 0)]),
        probe("the plain chain with the adapter", t1.clone(), ADAPTER, &[]),
        probe("a new prompt", tokens(900, 2), None, &[]),
    ];
    check_queries(
        &nats,
        &names,
        &indexer,
        &expected,
        &probes,
        "with LoRA blocks",
    )
    .await;

    // Rank 0: a second copy of the chain stored and one copy of its second block removed (the
    // other copy stays), the LoRA block removed, then the last device copy of the second block
    // removed (the host copy stays). Rank 1: a block and all cleared in one batch, a chain, and
    // a LoRA chain holding the same tokens as rank 0's plain chain.
    publisher
        .publish(
            0,
            json!([
                stored(e, &[1, 2], None, &t1, "GPU", None),
                removed(e, &[2], "GPU"),
                removed(e, &[3], "GPU")
            ]),
        )
        .unwrap();
    publisher
        .publish(0, json!([removed(e, &[2], "GPU")]))
        .unwrap();
    publisher
        .publish(
            1,
            json!([stored(e, &[14], None, &t3, "GPU", None), {"type": "AllBlocksCleared"}]),
        )
        .unwrap();
    publisher
        .publish(
            1,
            json!([
                stored(e, &[11], None, &t3, "GPU", None),
                stored(e, &[12], Some(11), &t2, "GPU", None)
            ]),
        )
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[15, 16], None, &t1, "GPU", ADAPTER)]))
        .unwrap();
    let expected = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Host, None)),
        (1, chain(e, &[11], None, &t3, StorageTier::Device, None)),
        (1, chain(e, &[12], Some(11), &t2, StorageTier::Device, None)),
        (
            1,
            chain(e, &[15, 16], None, &t1, StorageTier::Device, ADAPTER),
        ),
    ]);
    wait_digest(&indexer, expected.digest(), "after the history").await;
    let t3_t2: Vec<u32> = t3.iter().chain(&t2).copied().collect();
    let probes = [
        // Block 1 on the device, block 2 only on the host now.
        probe("the plain chain", t1.clone(), None, &[(0, 1, 1)]),
        probe(
            "the chain with the adapter",
            t1.clone(),
            ADAPTER,
            &[(1, 2, 0)],
        ),
        probe(
            "its first block with the adapter, then a new one",
            first_block_then_new(&t1, 2),
            ADAPTER,
            &[(1, 1, 0)],
        ),
        probe("rank 1's chain", t3_t2, None, &[(1, 2, 0)]),
        probe(
            "rank 1's first block, then a new one",
            first_block_then_new(&t3, 2),
            None,
            &[(1, 1, 0)],
        ),
        // Block 10 was cleared, block 12 holds t2 only under block 11, the LoRA block 3 is gone.
        probe("t2 alone", t2.clone(), None, &[]),
        probe("t2 with the adapter", t2.clone(), ADAPTER, &[]),
        probe("a new prompt", tokens(900, 2), None, &[]),
    ];
    check_queries(
        &nats,
        &names,
        &indexer,
        &expected,
        &probes,
        "after the history",
    )
    .await;
    assert!(
        bridged
            .metrics
            .get("kvroute_bridge_duplicate_copies_total", "e", Some(0), "")
            >= 2.0
    );

    // An indexer that lost its state and whose log was purged (no snapshots) asks every worker
    // to resync: the bridge recreates the same state from its mirror alone — the engines cannot
    // resend anything.
    drop(indexer);
    let js = async_nats::jetstream::new(nats.clone());
    js.get_stream(names.events_stream())
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let fresh = IndexerProcess::start(&env, "b", NO_SNAPSHOTS).unwrap();
    let through_mirror = "a fresh indexer on a purged log, through the mirror";
    wait_digest(&fresh, expected.digest(), through_mirror).await;
    check_queries(&nats, &names, &fresh, &expected, &probes, through_mirror).await;
    assert!(fresh.log().contains("resync"), "{}", fresh.log());
    drop(bridged);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_history_through_the_bridge_matches_the_reference() {
    full_history(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_history_through_the_bridge_matches_the_reference() {
    full_history(Engine::Sglang).await;
}

/// A chain written to the engine's shared tier — vLLM's network-backed offload tier
/// (`STORAGE` with `locality: "REMOTE"`), SGLang's `EXTERNAL` medium — reaches the index in
/// kvroute's shared tier: the query reports it as the shared prefix, beside the rank's device
/// blocks, and a removal from the store shortens it.
async fn shared_tier(engine: Engine) {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let mut publisher = EnginePublisher::start(EngineOptions::new(engine)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let e = engine;
    let t1 = tokens(100, 3);
    let shared = |hashes: &[u64], tokens: &[u32]| {
        let mut s = stored(e, hashes, None, tokens, "GPU", None);
        match e {
            Engine::Vllm | Engine::Vllm034 => {
                s["medium"] = json!("STORAGE");
                s["locality"] = json!("REMOTE");
            }
            Engine::Sglang => s["medium"] = json!("EXTERNAL"),
        }
        s
    };
    let shared_removed = |hashes: &[u64]| {
        let mut r = removed(e, hashes, "GPU");
        match e {
            Engine::Vllm | Engine::Vllm034 => {
                r["medium"] = json!("STORAGE");
                r["locality"] = json!("REMOTE");
            }
            Engine::Sglang => r["medium"] = json!("EXTERNAL"),
        }
        r
    };
    // Rank 0 computed the first two blocks and wrote all three to the store.
    publisher
        .publish(
            0,
            json!([
                stored(e, &[1, 2], None, &t1[..2 * BS as usize], "GPU", None),
                shared(&[1, 2, 3], &t1)
            ]),
        )
        .unwrap();
    let expected = reference(&[
        (
            0,
            chain(
                e,
                &[1, 2],
                None,
                &t1[..2 * BS as usize],
                StorageTier::Device,
                None,
            ),
        ),
        (
            0,
            chain(e, &[1, 2, 3], None, &t1, StorageTier::Shared, None),
        ),
    ]);
    wait_digest(&indexer, expected.digest(), "shared tier").await;
    let rows = query(&nats, &names, &indexer, &t1, None).await;
    assert_eq!(
        rows,
        expected
            .find_matches_for_tokens(&t1, BS as usize, None)
            .matches
    );
    assert_eq!(
        rows.iter()
            .map(|m| (m.dp_rank, m.device, m.shared))
            .collect::<Vec<_>>(),
        [(0, 2, 3)]
    );
    // The store dropped the last block.
    publisher.publish(0, json!([shared_removed(&[3])])).unwrap();
    let start = std::time::Instant::now();
    let rows = loop {
        let rows = query(&nats, &names, &indexer, &t1, None).await;
        if rows.first().is_some_and(|m| m.shared == 2) {
            break rows;
        }
        assert!(start.elapsed().as_secs() < 20, "{rows:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(rows[0].device, 2);
    drop(bridged);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_remote_tier_reaches_the_index_as_the_shared_tier() {
    shared_tier(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_external_medium_reaches_the_index_as_the_shared_tier() {
    shared_tier(Engine::Sglang).await;
}

/// vLLM 0.34 with hash lookahead: each block's hash also covers the 2 tokens after it, so the
/// engine holds one block per (prefix, tokens, next tokens). Through the bridge the index holds
/// exactly those blocks, each tokens hash with its lookahead folded in by PROTOCOL.md's rule
/// (computed here by hand), beside a plain block of the same tokens; a query that folds
/// nothing matches only the plain one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_34_lookahead_blocks_are_their_own_blocks() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let e = Engine::Vllm034;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let t = tokens(100, 2);
    let ahead = |hashes: &[u64], next: &[[u32; 2]]| {
        let mut s = stored(e, hashes, None, &t, "GPU", None);
        s["lookahead_token_ids"] = json!(next);
        s
    };
    // Two continuations of the same two blocks, then the plain blocks on rank 1.
    publisher
        .publish(0, json!([ahead(&[1, 2], &[[104, 105], [900, 901]])]))
        .unwrap();
    publisher
        .publish(0, json!([ahead(&[1, 3], &[[104, 105], [700, 701]])]))
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[10, 11], None, &t, "GPU", None)]))
        .unwrap();
    let seed = seed_for_lora(None);
    let local = local_block_hashes(&t, BS as usize, seed);
    let fold = |tokens_hash: u64, next: [u32; 2]| {
        let mut bytes = tokens_hash.to_le_bytes().to_vec();
        bytes.push(0x07);
        bytes.extend_from_slice(&2u32.to_le_bytes());
        for t in next {
            bytes.push(0x03);
            bytes.extend_from_slice(&u64::from(t).to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, seed)
    };
    let block = |n: u64, tokens_hash: u64| StoredBlock {
        block_hash: hv(e, n),
        tokens_hash,
    };
    let expected = reference(&[
        (
            0,
            KvEventData::Stored {
                parent_hash: None,
                blocks: vec![
                    block(1, fold(local[0], [104, 105])),
                    block(2, fold(local[1], [900, 901])),
                ],
                tier: StorageTier::Device,
            },
        ),
        (
            0,
            KvEventData::Stored {
                parent_hash: Some(hv(e, 1)),
                blocks: vec![block(3, fold(local[1], [700, 701]))],
                tier: StorageTier::Device,
            },
        ),
        (1, chain(e, &[10, 11], None, &t, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, expected.digest(), "lookahead blocks").await;
    let probes = [probe("the plain prompt", t.clone(), None, &[(1, 2, 0)])];
    check_queries(&nats, &names, &indexer, &expected, &probes, "lookahead").await;
    drop(bridged);
}
