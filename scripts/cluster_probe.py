#!/usr/bin/env python3
"""Measurements for scripts/fault-test, against a running kvroute cluster (PROTOCOL.md only:
MessagePack over NATS, and the indexers' HTTP /status). Every subcommand prints one JSON
object on stdout.

  sessions  --out F | --expect F   bind sessions (one selection each), or check they kept
                                   the worker recorded in F; --router ID sends each to that
                                   router's direct subject (no retry)
  departure --workers 1,2 --since T   seconds from T (Unix time) until the routers answer
                                   `pinned_unavailable` for each worker
  arrival   --workers 1,2 --since T   seconds from T until the routers select each worker
                                   again (a selection pinned to it succeeds)
  indexers  --status URL,URL       poll the replicas' /status until they report the same
                                   applied_seq; compare the digests there
  replay    --report F             selection success from kvroute-replay's JSON report
  steady    --seconds S --rate R   selections at a steady rate through the retrying client
                                   (examples/python): success, retries, latency
  metric    --url U --name N       sum of a Prometheus series (all label sets) at a /metrics URL
  loadviews --status URL,URL       poll two routers' /status together until their load views
                                   agree (same ranks, active requests within --tolerance) for
                                   --window samples in a row; the median difference
  stream    [--max-bytes N]        the events stream's state (first/last seq, bytes, max_bytes);
                                   with --max-bytes, sets its byte limit first (a stream update)
  leadership --logs NAME=F,...     the snapshot leaders' terms from the indexers' `docker logs -t`:
                                   each replica's leadership intervals and the snapshots and
                                   worker removals it wrote, and whether any two overlap

Selections go through examples/python/kvroute_client.py's SelectClient: the same request id
on every attempt, per-attempt deadlines, a retry to the router that answered last.
"""
import argparse
import asyncio
import json
import os
import re
import sys
import threading
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "python"))
import kvroute_client  # noqa: E402


def nats_servers(urls):
    return [u.strip() for u in urls.split(",") if u.strip()]


async def connect(urls):
    import nats

    # As the identity in KVROUTE_NATS_* (a secured cluster's operator env file), if any.
    return await nats.connect(servers=nats_servers(urls), connect_timeout=5,
                              max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                              **kvroute_client.nats_identity())


def session_prompt(i):
    # A prompt of its own per session (2 blocks of 64 tokens and a bit).
    return [(i + 1) * 1_000_003 % 4_000_000 + t for t in range(150)]


async def select_retrying(client, request):
    """One selection through the retrying client; no answer at all becomes an error reply."""
    try:
        reply, _attempts = await client.select({"v": 1, **request})
        return reply
    except kvroute_client.NoAnswer as e:
        return {"status": "error", "code": "no_answer", "message": str(e)}


async def select_direct(nc, namespace, router_id, request, timeout=2.0):
    """One selection on a router's direct subject (`kvroute.<ns>.router.<id>.select`)."""
    import msgpack
    import nats.errors

    request = {"v": 1, "request_id": str(uuid.uuid4()), "attempt": 0,
               "deadline_ms": int(time.time() * 1000 + timeout * 1000), **request}
    try:
        msg = await nc.request("kvroute.%s.router.%s.select" % (namespace, router_id),
                               msgpack.packb(request, use_bin_type=True), timeout=timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
        return {"status": "error", "code": "no_answer", "message": type(e).__name__}
    return msgpack.unpackb(msg.data, raw=False)


async def sessions(args):
    nc = await connect(args.nats)
    client = kvroute_client.SelectClient(nc, args.namespace)
    expected = json.load(open(args.expect)) if args.expect else None
    bound, errors, kept, moved = {}, {}, 0, {}
    routers = set()
    for i in range(args.count):
        sid = "%s-%d" % (args.prefix, i)
        request = {"model": args.model, "token_ids": session_prompt(i),
                   "session": {"id": sid, "final": False, "trigger": "user_message"}}
        if args.router:
            reply = await select_direct(nc, args.namespace, args.router, request)
        else:
            reply = await select_retrying(client, request)
        if reply.get("status") != "ok":
            errors[sid] = reply.get("code")
            continue
        routers.add(reply.get("router_id"))
        bound[sid] = reply["worker_id"]
        if expected is not None and sid in expected:
            if expected[sid] == reply["worker_id"] and reply.get("binding") == "kept":
                kept += 1
            else:
                moved[sid] = {"before": expected[sid], "after": reply["worker_id"],
                              "binding": reply.get("binding")}
    await nc.close()
    if args.out:
        json.dump(bound, open(args.out, "w"))
    out = {"sessions": args.count, "answered": len(bound), "errors": errors,
           "routers": sorted(r for r in routers if r)}
    if expected is not None:
        out.update({"kept": kept, "moved": moved})
    print(json.dumps(out))
    ok = not errors and (expected is None or kept == len(expected))
    return 0 if ok else 1


async def departure(args):
    nc = await connect(args.nats)
    client = kvroute_client.SelectClient(nc, args.namespace)
    pending = {int(w) for w in args.workers.split(",") if w}
    gone, last = {}, {}
    deadline = args.since + args.timeout
    while pending and time.time() < deadline:
        for w in sorted(pending):
            reply = await select_retrying(client, {
                "model": args.model, "token_ids": session_prompt(w % 1000),
                "pin": {"worker_id": w}})
            last[w] = reply.get("code") or reply.get("status")
            if reply.get("code") == "pinned_unavailable":
                gone[w] = round(time.time() - args.since, 2)
                pending.discard(w)
        await asyncio.sleep(0.1)
    await nc.close()
    print(json.dumps({"gone_after_s": gone, "still_routed": sorted(pending),
                      "last_answer": {str(k): v for k, v in last.items()},
                      "max_s": max(gone.values()) if gone and not pending else None}))
    return 0 if not pending else 1


async def arrival(args):
    nc = await connect(args.nats)
    client = kvroute_client.SelectClient(nc, args.namespace)
    pending = {int(w) for w in args.workers.split(",") if w}
    back, last = {}, {}
    deadline = args.since + args.timeout
    while pending and time.time() < deadline:
        for w in sorted(pending):
            reply = await select_retrying(client, {
                "model": args.model, "token_ids": session_prompt(w % 1000),
                "pin": {"worker_id": w}})
            last[w] = reply.get("code") or reply.get("status")
            if reply.get("status") == "ok" and reply.get("worker_id") == w:
                back[w] = round(time.time() - args.since, 2)
                pending.discard(w)
        await asyncio.sleep(0.1)
    await nc.close()
    print(json.dumps({"back_after_s": back, "still_unroutable": sorted(pending),
                      "last_answer": {str(k): v for k, v in last.items()},
                      "max_s": max(back.values()) if back and not pending else None}))
    return 0 if not pending else 1


def get_status(url):
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


def indexers(args):
    """Each replica's history of (applied_seq -> digest), polled concurrently; under traffic
    the replicas rarely stop at the same sequence at the same moment, so compare them at every
    sequence both were seen at."""
    urls = [u for u in args.status.split(",") if u]
    history = [dict() for _ in urls]
    errors = [0 for _ in urls]
    lock = threading.Lock()
    stop = threading.Event()

    def poll(i, url):
        while not stop.is_set():
            try:
                s = get_status(url)
                with lock:
                    seen = history[i].get(s["applied_seq"])
                    ready = bool(s.get("ready")) or bool(seen and seen[1])
                    history[i][s["applied_seq"]] = (s["digest"] if seen is None else seen[0], ready)
            except Exception:
                errors[i] += 1
                time.sleep(0.2)
            time.sleep(args.interval)

    threads = [threading.Thread(target=poll, args=(i, u), daemon=True) for i, u in enumerate(urls)]
    start = time.time()
    for t in threads:
        t.start()
    result = None
    while time.time() - start < args.timeout:
        time.sleep(0.05)
        with lock:
            common = set(history[0]).intersection(*history[1:])
            agreed = [s for s in common if len({h[s][0] for h in history}) == 1
                      and all(h[s][1] for h in history)]
            differ = [s for s in common if len({h[s][0] for h in history}) > 1]
            if differ:
                result = {"ok": False, "seq": differ[0],
                          "digests": [str(h[differ[0]][0]) for h in history]}
                break
            if agreed:
                seq = max(agreed)
                # /status gives u64 digests as "0x..." strings (jq reads numbers as doubles).
                result = {"ok": True, "seq": seq, "digest": str(history[0][seq][0])}
                break
    stop.set()
    if result is None:
        result = {"ok": False, "seq": None,
                  "last": [max(h) if h else None for h in history], "http_errors": errors}
    result["after_s"] = round(time.time() - start, 2)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def replay(args):
    report = json.load(open(args.report))
    total = completed = select_errors = worker_errors = 0
    kinds = {}
    for mode in report["modes"]:
        completed += mode["completed"]
        total += mode["completed"] + mode["errors"]
        for kind, n in mode["errors_by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + n
            if kind.startswith("select_"):
                select_errors += n
            else:
                worker_errors += n
    # Requests whose selection succeeded but whose worker failed them (killed, or unreachable
    # while its lease ran out) do not count against selection.
    attempted = total - worker_errors
    success = (attempted - select_errors) / attempted if attempted else 0.0
    print(json.dumps({"requests": total, "completed": completed,
                      "select_errors": select_errors, "worker_errors": worker_errors,
                      "errors_by_kind": kinds, "selection_success": success}))
    return 0


async def steady(args):
    """args.rate selections a second for args.seconds, each on its own task; one JSON line."""
    nc = await connect(args.nats)
    client = kvroute_client.SelectClient(nc, args.namespace)
    outcomes = []

    async def one(i):
        started = time.time()
        try:
            reply, attempts = await client.select({"v": 1, "model": args.model,
                                                   "token_ids": session_prompt(i % 500)})
            kind = "ok" if reply.get("status") == "ok" else reply.get("code")
        except kvroute_client.NoAnswer:
            kind, attempts = "no_answer", client.attempts
        outcomes.append((kind, attempts, time.time() - started))

    tasks = []
    start = time.time()
    for i in range(int(args.seconds * args.rate)):
        delay = start + i / args.rate - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    await nc.close()
    ok = [o for o in outcomes if o[0] == "ok"]
    latencies = sorted(o[2] * 1000 for o in outcomes)
    failures = {}
    for kind, _, _ in outcomes:
        if kind != "ok":
            failures[kind] = failures.get(kind, 0) + 1
    pct = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) if latencies else None
    print(json.dumps({"sent": len(outcomes), "ok": len(ok),
                      "success": len(ok) / len(outcomes) if outcomes else 0.0,
                      "retried": sum(1 for o in outcomes if o[1] > 1),
                      "failures": failures, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
                      "max_ms": round(latencies[-1], 1) if latencies else None}))
    return 0


def metric(args):
    """The sum of every sample of series args.name at args.url (0 when absent)."""
    with urllib.request.urlopen(args.url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name == args.name:
            total += float(line.rsplit(" ", 1)[1])
    print(json.dumps({"name": args.name, "value": total}))
    return 0


def fetch_both(urls):
    """Each URL's /status JSON, fetched at the same moment (one thread each)."""
    out = [None] * len(urls)

    def get(i):
        try:
            out[i] = get_status(urls[i])
        except Exception:
            out[i] = None

    threads = [threading.Thread(target=get, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def load_diff(a, b):
    """(same ranks?, sum over ranks of |active_requests difference|, each side's total)."""
    def ranks(s):
        return {(r["worker_id"], r["dp_rank"]): r.get("active_requests", 0) for r in s["load"]}
    ra, rb = ranks(a), ranks(b)
    diff = sum(abs(ra.get(k, 0) - rb.get(k, 0)) for k in set(ra) | set(rb))
    return set(ra) == set(rb), diff, sum(ra.values()), sum(rb.values())


def loadviews(args):
    """Samples two routers' load views (their /status `load`) together every --interval s.
    Done when --window samples in a row have the same ranks and a summed |active requests|
    difference <= --tolerance; prints the median difference of the samples taken."""
    urls = [u for u in args.status.split(",") if u]
    start = time.time()
    diffs, streak, result = [], 0, None
    totals, last = None, None
    while time.time() - start < args.timeout:
        a, b = fetch_both(urls)
        if a is not None and b is not None:
            same, diff, ta, tb = load_diff(a, b)
            diffs.append(diff)
            totals, last = (ta, tb), {"same_ranks": same, "ranks": [len(a["load"]), len(b["load"])]}
            streak = streak + 1 if same and diff <= args.tolerance else 0
            if streak >= args.window:
                result = True
                break
        else:
            streak = 0
        time.sleep(args.interval)
    diffs_sorted = sorted(diffs)
    out = {"ok": bool(result), "after_s": round(time.time() - start, 2), "samples": len(diffs),
           "median_diff": diffs_sorted[len(diffs) // 2] if diffs else None,
           "max_diff": diffs_sorted[-1] if diffs else None,
           "last_totals": totals, "last": last, "tolerance": args.tolerance}
    print(json.dumps(out))
    return 0 if result else 1


async def stream(args):
    """The events stream's state; with --max-bytes, its byte limit is set first."""
    nc = await connect(args.nats)
    js = nc.jetstream()
    name = "KVROUTE_%s_EVENTS" % args.namespace
    info = await js.stream_info(name)
    if args.max_bytes is not None:
        config = info.config
        config.max_bytes = args.max_bytes
        await js.update_stream(config)
        info = await js.stream_info(name)
    await nc.close()
    print(json.dumps({"stream": name, "first_seq": info.state.first_seq,
                      "last_seq": info.state.last_seq, "messages": info.state.messages,
                      "bytes": info.state.bytes, "max_bytes": info.config.max_bytes}))
    return 0


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z? ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_time(line):
    """Unix time of a `docker logs -t` line (its first field, nanoseconds cut to micro)."""
    m = LOG_TIME.match(line)
    if not m:
        return None
    stamp = m.group(1)
    if "." in stamp:
        head, frac = stamp.split(".")
        stamp = head + "." + frac[:6]
        fmt = "%Y-%m-%dT%H:%M:%S.%f"
    else:
        fmt = "%Y-%m-%dT%H:%M:%S"
    import calendar
    import datetime
    t = datetime.datetime.strptime(stamp, fmt)
    return calendar.timegm(t.timetuple()) + t.microsecond / 1e6


def field(line, name):
    m = re.search(r"\b%s=\"?([^\s\"]+)" % re.escape(name), line)
    return m.group(1) if m else None


def leadership(args):
    """Leadership intervals and leader writes per replica, from each indexer's
    `docker logs -t`. A replica leads from "became snapshot leader" until it logs losing or
    giving up leadership ("lost snapshot leadership", "stepped down") or its log ends (the
    container was killed: its end is its last line before the next start-up, "indexer http
    listening", or the log's last line). Writes are "snapshot written" and
    "removing a worker with no registration". Overlap: a replica writing, or leading, while
    another replica's term had begun after its own; terms still believed open while another
    began are reported as belief_overlaps, not judged."""
    replicas = {}
    for spec in args.logs.split(","):
        name, path = spec.split("=", 1)
        intervals, writes, last_t, open_since, open_term, terms = [], [], None, None, None, []
        for raw in open(path, errors="replace"):
            line = ANSI.sub("", raw.rstrip("\n"))
            t = log_time(line)
            if t is None:
                continue
            prev_t, last_t = last_t, t
            if "indexer http listening" in line and open_since is not None:
                # A new process in the same container: the old one died leading (a kill).
                intervals.append([open_since, prev_t, "process ended", open_term])
                open_since = None
            if "became snapshot leader" in line:
                if open_since is not None:
                    intervals.append([open_since, t, "again", open_term])
                open_since, open_term = t, field(line, "term")
                terms.append(open_term)
            elif ("lost snapshot leadership" in line or "stepped down" in line) and open_since is not None:
                intervals.append([open_since, t, "stepped down", open_term])
                open_since = None
            elif "snapshot written" in line or "removing a worker with no registration" in line:
                writes.append([t, "snapshot" if "snapshot" in line else "removal",
                               field(line, "seq") or field(line, "worker_id"), field(line, "term")])
        if open_since is not None:
            intervals.append([open_since, None, "leading at the end", open_term])
        replicas[name] = {"intervals": intervals, "writes": writes, "terms": terms,
                          "log_end": last_t}
    # Beliefs: a replica's term still open when another's began (a frozen or cut-off leader
    # that has not noticed yet); reported, not judged: only writes can conflict.
    beliefs, conflicts = [], []
    names = sorted(replicas)
    for a in names:
        for b in names:
            if a == b:
                continue
            for (s1, e1, _, _) in replicas[a]["intervals"]:
                end1 = e1 if e1 is not None else replicas[a]["log_end"]
                for (s2, e2, _, _) in replicas[b]["intervals"]:
                    if end1 is not None and s1 <= s2 < end1:
                        beliefs.append({"earlier": a, "later": b, "overlap_s": round(end1 - s2, 3)})
            # A write by a conflicts when a did not lead then, or when b's term had begun after
            # a's (a newer leader existed).
            for (t, kind, what, term) in replicas[a]["writes"]:
                own = [(s, k) for (s, e, _, k) in replicas[a]["intervals"] if s <= t and (e is None or t <= e)]
                newer = own and any(max(own)[0] < s <= t and (e is None or t <= e)
                                    for (s, e, _, _) in replicas[b]["intervals"])
                # With terms in the log, a write names the term it was made in: its writer's.
                wrong_term = own and term is not None and max(own)[1] is not None and term != max(own)[1]
                if not own or newer or wrong_term:
                    conflicts.append({"writer": a, "kind": kind, "at": round(t - (args.since or 0), 3),
                                      "what": what, "term": term,
                                      "why": "not leading" if not own else
                                      ("a newer leader: " + b if newer else "term %s while leading in %s" % (term, max(own)[1]))})
    # A write outside any own term is counted once per other replica; keep one.
    seen, overlaps = set(), []
    for c in conflicts:
        k = (c["writer"], c["at"], c["what"])
        if k not in seen:
            seen.add(k)
            overlaps.append(c)
    # With terms in the log: every new term is greater than every earlier one, in time order.
    began = sorted((s, n, k) for n, r in replicas.items() for (s, _, _, k) in r["intervals"])
    if began and all(k is not None for (_, _, k) in began):
        for (t1, n1, k1), (t2, n2, k2) in zip(began, began[1:]):
            # A replica that stepped down on its lease deadline (no keep-alive answered in
            # time) and then got a late answer acts again in the same term: its lease, the
            # leader key's, never expired, and a new leader would hold a newer key (a larger
            # term). Only another replica's term, or an older one, in between is a conflict.
            if n1 == n2 and k1 == k2:
                continue
            if int(k2) <= int(k1):
                overlaps.append({"why": "term %s of %s began after term %s of %s" % (k2, n2, k1, n1),
                                 "at": round(t2 - (args.since or 0), 3)})
    since = args.since or 0
    out = {"replicas": {n: {"intervals": [[round(s - since, 2), (round(e - since, 2) if e else None), why, k]
                                          for (s, e, why, k) in r["intervals"]],
                            "writes": len(r["writes"]),
                            "writes_after_since": [[round(t - since, 2), k, w, term] for (t, k, w, term) in r["writes"] if t >= since],
                            "terms": [x for x in r["terms"] if x]}
                        for n, r in replicas.items()},
           "overlaps": overlaps, "belief_overlaps": beliefs, "ok": not overlaps}
    print(json.dumps(out))
    return 0 if not overlaps else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nats", default="nats://127.0.0.1:4222")
    p.add_argument("--namespace", default="default")
    p.add_argument("--model", default="mock-model")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sessions")
    s.add_argument("--count", type=int, default=20)
    s.add_argument("--prefix", default="fault-test")
    s.add_argument("--out")
    s.add_argument("--expect")
    s.add_argument("--router", help="a router id: send to its direct subject")
    d = sub.add_parser("departure")
    d.add_argument("--workers", required=True)
    d.add_argument("--since", type=float, required=True)
    d.add_argument("--timeout", type=float, default=30)
    a = sub.add_parser("arrival")
    a.add_argument("--workers", required=True)
    a.add_argument("--since", type=float, required=True)
    a.add_argument("--timeout", type=float, default=30)
    i = sub.add_parser("indexers")
    i.add_argument("--status", required=True)
    i.add_argument("--timeout", type=float, default=60)
    i.add_argument("--interval", type=float, default=0.02)
    r = sub.add_parser("replay")
    r.add_argument("--report", required=True)
    st = sub.add_parser("steady")
    st.add_argument("--seconds", type=float, required=True)
    st.add_argument("--rate", type=float, default=10)
    m = sub.add_parser("metric")
    m.add_argument("--url", required=True)
    m.add_argument("--name", required=True)
    lv = sub.add_parser("loadviews")
    lv.add_argument("--status", required=True)
    lv.add_argument("--timeout", type=float, default=20)
    lv.add_argument("--tolerance", type=int, default=2)
    lv.add_argument("--window", type=int, default=5)
    lv.add_argument("--interval", type=float, default=0.2)
    sm = sub.add_parser("stream")
    sm.add_argument("--max-bytes", type=int)
    ld = sub.add_parser("leadership")
    ld.add_argument("--logs", required=True)
    ld.add_argument("--since", type=float)
    args = p.parse_args()
    if args.cmd == "sessions":
        return asyncio.run(sessions(args))
    if args.cmd == "departure":
        return asyncio.run(departure(args))
    if args.cmd == "arrival":
        return asyncio.run(arrival(args))
    if args.cmd == "indexers":
        return indexers(args)
    if args.cmd == "steady":
        return asyncio.run(steady(args))
    if args.cmd == "metric":
        return metric(args)
    if args.cmd == "loadviews":
        return loadviews(args)
    if args.cmd == "stream":
        return asyncio.run(stream(args))
    if args.cmd == "leadership":
        return leadership(args)
    return replay(args)


if __name__ == "__main__":
    sys.exit(main())
