#!/usr/bin/env python3
"""A kvroute client in another language: block hashing and worker selection with retries.

Uses only the wire contract in PROTOCOL.md (MessagePack maps with named fields over NATS),
including its advice for clients: every attempt of a selection carries the same request_id,
its attempt number and its own deadline; an attempt that gets no answer in time (or
"unavailable", or nobody listening) is retried, a retry going to the router that answered last.

    python3 kvroute_client.py --nats-url nats://127.0.0.1:4222 --namespace default --model demo
    python3 kvroute_client.py --count 20 --json   # 20 selections, a JSON summary
    python3 kvroute_client.py --vectors           # prints the hashing test vectors as JSON
    python3 kvroute_client.py --encode-only       # prints one encoded SelectRequest as hex
"""
import argparse
import asyncio
import json
import struct
import sys
import time
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


class NoAnswer(Exception):
    """No router answered any attempt (nobody listening, or every attempt timed out)."""


class SelectClient:
    """Selections with PROTOCOL.md's retry rule. Share one per process: it remembers which
    router answered last, so a retry skips a router that stopped answering."""

    def __init__(self, nc, namespace, attempts=4, attempt_timeout=0.25, max_timeout=2.0,
                 no_responders_backoff=0.1):
        self.nc, self.namespace = nc, namespace
        self.attempts, self.attempt_timeout = attempts, attempt_timeout
        self.max_timeout, self.no_responders_backoff = max_timeout, no_responders_backoff
        self.last_good = None  # router_id of the router that answered last

    async def select(self, request):
        """Returns (reply, attempts). A reply is a map with status "ok" or "error"; a
        definitive error (no_workers, all_overloaded, ...) is returned, not retried."""
        import nats.errors

        request = dict(request)
        request.setdefault("request_id", str(uuid.uuid4()))  # the same on every attempt
        failed, retryable = set(), None
        for attempt in range(self.attempts):
            # The first attempt goes to the queue group; a retry to the router that answered
            # last, unless it already failed this request.
            direct = self.last_good if attempt > 0 and self.last_good not in failed else None
            subject = ("kvroute.%s.router.%s.select" % (self.namespace, direct) if direct
                       else "kvroute.%s.select" % self.namespace)
            timeout = min(self.attempt_timeout * 2 ** attempt, self.max_timeout)
            request["attempt"] = attempt
            request["deadline_ms"] = int(time.time() * 1000 + timeout * 1000)
            try:
                msg = await self.nc.request(subject, msgpack.packb(request, use_bin_type=True),
                                            timeout=timeout)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
                if direct:
                    failed.add(direct)
                    if self.last_good == direct:
                        self.last_good = None
                elif isinstance(e, nats.errors.NoRespondersError):
                    await asyncio.sleep(self.no_responders_backoff)
                continue
            reply = msgpack.unpackb(msg.data, raw=False)
            if reply.get("status") == "ok":
                self.last_good = reply.get("router_id") or self.last_good
                return reply, attempt + 1
            if reply.get("code") != "unavailable":
                return reply, attempt + 1
            retryable = (reply, attempt + 1)  # this router is not ready: try another
            if direct:
                failed.add(direct)
        if retryable:
            return retryable
        raise NoAnswer("no router answered %d attempts" % self.attempts)


async def select(nats_url, namespace, model, tokens, count, as_json):
    import nats  # imported here so --vectors needs only msgpack and xxhash

    nc = await nats.connect(nats_url)
    client = SelectClient(nc, namespace)
    summary = {"ok": 0, "errors": {}, "attempts": []}
    try:
        for _ in range(count):
            try:
                reply, attempts = await client.select(select_request(model, tokens))
            except NoAnswer:
                summary["errors"]["no_answer"] = summary["errors"].get("no_answer", 0) + 1
                continue
            summary["attempts"].append(attempts)
            if reply["status"] == "ok":
                summary["ok"] += 1
                if not as_json:
                    print("worker %s rank %s (overlap %s of %s blocks, policy %s, router %s)" % (
                        reply["worker_id"], reply.get("dp_rank", 0), reply.get("overlap_blocks"),
                        reply.get("request_blocks"), reply.get("policy"), reply.get("router_id")))
            else:
                code = reply.get("code")
                summary["errors"][code] = summary["errors"].get(code, 0) + 1
                if not as_json:
                    print("error %s: %s" % (code, reply.get("message")))
    finally:
        await nc.close()
    if as_json:
        json.dump(summary, sys.stdout)
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--namespace", default="default")
    p.add_argument("--model", default="demo")
    p.add_argument("--count", type=int, default=1, help="selections to make, one after another")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of lines")
    p.add_argument("--vectors", action="store_true")
    p.add_argument("--encode-only", action="store_true")
    args = p.parse_args()
    tokens = list(range(1, 257))
    if args.vectors:
        json.dump(vectors(), sys.stdout)
    elif args.encode_only:
        print(msgpack.packb(select_request(args.model, tokens, "s-1"), use_bin_type=True).hex())
    else:
        summary = asyncio.run(select(args.nats_url, args.namespace, args.model, tokens,
                                     args.count, args.json))
        return 0 if summary["ok"] == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
