"""An assistant turn as its parts: reasoning first, then the answer's text and tool calls; the
reasoning parser reads the output, the tool-call parser reads only the answer after it."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.server.parsers.reasoning import ReasoningFormat, ReasoningStream
from octavo.server.parsers.tool_calls import CallFormat, CallStream, ParsedCall, Schemas


@dataclass(slots=True)
class TurnPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class TurnStream:
    """Feeds a choice's output piece by piece. `reasoning`: the model's reasoning format (None: no
    reasoning parser); `calls`: its tool-call format (None: text only); `max_calls`: calls past
    this many are dropped (parallel_tool_calls false keeps the first)."""

    def __init__(self, reasoning: ReasoningFormat | None = None, starts_in_reasoning: bool = False,
                 calls: CallFormat | None = None, schemas: Schemas | None = None, max_calls: int | None = None) -> None:
        self._reasoning = ReasoningStream(reasoning, starts_in_reasoning) if reasoning is not None else None
        self._calls = CallStream(calls, schemas) if calls is not None else None
        self.max_calls = max_calls
        self.calls: list[ParsedCall] = []
        self.has_reasoning = False

    def feed(self, text: str, finished: bool = False) -> TurnPiece:
        piece = TurnPiece()
        if self._reasoning is not None:
            piece.reasoning, text = self._reasoning.feed(text, finished)
            self.has_reasoning = self._reasoning.has_reasoning
        if self._calls is None:
            piece.content = text
            return piece
        piece.content, calls = self._calls.feed(text, finished)
        room = len(calls) if self.max_calls is None else max(0, self.max_calls - len(self.calls))
        piece.calls = calls[:room]
        self.calls.extend(piece.calls)
        return piece


def parse_turn(text: str, reasoning: ReasoningFormat | None = None, starts_in_reasoning: bool = False,
               calls: CallFormat | None = None, schemas: Schemas | None = None,
               max_calls: int | None = None) -> tuple[str | None, str, list[ParsedCall]]:
    """(reasoning or None, answer text, calls) of a whole output. With calls found, the answer
    text is stripped (the whitespace around the calls is not the answer)."""
    stream = TurnStream(reasoning, starts_in_reasoning, calls, schemas, max_calls)
    piece = stream.feed(text, finished=True)
    content = piece.content.strip() if stream.calls else piece.content
    return (piece.reasoning if stream.has_reasoning else None), content, stream.calls
