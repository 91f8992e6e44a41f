"""Resuming a greedy stream on another replica after the first one died mid-answer.

A greedy completion (temperature 0, one choice) is the same text on every replica: Octavo's greedy
output does not depend on batching, caching or preemption (the oracle tests hold it to that). So
when a replica dies mid-stream, the ingress asks another for the same request and this class
splices the second stream onto what the client already has: events are passed on whole (never a
partial one), the text already delivered is skipped, the event that goes past it is cut to the
new part, and every later event carries the first stream's id and created time. If the second
stream's text does not start with what was delivered, `ResumeMismatch` (the ingress then ends
the stream with an error event). Pure Python.
"""

from __future__ import annotations

import json
from typing import Any


class ResumeMismatch(Exception):
    pass


def is_resumable(path: str, body: Any) -> bool:
    """Streamed, greedy, one choice, and nothing whose events carry more than text."""
    if path.strip("/") not in ("v1/completions", "v1/chat/completions") or not isinstance(body, dict):
        return False
    return (body.get("stream") is True and body.get("temperature") in (0, 0.0) and body.get("n", 1) == 1
            and not body.get("tools") and not body.get("logprobs") and not body.get("top_logprobs")
            and not body.get("echo") and not body.get("best_of"))


def _text(choice: dict) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _set_text(choice: dict, text: str) -> None:
    if "delta" in choice:
        choice.setdefault("delta", {})["content"] = text
    else:
        choice["text"] = text


class StreamSplicer:
    """Feed it the replicas' bytes (`take`); it returns the complete SSE events to send on.
    `restart()` when a new replica's stream begins."""

    def __init__(self) -> None:
        self._buffer = b""
        self.delivered = ""  # text the client has
        self._ident: tuple[Any, Any] | None = None  # (id, created) of the first stream
        self._resuming = False
        self._restarted = False  # events from now carry the first stream's id and created time
        self._new_text = ""  # the new stream's text so far, while it catches up

    def restart(self) -> None:
        self._buffer = b""  # a partial event of the dead stream was never sent
        self._resuming = self._restarted = True
        self._new_text = ""

    def take(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for raw in events:
            event = self._event(raw)
            if event is not None:
                out.append(event + b"\n\n")
        return b"".join(out)

    def _event(self, raw: bytes) -> bytes | None:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return raw
        try:
            data = json.loads(line[6:])
        except ValueError:
            return raw
        choices = data.get("choices") or []
        text = _text(choices[0]) if choices else ""
        if self._ident is None and "id" in data:
            self._ident = (data.get("id"), data.get("created"))
        if self._restarted and self._ident is not None and "id" in data:
            data["id"], data["created"] = self._ident
        if not self._resuming:
            self.delivered += text
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() if self._restarted else raw
        before = len(self._new_text)
        self._new_text += text
        common = min(len(self._new_text), len(self.delivered))
        if self._new_text[:common] != self.delivered[:common]:
            raise ResumeMismatch("the new replica's text differs from what was sent")
        if len(self._new_text) <= len(self.delivered):
            finished = bool(choices and choices[0].get("finish_reason")) or data.get("usage")
            if not finished:
                return None  # the client has this part already
            if choices:
                _set_text(choices[0], "")
        else:
            new = self._new_text[max(before, len(self.delivered)):]
            if choices:
                _set_text(choices[0], new)
            self.delivered = self._new_text
            self._resuming = False  # caught up: from here the stream is passed on as it comes
        return b"data: " + json.dumps(data, separators=(",", ":")).encode()
