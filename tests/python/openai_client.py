"""Talks to a kvroute-mocker engine face with the real `openai` client, the way an application
would, and prints what it saw as one JSON object (tests/tests/mocker_engine_http.rs asserts on
it): the same prompt twice through /v1/completions (plain, then streamed with usage), and a
chat twice (streamed with usage, then plain). Streams record each chunk's arrival time.

    python3 tests/python/openai_client.py --base-url http://127.0.0.1:8000/v1 --model mock-model
"""

import argparse
import json
import sys
import time

import openai


def stream_record(stream, text_of):
    """Chunks of a stream: their texts, finish reasons, arrival times (s) and the usage."""
    start = time.monotonic()
    out = {"texts": [], "finish_reasons": [], "times": [], "usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            out["texts"].append(text_of(choice))
            out["finish_reasons"].append(choice.finish_reason)
            out["times"].append(time.monotonic() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=30)
    prompt = "The engine face answers with filler tokens. " * 3
    models = client.models.list()

    plain = client.completions.create(
        model=args.model, prompt=prompt, max_tokens=args.max_tokens,
        extra_body={"ignore_eos": True},
    )
    streamed = client.completions.create(
        model=args.model, prompt=prompt, max_tokens=args.max_tokens, stream=True,
        stream_options={"include_usage": True},
    )
    streamed = stream_record(streamed, lambda c: c.text)

    messages = [
        {"role": "system", "content": "You are a simulated engine."},
        {"role": "user", "content": "Say something " * 8},
    ]
    chat_streamed = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, stream=True,
        stream_options={"include_usage": True},
    )
    chat_streamed = stream_record(chat_streamed, lambda c: c.delta.content)
    chat_plain = client.chat.completions.create(
        model=args.model, messages=messages, max_completion_tokens=args.max_tokens,
    )
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        missing = None
    except openai.NotFoundError as e:
        missing = e.status_code

    json.dump(
        {
            "models": [m.id for m in models.data],
            "completion": {
                "text": plain.choices[0].text,
                "finish_reason": plain.choices[0].finish_reason,
                "usage": plain.usage.model_dump(),
            },
            "completion_stream": streamed,
            "chat_stream": chat_streamed,
            "chat": {
                "role": chat_plain.choices[0].message.role,
                "text": chat_plain.choices[0].message.content,
                "finish_reason": chat_plain.choices[0].finish_reason,
                "usage": chat_plain.usage.model_dump(),
            },
            "missing_model_status": missing,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
