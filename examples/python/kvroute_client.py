#!/usr/bin/env python3
"""A kvroute client in another language: block hashing and a worker-selection request.

Uses only the wire contract in PROTOCOL.md (MessagePack maps with named fields over NATS):

    python3 kvroute_client.py --nats-url nats://127.0.0.1:4222 --namespace default --model demo
    python3 kvroute_client.py --vectors      # prints the hashing test vectors as JSON
    python3 kvroute_client.py --encode-only  # prints one encoded SelectRequest as hex
"""
import argparse
import asyncio
import json
import struct
import sys
import uuid

import msgpack
import xxhash

SEED = 1337


def seed_for_lora(lora_name=None):
    """1337, or XXH3-64 of the adapter name's UTF-8 bytes with seed 1337."""
    if not lora_name:
        return SEED
    return xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), SEED)


def local_block_hashes(tokens, block_size, lora_name=None):
    """XXH3-64 over the little-endian u32 token ids of each *full* block."""
    seed = seed_for_lora(lora_name)
    full = len(tokens) // block_size * block_size
    return [
        xxhash.xxh3_64_intdigest(struct.pack("<%dI" % block_size, *tokens[i:i + block_size]), seed)
        for i in range(0, full, block_size)
    ]


def sequence_hashes(local, lora_name=None):
    """seq[0] = local[0]; seq[i] = XXH3-64(LE(seq[i-1]) || LE(local[i]))."""
    seed = seed_for_lora(lora_name)
    out = []
    for h in local:
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed))
    return out


def select_request(model, tokens, session_id=None):
    req = {"v": 1, "request_id": str(uuid.uuid4()), "model": model, "token_ids": tokens}
    if session_id:
        req["session"] = {"id": session_id, "final": False, "trigger": "user_message"}
    return req


def vectors():
    out = []
    for tokens, block_size, lora in [
        (list(range(10)), 4, None),
        (list(range(10)), 4, "sql-adapter"),
        (list(range(1, 33)), 16, None),
    ]:
        local = local_block_hashes(tokens, block_size, lora)
        out.append({
            "tokens": tokens, "block_size": block_size, "lora_name": lora,
            "seed": seed_for_lora(lora), "local": local, "sequence": sequence_hashes(local, lora),
        })
    return out


async def select(nats_url, namespace, model, tokens, timeout):
    import nats  # imported here so --vectors needs only msgpack and xxhash

    nc = await nats.connect(nats_url)
    try:
        subject = "kvroute.%s.select" % namespace
        payload = msgpack.packb(select_request(model, tokens), use_bin_type=True)
        msg = await nc.request(subject, payload, timeout=timeout)
        reply = msgpack.unpackb(msg.data, raw=False)
        if reply.get("status") == "ok":
            print("worker %s rank %s (overlap %s of %s blocks, policy %s)" % (
                reply["worker_id"], reply.get("dp_rank", 0), reply.get("overlap_blocks"),
                reply.get("request_blocks"), reply.get("policy")))
        else:
            print("error %s: %s" % (reply.get("code"), reply.get("message")))
        return reply
    finally:
        await nc.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--namespace", default="default")
    p.add_argument("--model", default="demo")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--vectors", action="store_true")
    p.add_argument("--encode-only", action="store_true")
    args = p.parse_args()
    tokens = list(range(1, 257))
    if args.vectors:
        json.dump(vectors(), sys.stdout)
    elif args.encode_only:
        print(msgpack.packb(select_request(args.model, tokens, "s-1"), use_bin_type=True).hex())
    else:
        asyncio.run(select(args.nats_url, args.namespace, args.model, tokens, args.timeout))


if __name__ == "__main__":
    main()
