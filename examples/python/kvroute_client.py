#!/usr/bin/env python3
"""A kvroute client in another language: block hashing and worker selection with retries.

Uses only the wire contract in PROTOCOL.md (MessagePack maps with named fields over NATS),
including its advice for clients: every attempt of a selection carries the same request_id,
its attempt number and its own deadline; an attempt that gets no answer in time (or
"unavailable", or nobody listening) is retried, a retry going to the router that answered last.

    python3 examples/python/kvroute_client.py --nats-url nats://127.0.0.1:4222 --namespace default --model mock-model --session-id chat-42
    python3 examples/python/kvroute_client.py --count 20 --json  # 20 selections, a JSON summary
    python3 examples/python/kvroute_client.py --once      # one attempt, no retries (select_once)
    python3 examples/python/kvroute_client.py --session-id chat-1 --count 5 --interval 0.6 --run 100000
                                                  # each request then runs on its worker
    python3 examples/python/kvroute_client.py --vectors   # the hashing test vectors as JSON
    python3 examples/python/kvroute_client.py --encode-only  # one encoded SelectRequest as hex

Exit status: 0 when every selection found a worker; 1 when one did not (an error reply from a
router, no router answering, or no NATS server), with one line on stderr for each; 2 for bad
arguments.
"""
import argparse
import asyncio
import json
import os
import struct
import sys
import time
import uuid

import msgpack
import xxhash

SEED = 1337
PROG = "kvroute_client"


def seed_for_lora(lora_name=None):
    """1337, or 1337 + XXH3-64 of the adapter name's UTF-8 bytes with seed 0 (wrapping)."""
    if not lora_name:
        return SEED
    return (SEED + xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), 0)) % 2**64


def local_block_hashes(tokens, block_size, lora_name=None):
    """XXH3-64 over the little-endian u32 token ids of each *full* block."""
    seed = seed_for_lora(lora_name)
    full = len(tokens) // block_size * block_size
    return [
        xxhash.xxh3_64_intdigest(struct.pack("<%dI" % block_size, *tokens[i:i + block_size]), seed)
        for i in range(0, full, block_size)
    ]


def sequence_hashes(local, lora_name=None):
    """seq[0] = local[0]; seq[i] = XXH3-64(LE(seq[i-1]) || LE(local[i]), 1337).

    The chain's seed is 1337 whatever the adapter: the local hashes already carry it."""
    del lora_name
    seed = SEED
    out = []
    for h in local:
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed))
    return out


def select_request(model, tokens, session_id=None, final=False, trigger="user_message"):
    """A SelectRequest map; a session keeps its requests on one worker (the router binds it)."""
    req = {"v": 1, "request_id": str(uuid.uuid4()), "model": model, "token_ids": tokens}
    if session_id:
        req["session"] = {"id": session_id, "final": final, "trigger": trigger}
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


# PROTOCOL.md ("A client in another language") shows this function exactly as it is here.
async def select_once(nc, namespace="default", model="mock-model", tokens=None,
                      session_id=None, timeout=0.25):
    """One selection attempt, without retries (kvroute_client.SelectClient retries as
    PROTOCOL.md advises). Returns the reply map, {"status": "ok", "worker_id": ..., "request_subject": ...}
    or {"status": "error", "code": ..., "message": ...}; or None if no router answered."""
    import nats.errors
    request = {"v": 1, "request_id": str(uuid.uuid4()), "model": model,
               "token_ids": tokens or list(range(1, 257)), "attempt": 0,
               "deadline_ms": int(time.time() * 1000 + timeout * 1000)}
    if session_id:  # the router keeps a session's requests on one worker
        request["session"] = {"id": session_id, "final": False, "trigger": "user_message"}
    try:
        msg = await nc.request("kvroute.%s.select" % namespace,
                               msgpack.packb(request, use_bin_type=True), timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return None  # nobody listening, or no answer in time: worth a retry
    return msgpack.unpackb(msg.data, raw=False)


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
        definitive error (no_workers, all_overloaded, ...) is returned, not retried. Raises
        NoAnswer when no router answered."""
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
        raise NoAnswer("no router answered %d attempts on kvroute.%s.select (is a router "
                       "running in namespace %r?)" % (self.attempts, self.namespace,
                                                      self.namespace))


async def run_on_worker(nc, reply, request, max_tokens):
    """Sends the selected request to its worker (a GenerateRequest on the reply's
    request_subject, with the selection's request_id) and returns at once: the worker answers
    when the request finishes, on an inbox this client does not wait for."""
    generate = {"v": 1, "request_id": reply["request_id"], "token_ids": request["token_ids"],
                "max_tokens": max_tokens, "dp_rank": reply.get("dp_rank", 0),
                "decision_id": reply.get("decision_id")}
    await nc.publish(reply["request_subject"], msgpack.packb(generate, use_bin_type=True),
                     reply=nc.new_inbox())
    await nc.flush()


def fail(message):
    """One line on stderr (no traceback)."""
    print("%s: %s" % (PROG, message), file=sys.stderr)


def nats_identity(env=None):
    """nats.connect() options of this process's identity, from the same variables kvroute's
    processes read (scripts/gen-auth's env files): KVROUTE_NATS_USER / _PASSWORD or _TOKEN,
    KVROUTE_NATS_TLS_CA (verify the server; implies TLS) and KVROUTE_NATS_INBOX_PREFIX (the
    identity's own reply subjects, which its permissions allow it to read)."""
    env = os.environ if env is None else env
    opts = {}
    if env.get("KVROUTE_NATS_USER"):
        opts["user"] = env["KVROUTE_NATS_USER"]
        opts["password"] = env.get("KVROUTE_NATS_PASSWORD", "")
    if env.get("KVROUTE_NATS_TOKEN"):
        opts["token"] = env["KVROUTE_NATS_TOKEN"]
    if env.get("KVROUTE_NATS_INBOX_PREFIX"):
        opts["inbox_prefix"] = env["KVROUTE_NATS_INBOX_PREFIX"]
    if env.get("KVROUTE_NATS_TLS_CA"):
        import ssl
        opts["tls"] = ssl.create_default_context(cafile=env["KVROUTE_NATS_TLS_CA"])
    return opts


async def connect(nats_url):
    """A NATS connection (as the identity nats_identity() reads), or None after one line on
    stderr."""
    import nats  # imported here so --vectors needs only msgpack and xxhash

    async def quiet(_error):  # connection errors are reported once, below
        pass

    try:
        # Pings every 2 s, 2 outstanding at most: a dead server is noticed within seconds,
        # matching the servers' own settings (PROTOCOL.md, "Selecting reliably").
        return await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=2,
                                  ping_interval=2, max_outstanding_pings=2, error_cb=quiet,
                                  **nats_identity())
    except Exception as e:  # NoServersError, OSError, TimeoutError, a bad URL...
        fail("cannot connect to NATS at %s: %s" % (nats_url, e or type(e).__name__))
        return None


async def select(args, tokens):
    """Makes args.count selections; returns the summary, or None if NATS was unreachable."""
    nc = await connect(args.nats_url)
    if nc is None:
        return None
    client = SelectClient(nc, args.namespace)
    summary = {"ok": 0, "errors": {}, "attempts": [], "workers": [], "bindings": []}
    try:
        for i in range(args.count):
            if i and args.interval:
                await asyncio.sleep(args.interval)
            final = args.session_final and i == args.count - 1
            try:
                if args.once:
                    reply, attempts = await select_once(
                        nc, args.namespace, args.model, tokens, args.session_id), 1
                    if reply is None:
                        raise NoAnswer("no router answered on kvroute.%s.select (is a router "
                                       "running in namespace %r?)"
                                       % (args.namespace, args.namespace))
                else:
                    request = select_request(args.model, tokens, args.session_id, final,
                                             args.session_trigger)
                    reply, attempts = await client.select(request)
                if args.run is not None and reply.get("status") == "ok":
                    await run_on_worker(nc, reply, {"token_ids": tokens}, args.run)
            except NoAnswer as e:
                summary["errors"]["no_answer"] = summary["errors"].get("no_answer", 0) + 1
                if not args.json:
                    fail(str(e))
                continue
            summary["attempts"].append(attempts)
            if reply.get("status") == "ok":
                summary["ok"] += 1
                summary["workers"].append(reply["worker_id"])
                summary["bindings"].append(reply.get("binding"))
                if not args.json:
                    binding = " binding %s" % reply["binding"] if reply.get("binding") else ""
                    cost = reply.get("cost") or {}
                    terms = ", ".join("%s %g" % kv for kv in sorted(cost.get("terms", {}).items()))
                    print("worker %s rank %s (%s of %s blocks cached, policy %s, cost %g%s, "
                          "router %s%s)"
                          % (reply["worker_id"], reply.get("dp_rank", 0),
                             (reply.get("overlap_blocks") or {}).get("device", 0),
                             reply.get("request_blocks"),
                             reply.get("policy"), cost.get("total", 0),
                             " = " + terms if terms else "", reply.get("router_id"), binding))
            else:
                code = reply.get("code")
                summary["errors"][code] = summary["errors"].get(code, 0) + 1
                if not args.json:
                    fail("error %s: %s" % (code, reply.get("message")))
    finally:
        await nc.close()
    if args.json:
        json.dump(summary, sys.stdout)
        print()
        failed = args.count - summary["ok"]
        if failed:
            fail("%d of %d selections failed: %s" % (failed, args.count, ", ".join(
                "%s %d" % kv for kv in sorted(summary["errors"].items()))))
    return summary


def main():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # The same variables kvroute's processes fall back to for these flags.
    p.add_argument("--nats-url", default=os.environ.get("KVROUTE_NATS_URL") or "nats://127.0.0.1:4222",
                   help="NATS server (default: $KVROUTE_NATS_URL, else nats://127.0.0.1:4222)")
    p.add_argument("--namespace", default=os.environ.get("KVROUTE_NAMESPACE") or "default",
                   help="the routers' --namespace (default: $KVROUTE_NAMESPACE, else default)")
    p.add_argument("--model", default="mock-model",
                   help="a model the workers serve (kvroute-mocker's default: mock-model)")
    p.add_argument("--count", type=int, default=1, help="selections to make, one after another")
    p.add_argument("--session-id", help="send every selection in this session (its first is "
                   "bound to a worker, the next ones keep it)")
    p.add_argument("--session-final", action="store_true",
                   help="mark the last selection as the session's last (its binding is removed)")
    p.add_argument("--session-trigger", default="user_message",
                   choices=["user_message", "tool_result", "other"])
    p.add_argument("--interval", type=float, default=0.0,
                   help="seconds to wait between two selections")
    p.add_argument("--run", type=int, metavar="MAX_TOKENS",
                   help="send each selected request to its worker to generate MAX_TOKENS tokens "
                   "(a GenerateRequest; this client does not wait for the answer)")
    p.add_argument("--once", action="store_true",
                   help="one attempt per selection, no retries (select_once)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary on stdout instead of lines")
    p.add_argument("--vectors", action="store_true")
    p.add_argument("--encode-only", action="store_true")
    args = p.parse_args()
    if args.count < 1:
        p.error("--count must be at least 1")
    if args.interval < 0:
        p.error("--interval must be at least 0")
    if args.run is not None and args.run < 1:
        p.error("--run must be at least 1")
    if args.session_id is not None and not 1 <= len(args.session_id.encode("utf-8")) <= 256:
        p.error("--session-id must be 1-256 bytes")
    tokens = list(range(1, 257))
    if args.vectors:
        json.dump(vectors(), sys.stdout)
        return 0
    if args.encode_only:
        request = select_request(args.model, tokens, args.session_id or "s-1")
        print(msgpack.packb(request, use_bin_type=True).hex())
        return 0
    try:
        summary = asyncio.run(select(args, tokens))
    except KeyboardInterrupt:
        return 130
    return 0 if summary is not None and summary["ok"] == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
