#!/usr/bin/env python3
"""Encodes KV-event batches with an engine's own structs and encoder (its wheel's
kv_events.py, exactly as its ZmqEventPublisher thread encodes a batch) and writes the payloads,
each prefixed by its length (u32 little-endian): a corpus for decoder comparisons and
benchmarks (bench/peers/benches/engine_wire.rs).

    python3 tests/engines/engine_frames.py --engine vllm-0.34 --batches 2000 --out FILE

Each batch is a vLLM block pool's step: `--stores` BlockStored of `--blocks` blocks of 16
tokens under the previous chain's last block (extra_keys one None per block, group_idx 0, as
the block pool sets them; with --lookahead L, vLLM 0.34's lookahead_token_ids), one
BlockRemoved of as many blocks, and every 500th batch an AllBlocksCleared. Seeded.
"""

import argparse
import random
import struct
import sys
from pathlib import Path

import msgspec

from engine_publisher import DEFAULT_ENGINES_DIR, STAND_INS, import_from_wheel


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["vllm", "vllm-0.34"], required=True)
    parser.add_argument("--engines-dir", type=Path, default=DEFAULT_ENGINES_DIR)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--stores", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--lookahead", type=int, default=0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    wheel_dir = args.engines_dir / args.engine
    sys.path[:0] = [str(STAND_INS), str(wheel_dir)]
    kv = import_from_wheel("vllm.distributed.kv_events", wheel_dir)
    if args.lookahead and "lookahead_token_ids" not in kv.BlockStored.__struct_fields__:
        raise SystemExit(f"{args.engine}'s BlockStored has no lookahead_token_ids")
    rng = random.Random(args.seed)
    encoder = msgspec.msgpack.Encoder()
    parent = None
    with open(args.out, "wb") as out:
        for i in range(args.batches):
            events = []
            for _ in range(args.stores):
                hashes = [rng.getrandbits(64) for _ in range(args.blocks)]
                tokens = [rng.randrange(150_000) for _ in range(16 * args.blocks)]
                fields = dict(
                    block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                    block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[None] * args.blocks, group_idx=0,
                )
                if args.lookahead:
                    fields["lookahead_token_ids"] = [
                        [rng.randrange(150_000) for _ in range(args.lookahead)]
                        for _ in range(args.blocks)
                    ]
                events.append(kv.BlockStored(**fields))
                parent = hashes[-1]
            gone = [rng.getrandbits(64) for _ in range(args.blocks)]
            events.append(kv.BlockRemoved(block_hashes=gone, medium="GPU", group_idx=0))
            if i % 500 == 499:
                events.append(kv.AllBlocksCleared())
                parent = None
            batch = kv.KVEventBatch(ts=1.7e9 + i, events=events, data_parallel_rank=0)
            payload = encoder.encode(batch)
            out.write(struct.pack("<I", len(payload)))
            out.write(payload)


if __name__ == "__main__":
    main()
