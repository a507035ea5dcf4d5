#!/usr/bin/env python3
"""The gateway measurements of scripts/fault-test, against running kvroute-gateway replicas
(PROTOCOL.md, "HTTP API of kvroute-gateway"). Each subcommand runs for --seconds at --rate
requests a second, spread over the replicas of --gateways in turn, polls every replica's
/readyz once a second meanwhile, and prints one JSON object on stdout.

  chat    streamed chat turns through the official `openai` client, as an application sends
          them: a few conversations at a time, each of --turns turns (every turn adds the
          assistant's answer and a new user message) under its own `x-session-id` (the last
          turn sends `x-session-final`), the next turn of a conversation going to the next
          replica; every request gives up after --timeout seconds. Figures: success under the
          rule below, failures by kind, latency and TTFT, the workers served, turns kept on
          their conversation's worker.
  select  `POST /v1/select` with token ids and `"http_only": false` (the selection API, the
          fleet's workers reached over NATS): answers 200 per replica.
  completions  OpenAI completions through the `openai` client against a disaggregated fleet,
          streamed and whole in turn: long prompts (one of a few shared documents, then a
          question of the request's own: tens of KV blocks), --max-tokens tokens, the replicas
          in turn, each request given up after --timeout seconds. Each request's outcome, its
          prefill and decode workers (answer headers `x-kvroute-worker-id`,
          `x-kvroute-decode-worker-id`) and, for an error, whether its body (or a stream's
          error event) was JSON. With --faults, per window ({"what", "start", "end", ...}: a
          kill at `start`, its workers out of routing at `end`): the requests in flight at
          the kill and those sent before its workers left routing, by outcome, and the
          longest of them; `success` counts neither.

SIGTERM ends the run early: no more requests are sent, those sent are waited for, and the JSON
covers what ran.

The faulted-worker rule (chat). A request fails when the gateway answers an error, the stream
breaks (an error event), or no answer comes within --timeout. A failed request does not count
when its worker was faulted while it ran: its worker is the one the answer header
`x-kvroute-worker-id` names (an answer that came, then broke or hung) or, for the gateway's own
502 / 504, the last `worker N` of its error message; "faulted while it ran" means a window of
--faults (a JSON-lines file the fault test writes as it injects faults: {"what", "start", "end",
"workers", "freeze"}, Unix times) lists that worker and overlaps the request's [start, end]. A
request that timed out before any answer header names no worker (the gateway waits for a frozen
engine's headers longer than the client): it does not count when it overlapped a window that
froze workers (`"freeze": true`, a paused engine host: requests sent to it hang until their
timeout, and the gateway cannot retry them), and counts as a failure otherwise. Every other
failure counts: an error naming no faulted worker (no worker, no router, a bad request), a
gateway that does not answer.
"""
import argparse
import asyncio
import json
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

WORKER_HEADER = "x-kvroute-worker-id"
OVERLAP_HEADER = "x-kvroute-overlap-blocks"
WORKER_IN_MESSAGE = re.compile(r"\bworker (\d+)\b")


def gateway_urls(urls):
    return [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]


def pct(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1) if values else None


class ReadyPoller:
    """GET /readyz of every replica once a second, on a thread: polls and non-200 answers."""

    def __init__(self, urls):
        self.urls = urls
        self.polls = [0 for _ in urls]
        self.not_ready = [0 for _ in urls]
        self.last_error = [None for _ in urls]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            for i, url in enumerate(self.urls):
                self.polls[i] += 1
                try:
                    with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                        ok = r.status == 200
                except Exception as e:  # refused, timed out, 503
                    ok, self.last_error[i] = False, str(e)
                if not ok:
                    self.not_ready[i] += 1
            self.stop.wait(1.0)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=5)

    def figures(self):
        return [{"url": u, "ready_polls": p, "not_ready": n, "last_error": e}
                for u, p, n, e in zip(self.urls, self.polls, self.not_ready, self.last_error)]


async def paced(seconds, rate, send):
    """Calls send(i) every 1/rate s for `seconds`, each on its own task, until SIGTERM; waits
    for them all."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tasks = []
    start = time.time()
    for i in range(int(seconds * rate)):
        delay = start + i / rate - time.time()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
        if stop.is_set():
            break
        tasks.append(asyncio.create_task(send(i)))
    await asyncio.gather(*tasks)


class Conversation:
    def __init__(self, cid, turns):
        self.id = cid
        self.turns = turns
        self.turn = 0
        self.busy = False
        self.worker = None  # the worker of its last successful turn
        self.messages = [{"role": "system",
                          "content": f"You are the assistant of conversation {cid}. Answer briefly. " * 3}]


class Conversations:
    """The conversations in progress: each tick takes the next idle one, opening a new one when
    all are busy (a hung request does not slow the others down); a finished one is replaced."""

    def __init__(self, count, turns, cap=64):
        self.turns = turns
        self.cap = cap
        self.opened = 0
        self.pool = [self.open() for _ in range(count)]
        self.next = 0

    def open(self):
        self.opened += 1
        return Conversation("gateway-probe-%d" % self.opened, self.turns)

    def take(self):
        n = len(self.pool)
        for k in range(n):
            c = self.pool[(self.next + k) % n]
            if not c.busy:
                self.next = (self.next + k + 1) % n
                c.busy = True
                return c
        if n >= self.cap:
            return None
        c = self.open()
        self.pool.append(c)
        c.busy = True
        return c

    def done(self, c):
        c.busy = False
        if c.turn >= c.turns:
            self.pool[self.pool.index(c)] = self.open()


def load_faults(path):
    if not path:
        return []
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def excused(record, faults):
    """The faulted-worker rule of the module docstring."""
    if record["kind"] == "ok":
        return False
    s, e = record["start"], record["end"]
    overlapping = [w for w in faults if w["start"] <= e and s <= w["end"]]
    if record["worker"] is not None:
        return any(record["worker"] in w["workers"] for w in overlapping)
    return record["kind"] == "timeout" and any(w.get("freeze") for w in overlapping)


def per_fault(window, records, faults):
    """The requests that ran during one fault window, by outcome."""
    during = [r for r in records if r["start"] <= window["end"] and window["start"] <= r["end"]]
    out = [r for r in during if excused(r, faults)]
    ok = sum(1 for r in during if r["kind"] == "ok")
    return {"what": window["what"], "sent": len(during), "ok": ok, "excused": len(out),
            "failed": len(during) - ok - len(out),
            "on_its_workers": sum(1 for r in during if r["worker"] in window["workers"])}


async def chat(args):
    import openai

    urls = gateway_urls(args.gateways)
    # The client's own timeout is a backstop: asyncio.wait_for ends a request at --timeout.
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0,
                                  timeout=args.timeout + 5) for u in urls]
    conversations = Conversations(args.conversations, args.turns)
    records = []
    skipped = 0

    async def turn(c, i, seen):
        gateway = i % len(urls)
        c.messages.append({"role": "user",
                           "content": f"Turn {c.turn} of {c.id}: " + "tell me more about it. " * 4})
        headers = {"x-session-id": c.id, "x-request-id": f"{c.id}-turn-{c.turn}-{i}"}
        if c.turn == c.turns - 1:
            headers["x-session-final"] = "true"
        raw = await clients[gateway].chat.completions.with_raw_response.create(
            model=args.model, messages=c.messages, max_tokens=args.max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_headers=headers)
        seen["worker"] = int(raw.headers[WORKER_HEADER])
        seen["overlap"] = int(raw.headers.get(OVERLAP_HEADER, 0))
        stream = raw.parse()
        text = ""
        try:
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        seen.setdefault("ttft", time.time() - seen["start"])
                        text += choice.delta.content
        finally:
            await stream.close()
        return text

    async def send(i):
        nonlocal skipped
        c = conversations.take()
        if c is None:
            skipped += 1
            return
        seen = {"start": time.time()}
        kind, status = "ok", None
        try:
            text = await asyncio.wait_for(turn(c, i, seen), args.timeout)
        except asyncio.TimeoutError:
            kind = "timeout"
        except openai.APIStatusError as e:
            status = e.status_code
            kind = "status_%d_%s" % (e.status_code, e.code or "error")
            header = e.response.headers.get(WORKER_HEADER)
            named = WORKER_IN_MESSAGE.findall(e.message or "")
            if header:
                seen["worker"] = int(header)
            elif named:
                seen["worker"] = int(named[-1])
        except openai.APIError as e:
            # After the answer's headers: an error event ends the stream.
            kind = "connect" if isinstance(e, openai.APIConnectionError) else "stream_error"
            if "worker" not in seen:
                named = WORKER_IN_MESSAGE.findall(getattr(e, "message", "") or "")
                if named:
                    seen["worker"] = int(named[-1])
        except Exception as e:  # anything else the client raises counts, named by its class
            kind = "error_" + type(e).__name__
        end = time.time()
        worker = seen.get("worker")
        if kind == "ok":
            kept = c.worker is not None and c.worker == worker
            first = c.worker is None
            c.messages.append({"role": "assistant", "content": text})
            c.turn += 1
            c.worker = worker
        else:
            c.messages.pop()  # the turn is asked again
            kept = first = False
        conversations.done(c)
        records.append({"start": seen["start"], "end": end, "gateway": i % len(urls),
                        "kind": kind, "status": status, "worker": worker,
                        "overlap": seen.get("overlap"), "ttft": seen.get("ttft"),
                        "kept": kept, "first": first})

    with ReadyPoller(urls) as ready:
        await paced(args.seconds, args.rate, send)
    for client in clients:
        await client.close()

    faults = load_faults(args.faults)
    ok = [r for r in records if r["kind"] == "ok"]
    out_of_rule = [r for r in records if excused(r, faults)]
    counted = [r for r in records if r["kind"] != "ok" and not excused(r, faults)]
    by_kind = lambda rs: {k: sum(1 for r in rs if r["kind"] == k) for k in sorted({r["kind"] for r in rs})}
    judged = len(records) - len(out_of_rule)
    workers = {}
    for r in ok:
        workers[str(r["worker"])] = workers.get(str(r["worker"]), 0) + 1
    later = [r for r in ok if not r["first"]]
    print(json.dumps({
        "sent": len(records), "ok": len(ok), "skipped": skipped,
        "excused": len(out_of_rule), "excused_by_kind": by_kind(out_of_rule),
        "failed": len(counted), "failures": by_kind(counted),
        "failed_examples": [{k: r[k] for k in ("kind", "worker", "gateway")} for r in counted[:5]],
        "success": len(ok) / judged if judged else 0.0,
        "per_gateway": [{"url": u, "sent": sum(1 for r in records if r["gateway"] == g),
                         "ok": sum(1 for r in ok if r["gateway"] == g)} for g, u in enumerate(urls)],
        "conversations": conversations.opened, "workers": workers,
        "kept_on_worker": sum(1 for r in later if r["kept"]), "later_turns": len(later),
        "p50_ms": pct([(r["end"] - r["start"]) * 1000 for r in ok], 0.5),
        "p99_ms": pct([(r["end"] - r["start"]) * 1000 for r in ok], 0.99),
        "ttft_p50_ms": pct([r["ttft"] * 1000 for r in ok if r["ttft"] is not None], 0.5),
        "ttft_p90_ms": pct([r["ttft"] * 1000 for r in ok if r["ttft"] is not None], 0.9),
        "per_fault": [per_fault(w, records, faults) for w in faults], "ready": ready.figures()}))
    return 0


def post_json(url, body, timeout):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}


async def select(args):
    urls = gateway_urls(args.gateways)
    outcomes = []

    async def send(i):
        gateway = i % len(urls)
        # 150 tokens (a few blocks), one of 500 prompts; any worker may answer (`http_only`:
        # false), as kvroute's native workers take requests over NATS only.
        body = {"model": args.model, "http_only": False,
                "token_ids": [(i % 500 + 1) * 1_000_003 % 4_000_000 + t for t in range(150)]}
        started = time.time()
        try:
            status, answer = await asyncio.to_thread(post_json, urls[gateway] + "/v1/select", body, args.timeout)
            kind = "ok" if status == 200 else "status_%d_%s" % (status, (answer.get("error") or {}).get("code"))
        except Exception as e:  # refused, timed out
            kind = "error_" + type(e).__name__
        outcomes.append((gateway, kind, time.time() - started))

    with ReadyPoller(urls) as ready:
        await paced(args.seconds, args.rate, send)
    per = []
    for g, u in enumerate(urls):
        mine = [o for o in outcomes if o[0] == g]
        ok = [o for o in mine if o[1] == "ok"]
        failures = {}
        for _, kind, _ in mine:
            if kind != "ok":
                failures[kind] = failures.get(kind, 0) + 1
        per.append({"url": u, "sent": len(mine), "ok": len(ok),
                    "success": len(ok) / len(mine) if mine else 0.0, "failures": failures,
                    "p50_ms": pct([o[2] * 1000 for o in ok], 0.5),
                    "p99_ms": pct([o[2] * 1000 for o in ok], 0.99)})
    print(json.dumps({"sent": len(outcomes), "ok": sum(p["ok"] for p in per),
                      "min_success": min((p["success"] for p in per), default=0.0),
                      "per_gateway": per, "ready": ready.figures()}))
    return 0


DECODE_HEADER = "x-kvroute-decode-worker-id"
DOCUMENTS = ["tides and the moon", "sourdough bread", "volcanic islands", "chess endgames"]


def document(d):
    """A shared prompt prefix of a few hundred tokens (a document many requests ask about)."""
    topic = DOCUMENTS[d % len(DOCUMENTS)]
    return "".join(f"Section {s} of the notes on {topic}: the facts below are numbered and each "
                   f"one follows from the previous; read them in order before answering. "
                   for s in range(12))


def error_body_kind(body):
    """`json` when an error's body (the client's parsed body) is a JSON object, else `nonjson`."""
    return "json" if isinstance(body, dict) else "nonjson"


async def completions(args):
    import openai

    urls = gateway_urls(args.gateways)
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0,
                                  timeout=args.timeout + 5) for u in urls]
    records = []

    async def request(i, seen):
        gateway = i % len(urls)
        prompt = document(i) + f"Question {i}: what does section {i % 12} say, in a few words?"
        headers = {"x-request-id": f"gateway-probe-completion-{i}"}
        stream = i % 2 == 1
        seen["stream"] = stream
        raw = await clients[gateway].completions.with_raw_response.create(
            model=args.model, prompt=prompt, max_tokens=args.max_tokens, stream=stream,
            extra_headers=headers)
        seen["worker"] = int(raw.headers[WORKER_HEADER])
        decode = raw.headers.get(DECODE_HEADER)
        seen["decode"] = int(decode) if decode is not None else None
        answer = raw.parse()
        finish = None
        if not stream:
            finish = answer.choices[0].finish_reason if answer.choices else None
        else:
            try:
                async for chunk in answer:
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
            finally:
                await answer.close()
        return "ok" if finish else "no_finish_reason"

    async def send(i):
        seen = {"start": time.time()}
        kind, status = "ok", None
        try:
            kind = await asyncio.wait_for(request(i, seen), args.timeout)
        except asyncio.TimeoutError:
            kind = "timeout"
        except openai.APIStatusError as e:
            status = e.status_code
            kind = "status_%d_%s" % (e.status_code, error_body_kind(e.body))
            header = e.response.headers.get(WORKER_HEADER)
            if header:
                seen["worker"] = int(header)
        except openai.APIConnectionError:
            kind = "connect"
        except openai.APIError as e:
            # After the answer's headers: an error event in the stream.
            kind = "stream_error_" + error_body_kind(e.body)
        except Exception as e:  # a non-JSON event, anything else the client raises
            kind = "error_" + type(e).__name__
        records.append({"start": seen["start"], "end": time.time(), "gateway": i % len(urls),
                        "stream": seen.get("stream"), "kind": kind, "status": status,
                        "worker": seen.get("worker"), "decode": seen.get("decode")})

    with ReadyPoller(urls) as ready:
        await paced(args.seconds, args.rate, send)
    for client in clients:
        await client.close()

    if args.records:
        with open(args.records, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["start"]))
    faults = load_faults(args.faults)
    by_kind = lambda rs: {k: sum(1 for r in rs if r["kind"] == k) for k in sorted({r["kind"] for r in rs})}
    # Clean: an answer, or the gateway's JSON 5xx (an error event in JSON for a stream).
    clean = lambda r: r["kind"] == "ok" or (r["kind"].startswith(("status_5", "stream_error_"))
                                            and r["kind"].endswith("_json"))
    secs = lambda r: r["end"] - r["start"]

    def window(w):
        in_flight = [r for r in records if r["start"] <= w["start"] <= r["end"]]
        before_gone = [r for r in records if w["start"] < r["start"] <= w["end"]]
        return {"what": w["what"], "in_flight": len(in_flight), "in_flight_by_kind": by_kind(in_flight),
                "in_flight_unclean": sum(1 for r in in_flight if not clean(r)),
                "in_flight_max_s": round(max(map(secs, in_flight)), 2) if in_flight else None,
                "in_flight_prefill_on_its_workers": sum(1 for r in in_flight if r["worker"] in w["workers"]),
                "sent_before_gone": len(before_gone), "sent_before_gone_by_kind": by_kind(before_gone),
                "sent_before_gone_unclean": sum(1 for r in before_gone if not clean(r))}

    faulted = lambda r: any(r["start"] <= w["start"] <= r["end"] or w["start"] < r["start"] <= w["end"]
                            for w in faults)
    judged = [r for r in records if not faulted(r)]
    ok = [r for r in records if r["kind"] == "ok"]
    pairs = {}
    for r in ok:
        key = "%s>%s" % (r["worker"], r["decode"])
        pairs[key] = pairs.get(key, 0) + 1
    print(json.dumps({
        "sent": len(records), "ok": len(ok), "by_kind": by_kind(records),
        "judged": len(judged), "judged_ok": sum(1 for r in judged if r["kind"] == "ok"),
        "judged_failures": by_kind([r for r in judged if r["kind"] != "ok"]),
        "success": sum(1 for r in judged if r["kind"] == "ok") / len(judged) if judged else 0.0,
        "unclean": sum(1 for r in records if not clean(r)),
        "streamed_ok": sum(1 for r in ok if r["stream"]), "whole_ok": sum(1 for r in ok if not r["stream"]),
        "without_decode_worker": sum(1 for r in ok if r["decode"] is None),
        "pairs": pairs, "max_s": round(max(map(secs, records)), 2) if records else None,
        "p50_ms": pct([secs(r) * 1000 for r in ok], 0.5), "p99_ms": pct([secs(r) * 1000 for r in ok], 0.99),
        "per_fault": [window(w) for w in faults], "ready": ready.figures()}))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gateways", required=True, help="base URLs, comma-separated (http://IP:8080)")
    p.add_argument("--model", default="mock-model")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--rate", type=float, default=4)
    p.add_argument("--timeout", type=float, default=10, help="seconds a request may take")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("chat")
    c.add_argument("--conversations", type=int, default=4, help="conversations at a time")
    c.add_argument("--turns", type=int, default=5)
    c.add_argument("--max-tokens", type=int, default=8)
    c.add_argument("--faults", help="the fault windows (JSON lines), read at the end")
    sub.add_parser("select")
    m = sub.add_parser("completions")
    m.add_argument("--max-tokens", type=int, default=8)
    m.add_argument("--faults", help="the fault windows (JSON lines), read at the end")
    m.add_argument("--records", help="writes every request's record there (JSON lines)")
    args = p.parse_args()
    if args.cmd == "chat":
        return asyncio.run(chat(args))
    if args.cmd == "completions":
        return asyncio.run(completions(args))
    return asyncio.run(select(args))


if __name__ == "__main__":
    sys.exit(main())
