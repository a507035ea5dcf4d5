#!/usr/bin/env python3
"""Runs vLLM's or SGLang's own ZmqEventPublisher, one per data-parallel rank, loaded from the
files scripts/install-deps extracts from the engines' wheels; publishes what JSON commands on
stdin ask for and answers each with one JSON line on stdout (tests/engines/README.md).

    python3 tests/engines/engine_publisher.py --engine vllm --endpoint 'tcp://*:5557' \
        --replay-endpoint tcp://127.0.0.1:5600 --dp-size 2
"""

import argparse
import atexit
import importlib
import json
import logging
import sys
import time
from pathlib import Path

import msgspec
import zmq

HERE = Path(__file__).resolve().parent
STAND_INS = HERE / "stand_ins"
DEFAULT_ENGINES_DIR = HERE.parent.parent / ".tools" / "engines"
PUBLISHER_MODULE = {
    "vllm": "vllm.distributed.kv_events",
    "vllm-0.34": "vllm.distributed.kv_events",
    "sglang": "sglang.srt.disaggregation.kv_events",
}
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
HASH_FIELDS = ("block_hashes", "parent_block_hash")
# How long a published batch may take to leave the publisher thread.
SEND_TIMEOUT_S = 10.0


class CommandError(Exception):
    """A command the driver refuses; the message goes back in the reply."""


def import_from_wheel(name, wheel_dir):
    """Imports `name` and checks it is the wheel's file, not a stand-in or an installed copy."""
    module = importlib.import_module(name)
    path = Path(module.__file__).resolve()
    if wheel_dir.resolve() not in path.parents:
        raise SystemExit(f"{name} was imported from {path}, not from {wheel_dir}")
    return module


class Vllm:
    """vLLM's path: the scheduler calls EventPublisherFactory.create(kv_events_config,
    data_parallel_index) and publishes KVEventBatch(ts=time.time(), events=...)."""

    rank_field = "data_parallel_rank"

    def __init__(self, wheel_dir):
        self.kv_events = import_from_wheel("vllm.distributed.kv_events", wheel_dir)
        self.config_module = import_from_wheel("vllm.config.kv_events", wheel_dir)

    def create(self, rank, args):
        config = self.config_module.KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=args.endpoint,
            replay_endpoint=args.replay_endpoint,
            buffer_steps=args.buffer_steps,
            topic=args.topic,
        )
        return self.kv_events.EventPublisherFactory.create(config, rank)

    def describe(self, publisher):
        return {
            "binds": self.kv_events.ZmqEventPublisher._is_bind_endpoint(publisher._endpoint),
            "config_module": self.config_module.__file__,
        }


class Sglang:
    """SGLang's path (SchedulerKvEventsPublisher.init_kv_events): a publisher only where
    is_kv_publisher_rank(config) holds, created by EventPublisherFactory.create(config JSON,
    select_kv_publisher_dp_rank(...)). Ranks are pure data parallelism (attn_dp_size 1)."""

    rank_field = "attn_dp_rank"

    def __init__(self, wheel_dir):
        self.kv_events = import_from_wheel(PUBLISHER_MODULE["sglang"], wheel_dir)
        self.runtime_context = importlib.import_module("sglang.srt.runtime_context")

    def create(self, rank, args):
        config = json.dumps(
            {
                "publisher": "zmq",
                "endpoint": args.endpoint,
                "replay_endpoint": args.replay_endpoint,
                "buffer_steps": args.buffer_steps,
                "topic": args.topic,
            }
        )
        self.runtime_context.set_parallel(dp_rank=rank)
        if not self.kv_events.is_kv_publisher_rank(config):
            raise SystemExit(f"SGLang says rank {rank} publishes no KV events")
        parallel = self.runtime_context.get_parallel()
        publisher_rank = self.kv_events.select_kv_publisher_dp_rank(
            parallel.attn_dp_size, parallel.attn_dp_rank, parallel.dp_rank
        )
        publisher = self.kv_events.EventPublisherFactory.create(config, publisher_rank)
        # SGLang registers shutdown() with atexit; the driver shuts every publisher down
        # itself, and a second shutdown() waits 1 s for a queue no thread drains any more.
        atexit.unregister(publisher.shutdown)
        return publisher

    def describe(self, publisher):
        return {
            "binds": publisher._local_pub_endpoint is not None,
            # What SGLang advertises to local consumers (/server_info's kv_events sources).
            "local_source": publisher.describe_local_source(block_size=16),
        }


class Driver:
    def __init__(self, engine, args):
        self.engine = engine
        self.args = args
        self.publishers = []
        self.next_seq = []
        self.drops = []

    def start(self):
        self.publishers = [self.engine.create(r, self.args) for r in range(self.args.dp_size)]
        self.next_seq = [0] * self.args.dp_size
        self.drops = [0] * self.args.dp_size

    def shutdown(self):
        for publisher in self.publishers:
            publisher.shutdown()
        self.publishers = []

    def publisher(self, cmd):
        rank = cmd.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < len(self.publishers):
            raise CommandError(f"rank must be 0..{len(self.publishers) - 1}, got {rank!r}")
        return rank, self.publishers[rank]

    def handle(self, cmd):
        op = cmd.get("op")
        if op == "publish":
            return self.publish(cmd)
        if op == "drop_next":
            return self.drop_next(cmd)
        if op == "drop_replay":
            return self.drop_replay(cmd)
        if op == "restart":
            self.shutdown()
            # A new engine incarnation, as a new process would be: a fresh ZMQ context, so the
            # old sockets are gone (ports free) before the new ones bind.
            zmq.Context.instance().term()
            self.start()
            return {"ok": True}
        if op == "info":
            return self.info()
        raise CommandError(f"unknown op {op!r}")

    def publish(self, cmd):
        rank, publisher = self.publisher(cmd)
        events = cmd.get("events")
        if not isinstance(events, list):
            raise CommandError("events must be a list")
        batch = self.engine.kv_events.KVEventBatch(
            ts=float(cmd.get("ts", time.time())),
            events=[self.event(e) for e in events],
        )
        # Fail here rather than in the publisher thread, which would log, skip the batch and
        # never mark it done (e.g. a hash outside msgpack's 64-bit integers).
        try:
            msgspec.msgpack.encode(batch)
        except (TypeError, OverflowError, ValueError) as e:
            raise CommandError(f"the engine cannot encode this batch: {e}") from e
        seq = self.next_seq[rank]
        publisher.publish(batch)
        wait_sent(publisher._event_queue)
        self.next_seq[rank] += 1
        if publisher._buffer and publisher._buffer[-1][0] != seq:
            raise CommandError(f"expected seq {seq}, the engine sent {publisher._buffer[-1][0]}")
        return {"ok": True, "seq": seq}

    def event(self, spec):
        """The engine's own event struct for a JSON event: its fields only, types checked."""
        if not isinstance(spec, dict):
            raise CommandError(f"an event must be an object, got {spec!r}")
        fields = dict(spec)
        kind = fields.pop("type", None)
        if kind not in EVENT_TYPES:
            raise CommandError(f"event type must be one of {EVENT_TYPES}, got {kind!r}")
        cls = getattr(self.engine.kv_events, kind)
        unknown = sorted(set(fields) - set(cls.__struct_fields__))
        if unknown:
            raise CommandError(
                f"{self.args.engine}'s {kind} has no field {', '.join(unknown)} "
                f"(its fields: {', '.join(cls.__struct_fields__) or 'none'})"
            )
        for name in HASH_FIELDS:
            if name in fields:
                value = fields[name]
                fields[name] = (
                    [block_hash(h) for h in value] if isinstance(value, list) else block_hash(value)
                )
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as e:
            raise CommandError(f"{self.args.engine}'s {kind}: {e}") from e

    def drop_next(self, cmd):
        """The rank's next batch goes to the replay buffer but not out of the PUB socket, as
        if the high-water mark had dropped it: the socket's send_multipart is wrapped."""
        rank, publisher = self.publisher(cmd)
        sock = publisher._pub
        self.drops[rank] += 1
        if self.drops[rank] == 1:

            def drop(frames, *args, **kwargs):
                self.drops[rank] -= 1
                if self.drops[rank] == 0:
                    del sock.send_multipart  # the socket's own method again

            sock.send_multipart = drop
        return {"ok": True}

    def drop_replay(self, cmd):
        """The rank's next replay answer leaves out the batches `seqs` but still ends with the end
        marker, as when the replay ROUTER's send high-water mark (vLLM 0.32: 1,000 messages)
        drops them: the replay socket's send_multipart is wrapped for one answer."""
        rank, publisher = self.publisher(cmd)
        seqs = cmd.get("seqs")
        if not isinstance(seqs, list) or not all(isinstance(s, int) for s in seqs):
            raise CommandError("seqs must be a list of integers")
        sock = publisher._replay
        if sock is None:
            raise CommandError("the rank has no replay socket")
        dropped = {s.to_bytes(8, "big") for s in seqs}
        send = sock.send_multipart

        def drop(frames, *args, **kwargs):
            # (client, "", topic, seq, payload); the end marker's seq is -1.
            seq = frames[3] if len(frames) == 5 else None
            if seq in dropped:
                return None
            if seq == publisher.END_SEQ:
                del sock.send_multipart  # the socket's own method again
            return send(frames, *args, **kwargs)

        sock.send_multipart = drop
        return {"ok": True}

    def info(self):
        ranks = []
        for rank, publisher in enumerate(self.publishers):
            ranks.append(
                {
                    "rank": rank,
                    "endpoint": publisher._endpoint,
                    "replay_endpoint": publisher._replay_endpoint,
                    **self.engine.describe(publisher),
                }
            )
        return {
            "ok": True,
            "engine": self.args.engine,
            "module": self.engine.kv_events.__file__,
            "rank_field": self.engine.rank_field,
            "ranks": ranks,
            "events": {
                kind: struct_shape(getattr(self.engine.kv_events, kind)) for kind in EVENT_TYPES
            },
        }


def struct_shape(cls):
    """An event class's fields in order, and the defaults of those that have one."""
    fields = cls.__struct_fields__
    defaults = cls.__struct_defaults__
    with_default = fields[len(fields) - len(defaults) :]
    return {"fields": list(fields), "defaults": dict(zip(with_default, defaults))}


def block_hash(value):
    """A JSON block hash: an integer, or {"bytes_hex": "..."} for bytes (vLLM's own kind)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, dict) and set(value) == {"bytes_hex"}:
        try:
            return bytes.fromhex(value["bytes_hex"])
        except (TypeError, ValueError) as e:
            raise CommandError(f"bad bytes_hex {value['bytes_hex']!r}: {e}") from e
    raise CommandError(f'a block hash is an integer or {{"bytes_hex": ...}}, got {value!r}')


def wait_sent(event_queue):
    """Queue.join with a deadline: the publisher thread marks a batch done once it is sent."""
    deadline = time.monotonic() + SEND_TIMEOUT_S
    with event_queue.all_tasks_done:
        while event_queue.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandError(f"the publisher thread did not send within {SEND_TIMEOUT_S} s")
            event_queue.all_tasks_done.wait(left)


def reply(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(PUBLISHER_MODULE), required=True)
    parser.add_argument("--engines-dir", type=Path, default=DEFAULT_ENGINES_DIR)
    parser.add_argument(
        "--endpoint", required=True, help="rank 0's PUB endpoint; rank r's port is PORT+r"
    )
    parser.add_argument("--replay-endpoint", default=None)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--topic", default="")
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    wheel_dir = args.engines_dir / args.engine
    if not (wheel_dir / ".wheel-sha256").is_file():
        raise SystemExit(f"{wheel_dir} has no extracted wheel files: run scripts/install-deps")
    # The stand-ins first: their package __init__s extend each package over the wheel's
    # directory too, where the publisher modules themselves are found.
    sys.path[:0] = [str(STAND_INS), str(wheel_dir)]
    engine = (Vllm if args.engine.startswith("vllm") else Sglang)(wheel_dir)

    driver = Driver(engine, args)
    driver.start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    quitting = False
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                cmd = json.loads(line)
                if not isinstance(cmd, dict):
                    raise CommandError("a command is a JSON object")
                if cmd.get("op") == "quit":
                    quitting = True
                    break
                reply(driver.handle(cmd))
            except Exception as e:  # any failure is a reply; the driver keeps going
                reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        driver.shutdown()
    if quitting:
        reply({"ok": True})


if __name__ == "__main__":
    main()
