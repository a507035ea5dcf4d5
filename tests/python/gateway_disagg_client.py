"""Talks to kvroute-gateway in front of a disaggregated fleet (prefill and decode workers) with
the official `openai` client, unchanged, and prints what it saw as one JSON object
(tests/tests/gateway_disagg.rs asserts on it): completions and chat, plain and streamed with
usage, each with the prefill and decode workers the gateway's answer headers name; and a
conversation whose turns each find the earlier turns cached on their prefill worker.

    python3 tests/python/gateway_disagg_client.py --base-url http://127.0.0.1:8080/v1 --model m
"""

import argparse
import json

import openai

from gateway_client import stream_record


def hops(raw):
    """The prefill and decode workers of a raw response (`with_raw_response`)."""
    decode = raw.headers.get("x-kvroute-decode-worker-id")
    return {
        "prefill": int(raw.headers["x-kvroute-worker-id"]),
        "decode": int(decode) if decode is not None else None,
        "overlap_blocks": int(raw.headers["x-kvroute-overlap-blocks"]),
    }


def streamed(raw, text_of):
    out = stream_record(raw.parse(), text_of)
    out.update(hops(raw))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=30)
    m = args.model
    prompt = "The prefill worker computes this prompt and the decode worker streams the answer. " * 3
    seen = {}

    raw = client.completions.with_raw_response.create(model=m, prompt=prompt, max_tokens=7)
    c = raw.parse()
    seen["completion"] = {"usage": c.usage.model_dump(), "finish_reason": c.choices[0].finish_reason,
                          "text": c.choices[0].text, **hops(raw)}

    raw = client.completions.with_raw_response.create(
        model=m, prompt=prompt + "Streamed.", max_tokens=7, stream=True,
        stream_options={"include_usage": True})
    seen["completion_stream"] = streamed(raw, lambda ch: ch.text)

    messages = [{"role": "user", "content": "Say something long enough to split. " * 4}]
    raw = client.chat.completions.with_raw_response.create(model=m, messages=messages, max_tokens=5)
    chat = raw.parse()
    seen["chat"] = {"usage": chat.usage.model_dump(), "role": chat.choices[0].message.role, **hops(raw)}

    raw = client.chat.completions.with_raw_response.create(
        model=m, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True})
    seen["chat_stream"] = streamed(raw, lambda ch: ch.delta.content)

    # A conversation: every turn adds the answer and a new question.
    turns = []
    chat = [{"role": "system", "content": "You are a patient assistant. " * 4}]
    for t in range(args.turns):
        chat.append({"role": "user", "content": f"Question {t}: " + "tell me more. " * 6})
        raw = client.chat.completions.with_raw_response.create(model=m, messages=chat, max_tokens=6)
        answer = raw.parse()
        chat.append({"role": "assistant", "content": answer.choices[0].message.content})
        turns.append(hops(raw))
    seen["conversation"] = turns
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
