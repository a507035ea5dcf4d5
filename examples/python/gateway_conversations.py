#!/usr/bin/env python3
"""Conversations through kvroute-gateway with the official `openai` client, unchanged: N
conversations of T turns, each turn sending the whole chat so far (the assistant's previous
answers and a new user message), streamed. The conversations take their turns together, round
by round, so each round's requests compete for the workers. The gateway's answer headers say
where each turn went (`x-kvroute-worker-id`) and how many of its prompt's blocks that worker
already held (`x-kvroute-overlap-blocks`); the engine's usage, where it reports them, the prompt
tokens it found cached; the client measures the time to the first token. In front of a
disaggregated fleet the worker is the prefill worker, and `x-kvroute-decode-worker-id` names
the decode worker that streamed the answer (printed as `w201/w301`).

    python3 examples/python/gateway_conversations.py --base-url http://127.0.0.1:8080/v1 --model chat-demo

Prints one line per conversation (the worker of each turn and the blocks it held), how many
later turns stayed on their conversation's worker (the worker of its first turn), and TTFT
percentiles; `--json` prints the same as one JSON object. Needs the `openai` package
(scripts/install-deps installs it). Exit status 1 when a request fails.
"""
import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai


def turn(client, model, messages, max_tokens):
    """One streamed turn: its answer, worker, overlap, TTFT (s) and prompt tokens."""
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True})
    decode = raw.headers.get("x-kvroute-decode-worker-id")
    out = {"worker": int(raw.headers["x-kvroute-worker-id"]),
           "decode_worker": int(decode) if decode is not None else None,
           "overlap_blocks": int(raw.headers["x-kvroute-overlap-blocks"]),
           "ttft_s": None, "prompt_tokens": None, "cached_tokens": None}
    text = ""
    for chunk in raw.parse():
        if chunk.usage is not None:
            out["prompt_tokens"] = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            if details is not None and details.cached_tokens is not None:
                out["cached_tokens"] = details.cached_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.monotonic() - started
                text += choice.delta.content
    return text, out


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=30)

    topics = ["the tides", "bread", "volcanoes", "chess openings", "jazz", "glaciers",
              "bees", "lighthouses", "paper", "comets"]
    chats = [[{"role": "system",
               "content": f"You are a patient tutor. This conversation is about {topics[c % len(topics)]}; "
                          "answer in two or three plain sentences and keep to the topic."}]
             for c in range(args.conversations)]
    turns = [[] for _ in range(args.conversations)]

    def step(c, t):
        chats[c].append({"role": "user",
                         "content": f"Question {t + 1} about {topics[c % len(topics)]}: "
                                    "what should a beginner know next, and why does it matter?"})
        text, placed = turn(client, args.model, chats[c], args.max_tokens)
        chats[c].append({"role": "assistant", "content": text})
        return placed

    try:
        with ThreadPoolExecutor(max_workers=max(1, args.conversations)) as pool:
            for t in range(args.turns):
                for c, placed in enumerate(pool.map(lambda c: step(c, t), range(args.conversations))):
                    turns[c].append(placed)
    except openai.APIError as e:
        print(f"gateway_conversations: error: {e}", file=sys.stderr)
        return 1

    later = [(c, t) for c in range(args.conversations) for t in range(1, args.turns)]
    stayed = sum(1 for c, t in later if turns[c][t]["worker"] == turns[c][0]["worker"])
    ttfts = [x["ttft_s"] * 1000 for conv in turns for x in conv if x["ttft_s"] is not None]
    summary = {"conversations": turns, "later_turns": len(later), "stayed": stayed,
               "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p90_ms": percentile(ttfts, 0.9)}
    if args.json:
        print(json.dumps(summary))
        return 0
    for c, conv in enumerate(turns):
        steps = " → ".join(
            f"w{x['worker']}" + ("" if x["decode_worker"] is None else f"/w{x['decode_worker']}")
            + f" ({x['overlap_blocks']}"
            + ("" if x["cached_tokens"] is None else f", {x['cached_tokens']} cached")
            + ")" for x in conv)
        print(f"  conversation {c + 1}: {steps}")
    split = any(x["decode_worker"] is not None for conv in turns for x in conv)
    print("  (each turn: the worker" + (" (prefill/decode)" if split else "")
          + ", and in brackets the prompt blocks it already held as the router saw them, then the"
          " prompt tokens the engine itself reported cached"
          + (": the decode worker's, the KV it pulled included)" if split else ")"))
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"
    print(f"  {stayed}/{len(later)} later turns stayed on their conversation's worker; "
          f"TTFT (client side) p50 {ms(summary['ttft_p50_ms'])}, p90 {ms(summary['ttft_p90_ms'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
