"""Tool-call and reasoning parsing in linear time: 100,000-character adversarial outputs for every
format, streamed in small pieces and whole. The bound (10 s a case, ~0.2 s here) is one a
quadratic parser cannot meet: qwen3_coder's old patterns took 58 s on a tenth of this text."""

from __future__ import annotations

import time

import pytest

from octavo.server.parsers.reasoning import FORMATS as REASONING_FORMATS
from octavo.server.parsers.reasoning import ReasoningStream
from octavo.server.parsers.tool_calls import FORMATS, CallStream

SIZE = 100_000
BOUND_S = 10.0

# what makes each format's reader work hardest: markers that open and never close, tags inside
# tags, whitespace that keeps a section possible
ADVERSARIAL = {
    "hermes": ["<tool_call>" * (SIZE // 11 + 1), "<tool_call>" + "{" * SIZE, "a <tool_" * (SIZE // 8 + 1)],
    "qwen3_coder": ["<tool_call><function=f>" + "<parameter=a>" * (SIZE // 13 + 1) + "</function></tool_call>",
                    "<tool_call><function=f>" + "<parameter=a>" * (SIZE // 13 + 1),
                    "<tool_call>" + "<function=f>" * (SIZE // 12 + 1), "<tool_call><function=f><parameter=x>" + "y" * SIZE],
    "llama3_json": [" " * SIZE + "{", "{" + '"a": [' * (SIZE // 6 + 1), "<|python_tag|>" + "{" * SIZE],
    "mistral": ["[TOOL_CALLS]" * (SIZE // 12 + 1), "[TOOL_CALLS]f[ARGS]" + "{" * SIZE],
    "pythonic": [" " * SIZE + "[", "[" + "f(a=" * (SIZE // 4 + 1), "[" + "f(a='" + "x" * SIZE],
}


def stream_in_pieces(feed, text: str, piece: int = 3) -> None:
    for i in range(0, len(text), piece):
        feed(text[i:i + piece], finished=False)
    feed("", finished=True)


def test_every_format_has_adversarial_cases():
    assert set(ADVERSARIAL) == set(FORMATS)


@pytest.mark.parametrize("name, case", [(n, i) for n, cases in ADVERSARIAL.items() for i in range(len(cases))])
def test_tool_call_parsing_is_linear(name, case):
    text = ADVERSARIAL[name][case]
    assert len(text) >= SIZE
    start = time.monotonic()
    whole = CallStream(FORMATS[name])
    shown_whole, calls_whole = whole.feed(text, finished=True)
    streamed = CallStream(FORMATS[name])
    pieces: list[str] = []
    stream_in_pieces(lambda t, finished: pieces.append(streamed.feed(t, finished)[0]), text)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"{name} case {case}: {elapsed:.1f} s for {len(text):,} characters"
    # nothing lost: no call came out of it, so the text is shown as written, streamed as whole
    assert not calls_whole and not streamed.calls
    assert "".join(pieces) == shown_whole == text


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
@pytest.mark.parametrize("shape", ["open", "spaces", "partial"])
def test_reasoning_parsing_is_linear(name, shape):
    fmt = REASONING_FORMATS[name]
    text = {"open": fmt.start + "x" * SIZE, "spaces": " " * SIZE + "answer",
            "partial": fmt.start + fmt.end[:-1] * (SIZE // max(1, len(fmt.end) - 1))}[shape]
    start = time.monotonic()
    stream = ReasoningStream(fmt)
    reasoning, answer = [], []

    def feed(t: str, finished: bool) -> None:
        r, a = stream.feed(t, finished)
        reasoning.append(r)
        answer.append(a)

    stream_in_pieces(feed, text)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S, f"{name} {shape}: {elapsed:.1f} s"
    assert "".join(reasoning) + "".join(answer) == text.removeprefix(fmt.start) or shape == "open"
    if shape == "open":
        assert "".join(reasoning) == "x" * SIZE and not "".join(answer)
