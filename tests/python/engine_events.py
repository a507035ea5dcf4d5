"""Reads a kvroute-mocker engine face's replay buffer with pyzmq, as the engines' own clients do,
and decodes every batch with the engines' msgspec structs (copied below), strictly; then
re-encodes each decoded batch with msgspec and compares the bytes. Prints one JSON object:
{"batches": n, "identical": n, "seqs": [...], "events": [[type, ...], ...], "errors": [...]}.

    python3 tests/python/engine_events.py --replay tcp://127.0.0.1:5558 --engine vllm --format maps
"""

import argparse
import json
import sys
from typing import Any, Optional, Union

import msgspec
import zmq

# --- vLLM 0.32 (vllm/distributed/kv_events.py), Apache-2.0, the vLLM project -----------------


class VllmEventBatch(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False  # type: ignore[call-arg]
):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VllmKVCacheEvent(
    msgspec.Struct, omit_defaults=True, gc=False, tag=True  # type: ignore[call-arg]
):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[Union[VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared]]


# --- SGLang 0.5.23 (sglang/srt/disaggregation/kv_events.py), Apache-2.0, SGLang Team ---------


class SglEventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SglKVCacheEvent(
    msgspec.Struct, omit_defaults=True, gc=False, tag=True  # type: ignore[call-arg]
):
    pass


class SglBlockStored(SglKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class SglBlockRemoved(SglKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SglAllBlocksCleared(SglKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SglKVEventBatch(SglEventBatch):
    events: list[Union[SglBlockStored, SglBlockRemoved, SglAllBlocksCleared]]


# --- The older positional form: every slot, tag first ------------------------------------------


class OldEvent(msgspec.Struct, array_like=True, tag=True):  # type: ignore[call-arg]
    pass


class OldVllmBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class OldSglBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    cache_salt: Optional[str]
    session_id: Optional[str]
    lora_name: Optional[str]


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldVllmBatch(VllmEventBatch):
    events: list[Union[OldVllmBlockStored, OldBlockRemoved, OldAllBlocksCleared]]


class OldSglBatch(SglEventBatch):
    events: list[Union[OldSglBlockStored, OldBlockRemoved, OldAllBlocksCleared]]


BATCH_TYPES = {
    ("vllm", "maps"): VllmKVEventBatch,
    ("sglang", "maps"): SglKVEventBatch,
    ("vllm", "arrays"): OldVllmBatch,
    ("sglang", "arrays"): OldSglBatch,
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replay", required=True)
    p.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    p.add_argument("--format", choices=["maps", "arrays"], default="maps")
    p.add_argument("--start-seq", type=int, default=0)
    args = p.parse_args()
    batch_type = BATCH_TYPES[(args.engine, args.format)]
    decoder = msgspec.msgpack.Decoder(batch_type)
    encoder = msgspec.msgpack.Encoder()

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(args.replay)
    sock.send_multipart([b"", args.start_seq.to_bytes(8, "big")])
    out = {"batches": 0, "identical": 0, "seqs": [], "events": [], "errors": []}
    while True:
        frames = sock.recv_multipart()
        if len(frames) != 4 or frames[0] != b"":
            out["errors"].append(f"unexpected frames {frames!r}")
            break
        _, topic, seq, payload = frames
        if seq == END_SEQ:
            out["end_marker"] = [topic.decode(), payload.decode()]
            break
        out["batches"] += 1
        out["seqs"].append(int.from_bytes(seq, "big"))
        try:
            batch = decoder.decode(payload)
        except msgspec.ValidationError as e:
            out["errors"].append(f"seq {int.from_bytes(seq, 'big')}: {e}")
            continue
        if encoder.encode(batch) == payload:
            out["identical"] += 1
        else:
            out["errors"].append(
                f"seq {int.from_bytes(seq, 'big')}: re-encoded bytes differ: "
                f"{encoder.encode(batch).hex()} != {payload.hex()}"
            )
        rank = batch.data_parallel_rank if args.engine == "vllm" else batch.attn_dp_rank
        for e in batch.events:
            out["events"].append([type(e).__name__, rank, list(getattr(e, "block_hashes", []))])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
