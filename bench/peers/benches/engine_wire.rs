//! The bridge's decoder of the engines' KV events (`kvroute_bridge::wire::decode_batch`) beside
//! Dynamo's (`dynamo_kv_router::zmq_wire::decode_event_batch`, 1.6.1) on the same frames,
//! encoded by vLLM's own code (its wheels' `kv_events.py`, through
//! tests/engines/engine_frames.py): vLLM 0.32, and 0.34 with hash lookahead. First every frame
//! is decoded by both and compared field by field (hashes, parent, tokens, block size, medium,
//! LoRA name, group, removed hashes, clears); then each decoder is timed over all frames,
//! alternating, best of 7 rounds. Needs `scripts/install-deps` (.tools/engines).
//! Run: `cd bench/peers && cargo bench --bench engine_wire`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use dynamo_kv_router::zmq_wire::{RawKvEvent, decode_event_batch};
use kvroute_bridge::EngineKind;
use kvroute_bridge::wire::{EngineEvent, decode_batch};

/// The corpus: `batches` frames of `engine` (`lookahead` tokens per block).
fn frames(engine: &str, batches: usize, lookahead: usize) -> Vec<Vec<u8>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out: PathBuf = std::env::temp_dir().join(format!(
        "kvroute-frames-{engine}-{lookahead}-{}.bin",
        std::process::id()
    ));
    let status = Command::new("python3")
        .arg(root.join("tests/engines/engine_frames.py"))
        .args(["--engine", engine, "--batches", &batches.to_string()])
        .args(["--lookahead", &lookahead.to_string()])
        .arg("--out")
        .arg(&out)
        .status()
        .expect("python3");
    assert!(status.success(), "engine_frames.py failed (run scripts/install-deps)");
    let bytes = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let mut frames = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let n = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        frames.push(bytes[at + 4..at + 4 + n].to_vec());
        at += 4 + n;
    }
    frames
}

/// What both decoders must agree on, per event.
#[derive(Debug, PartialEq)]
enum Common {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u64,
        medium: Option<String>,
        lora_name: Option<String>,
        group: Option<u64>,
    },
    Removed {
        hashes: Vec<u64>,
        medium: Option<String>,
        group: Option<u64>,
    },
    Cleared,
}

fn ours(e: &EngineEvent) -> Common {
    match e {
        EngineEvent::Stored(s) => Common::Stored {
            hashes: s.block_hashes.clone(),
            parent: s.parent_block_hash,
            tokens: s.token_ids.clone(),
            block_size: u64::from(s.block_size),
            medium: s.medium.clone(),
            lora_name: s.lora_name.clone(),
            group: s.group_idx.map(|g| g as u64),
        },
        EngineEvent::Removed(r) => Common::Removed {
            hashes: r.block_hashes.clone(),
            medium: r.medium.clone(),
            group: r.group_idx.map(|g| g as u64),
        },
        EngineEvent::AllCleared => Common::Cleared,
    }
}

fn dynamo(e: &RawKvEvent) -> Common {
    match e {
        RawKvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            lora_name,
            group_idx,
            ..
        } => Common::Stored {
            hashes: block_hashes.iter().map(|h| h.into_u64()).collect(),
            parent: parent_block_hash.map(|h| h.into_u64()),
            tokens: token_ids.clone(),
            block_size: *block_size as u64,
            medium: medium.clone(),
            lora_name: lora_name.clone(),
            group: group_idx.map(u64::from),
        },
        RawKvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
            ..
        } => Common::Removed {
            hashes: block_hashes.iter().map(|h| h.into_u64()).collect(),
            medium: medium.clone(),
            group: group_idx.map(u64::from),
        },
        RawKvEvent::AllBlocksCleared { .. } => Common::Cleared,
        RawKvEvent::Ignored => panic!("dynamo ignored an event"),
    }
}

/// Both decoders on every frame: equal content. Returns the blocks stored and the lookahead
/// lists our decoder kept (Dynamo's has no such field).
fn compare(frames: &[Vec<u8>]) -> (usize, usize) {
    let (mut blocks, mut lookahead) = (0, 0);
    for f in frames {
        let a = decode_batch(EngineKind::Vllm, f).expect("kvroute decodes");
        let b = decode_event_batch(f).expect("dynamo decodes");
        assert!(a.skipped.is_empty());
        let a_events: Vec<Common> = a.events.iter().map(ours).collect();
        let b_events: Vec<Common> = b.events.iter().map(dynamo).collect();
        assert_eq!(a_events, b_events);
        assert_eq!(a.dp_rank.map(i64::from), b.data_parallel_rank.map(i64::from));
        assert_eq!(a.ts, b.ts);
        for e in &a.events {
            if let EngineEvent::Stored(s) = e {
                blocks += s.block_hashes.len();
                lookahead += s.lookahead_token_ids.len();
            }
        }
    }
    (blocks, lookahead)
}

fn best_of(rounds: usize, mut f: impl FnMut() -> usize) -> Duration {
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .min()
        .unwrap()
}

fn main() {
    let batches = 4_000;
    println!("| frames (vLLM's own encoder) | decoder | batches/s | block events/s | ratio |");
    println!("|---|---|---|---|---|");
    for (engine, lookahead) in [("vllm", 0), ("vllm-0.34", 1)] {
        let frames = frames(engine, batches, lookahead);
        let (blocks, kept) = compare(&frames);
        let bytes: usize = frames.iter().map(Vec::len).sum();
        let mut kv = Duration::MAX;
        let mut dy = Duration::MAX;
        for _ in 0..7 {
            kv = kv.min(best_of(1, || {
                frames
                    .iter()
                    .map(|f| decode_batch(EngineKind::Vllm, f).unwrap().events.len())
                    .sum()
            }));
            dy = dy.min(best_of(1, || {
                frames
                    .iter()
                    .map(|f| decode_event_batch(f).unwrap().events.len())
                    .sum()
            }));
        }
        let label = format!(
            "{engine}{}, {} batches, {:.0} B each, equal content{}",
            if lookahead > 0 { " (lookahead 1)" } else { "" },
            frames.len(),
            bytes as f64 / frames.len() as f64,
            if kept > 0 {
                format!("; lookahead kept for {kept} blocks by kvroute, dropped by dynamo")
            } else {
                String::new()
            }
        );
        let rate = |d: Duration| {
            (
                frames.len() as f64 / d.as_secs_f64(),
                blocks as f64 / d.as_secs_f64(),
            )
        };
        let (km, kb) = rate(kv);
        let (dm, db) = rate(dy);
        println!(
            "| {label} | kvroute `wire::decode_batch` | {km:.0} | {kb:.0} | **{:.2}×** |",
            dy.as_secs_f64() / kv.as_secs_f64()
        );
        println!("| | dynamo `zmq_wire::decode_event_batch` | {dm:.0} | {db:.0} | 1 |");
    }
}
