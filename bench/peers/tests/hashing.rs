//! kvroute's hashing against Dynamo's own functions (`dynamo-kv-router`): the local block
//! hashes and sequence hashes of the same tokens, with and without a LoRA adapter, must be
//! equal, so a router, engine or gateway hashing either way finds the same blocks. The vectors
//! printed here are the ones in PROTOCOL.md ("Hashing") and common/src/hashing.rs.
//!   cd bench/peers && cargo test --test hashing -- --nocapture

use dynamo_kv_router::protocols::{
    BlockHashOptions, compute_block_hash_for_seq, compute_seq_hash_for_block,
};
use kvroute_common::hashing::BlockHashes;

#[test]
fn kvroute_hashes_as_dynamo_does() {
    for (tokens, block_size, lora) in [
        ((0..10).collect::<Vec<u32>>(), 4u32, None),
        ((0..10).collect(), 4, Some("sql-adapter")),
        ((1..=32).collect(), 16, None),
        ((1..=32).collect(), 16, Some("adapter-a")),
        ((7..7 + 64).collect(), 16, Some("é-unicode")),
    ] {
        let options = BlockHashOptions {
            lora_name: lora,
            ..Default::default()
        };
        let local = compute_block_hash_for_seq(&tokens, block_size, options);
        let sequence = compute_seq_hash_for_block(&local);
        let ours = BlockHashes::of_tokens(&tokens, block_size as usize, lora);
        let local: Vec<u64> = local.iter().map(|h| h.0).collect();
        let sequence: Vec<u64> = sequence.to_vec();
        println!(
            "tokens {}..{} block {block_size} lora {lora:?}: local {:x?} sequence {:x?}",
            tokens[0],
            tokens[tokens.len() - 1],
            local,
            sequence
        );
        assert_eq!(ours.local, local, "local hashes, lora {lora:?}");
        assert_eq!(ours.sequence, sequence, "sequence hashes, lora {lora:?}");
    }
}
