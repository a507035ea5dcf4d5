"""Talks to kvroute-gateway with the official `openai` client, unchanged, as an application would,
and prints what it saw as one JSON object (tests/tests/gateway_openai.rs asserts on it):
completions and chat, plain and streamed with usage; conversations whose turns each add the
assistant's answer and a new user message (the worker of every turn and the prompt blocks it
already held, from the gateway's answer headers); a session kept across two gateways (the
second `--base-url`); and the client's own error classes for a bad model and a bad key.

    python3 tests/python/gateway_client.py --base-url http://127.0.0.1:8080/v1 --model m
"""

import argparse
import json

import openai


def stream_record(stream, text_of):
    out = {"text": "", "chunks": 0, "usage": None, "finish_reasons": []}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            out["text"] += text_of(choice) or ""
            if choice.finish_reason:
                out["finish_reasons"].append(choice.finish_reason)
    return out


def placed(raw):
    """The worker and overlap of a raw response (`with_raw_response`)."""
    return {
        "worker": int(raw.headers["x-kvroute-worker-id"]),
        "overlap_blocks": int(raw.headers["x-kvroute-overlap-blocks"]),
    }


def conversations(client, model, count, turns):
    """`count` conversations of `turns` turns each, interleaved turn by turn."""
    chats = [[{"role": "system", "content": f"You are assistant number {c}. " * 4}] for c in range(count)]
    out = [[] for _ in range(count)]
    for turn in range(turns):
        for c in range(count):
            chats[c].append({"role": "user", "content": f"Conversation {c}, question {turn}: " + "tell me more. " * 6})
            raw = client.chat.completions.with_raw_response.create(model=model, messages=chats[c], max_tokens=6)
            answer = raw.parse()
            chats[c].append({"role": "assistant", "content": answer.choices[0].message.content})
            out[c].append(placed(raw))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True, action="append")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", default="unused")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    clients = [openai.OpenAI(base_url=u, api_key=args.api_key, max_retries=0, timeout=30) for u in args.base_url]
    client = clients[0]
    out = {"models": [m.id for m in client.models.list()]}

    prompt = "The gateway routes this prompt to the worker holding its prefix. " * 4
    plain = client.completions.create(model=args.model, prompt=prompt, max_tokens=5)
    out["completion"] = {"text": plain.choices[0].text, "usage": plain.usage.model_dump(),
                         "finish_reason": plain.choices[0].finish_reason}
    streamed = client.completions.create(model=args.model, prompt=prompt, max_tokens=5, stream=True,
                                         stream_options={"include_usage": True})
    out["completion_stream"] = stream_record(streamed, lambda c: c.text)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! " * 10}]
    chat = client.chat.completions.create(model=args.model, messages=messages, max_tokens=4)
    out["chat"] = {"role": chat.choices[0].message.role, "text": chat.choices[0].message.content,
                   "usage": chat.usage.model_dump(), "finish_reason": chat.choices[0].finish_reason}
    chat_streamed = client.chat.completions.create(model=args.model, messages=messages, max_tokens=4,
                                                   stream=True, stream_options={"include_usage": True})
    out["chat_stream"] = stream_record(chat_streamed, lambda c: c.delta.content)

    out["conversations"] = conversations(client, args.model, args.conversations, args.turns)

    # One session through every gateway in turn: the header keeps it on its worker.
    session = []
    for turn in range(4):
        c = clients[turn % len(clients)]
        raw = c.completions.with_raw_response.create(
            model=args.model, prompt=f"unrelated prompt number {turn} " * 5, max_tokens=2,
            extra_headers={"x-session-id": "conversation-77", "x-kvroute-policy": "round-robin"})
        raw.parse()
        session.append(placed(raw)["worker"])
    out["session_workers"] = session

    errors = {}
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        errors["unknown_model"] = {"status": e.status_code, "code": e.code}
    try:
        openai.OpenAI(base_url=args.base_url[0], api_key="wrong-key", max_retries=0).completions.create(
            model=args.model, prompt="x", max_tokens=1)
        errors["bad_key"] = {"status": 200}
    except openai.AuthenticationError as e:
        errors["bad_key"] = {"status": e.status_code, "code": e.code}
    out["errors"] = errors
    print(json.dumps(out))


if __name__ == "__main__":
    main()
