"""Splicing a greedy stream resumed on another replica (octavo/ray_serve/resume.py), without Ray."""

from __future__ import annotations

import json

import pytest

from octavo.ray_serve.resume import ResumeMismatch, StreamSplicer, is_resumable


def sse(ident: str, text: str | None, finish: str | None = None, chat: bool = False, usage: dict | None = None) -> bytes:
    if usage is not None:
        return f"data: {json.dumps({'id': ident, 'created': 1, 'choices': [], 'usage': usage})}\n\n".encode()
    choice = {"index": 0, "finish_reason": finish}
    choice |= {"delta": {"content": text}} if chat else {"text": text}
    return f"data: {json.dumps({'id': ident, 'created': 1 if ident == 'a' else 2, 'choices': [choice]})}\n\n".encode()


def texts(out: bytes) -> list[tuple[str, str, str | None]]:
    rows = []
    for raw in out.split(b"\n\n"):
        if raw.startswith(b"data: {"):
            d = json.loads(raw[6:])
            c = d["choices"][0] if d["choices"] else {}
            rows.append((d["id"], c.get("text", (c.get("delta") or {}).get("content")), c.get("finish_reason")))
        elif raw:
            rows.append((raw.decode(), "", None))
    return rows


@pytest.mark.parametrize("chat", [False, True])
def test_the_second_stream_goes_on_where_the_client_stopped(chat):
    s = StreamSplicer()
    first = sse("a", "Hel", chat=chat) + sse("a", "lo", chat=chat) + sse("a", " wor", chat=chat)
    out = s.take(first[:-5]) + s.take(first[-5:] + b'data: {"id": "a", "cho')  # a partial event, then the death
    assert texts(out) == [("a", "Hel", None), ("a", "lo", None), ("a", " wor", None)] and s.delivered == "Hello wor"
    s.restart()
    second = (sse("b", "", chat=chat) + sse("b", "Hel", chat=chat) + sse("b", "lo w", chat=chat)
              + sse("b", "orld", chat=chat) + sse("b", "!", "length", chat=chat)
              + sse("b", None, usage={"completion_tokens": 5}) + b"data: [DONE]\n\n")
    rows = texts(b"".join(s.take(second[i:i + 7]) for i in range(0, len(second), 7)))  # any chunking
    assert rows == [("a", "ld", None), ("a", "!", "length"), ("a", None, None), ("data: [DONE]", "", None)]
    assert s.delivered == "Hello world!"


def test_a_second_stream_with_other_text_is_refused():
    s = StreamSplicer()
    s.take(sse("a", "Hello"))
    s.restart()
    with pytest.raises(ResumeMismatch):
        s.take(sse("b", "Help!"))


def test_only_greedy_single_streams_are_resumed():
    base = {"stream": True, "temperature": 0, "prompt": "x"}
    assert is_resumable("/v1/completions", base) and is_resumable("v1/chat/completions", base)
    for bad in ({"temperature": 0.7}, {"n": 2}, {"stream": False}, {"logprobs": 2}, {"tools": [{}]}, {"echo": True}):
        assert not is_resumable("/v1/completions", base | bad), bad
    assert not is_resumable("/v1/responses", base) and not is_resumable("/v1/completions", "x")
