"""The tool-call and reasoning parsers alone: each format's calls read whole, the same read from any
split of the stream, and hypothesis' arbitrary model output never crashing a parser or losing text.
`OCTAVO_FUZZ_EXAMPLES` sets the examples per fuzz test (tools/fuzz_parsers.sh runs 10,000)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.server.parsers.reasoning import FORMATS as REASONING_FORMATS
from octavo.server.parsers.reasoning import ReasoningStream, reasoning_format, split_reasoning
from octavo.server.parsers.tool_calls import FORMATS, CallStream, call_format, parse_calls
from octavo.server.parsers.turn import TurnStream, parse_turn

FUZZ = settings(max_examples=int(os.environ.get("OCTAVO_FUZZ_EXAMPLES", "120")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow], derandomize="OCTAVO_FUZZ_EXAMPLES" not in os.environ)

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                             "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}
WEATHER = {"city": "Paris", "days": 3}
# (parser, output, content, [(name, arguments)])
CASES = [
    ("hermes", 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "Checking.", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "parameters": {"x": [1]}}</tool_call>',
     None, [("a", {}), ("b", {"x": [1]})]),
    ("hermes", "<tool_call>not json</tool_call> as written", "<tool_call>not json</tool_call> as written", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
     "</function>\n</tool_call>", "Sure.", [("get_weather", {**WEATHER, "metric": True, "tags": ["a"]})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "42"})]),  # a string parameter stays text
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}',
     None, [("a", {}), ("b", {"y": 2})]),
    ("llama3_json", 'The JSON is {"name": "a", "parameters": {}}', 'The JSON is {"name": "a", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call stays the answer
    ("mistral", 'Let me see.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
     "Let me see.", [("get_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]b[CALL_ID]x7Yz1234a[ARGS]{}',
     None, [("get_weather", WEATHER), ("b", {})]),
    ("pythonic", '[get_weather(city="Paris", days=3), b(flag=true, v=None, l=[1, {"k": (2, 3)}])]',
     None, [("get_weather", WEATHER), ("b", {"flag": True, "v": None, "l": [1, {"k": [2, 3]}]})]),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ("pythonic", "Call [f(x=1)] later", "Call [f(x=1)] later", []),  # not at the start: an answer
]


def _streamed(fmt, text, cuts):
    stream = CallStream(fmt, SCHEMAS)
    shown, calls = [], []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for k in range(len(bounds) - 1):
        piece, new = stream.feed(text[bounds[k]:bounds[k + 1]], finished=k == len(bounds) - 2)
        shown.append(piece)
        calls.extend(new)
    return "".join(shown), calls


@pytest.mark.parametrize("parser,text,content,expected", CASES)
def test_each_format_whole_and_at_every_split(parser, text, content, expected):
    fmt = call_format(parser)
    got_content, calls = parse_calls(fmt, text, SCHEMAS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    for cut in range(len(text) + 1):  # every split in two, and one character at a time
        shown, streamed = _streamed(fmt, text, [cut])
        assert (shown.strip() or None, [(c.name, c.arguments) for c in streamed]) == (
            got_content, [(c.name, c.arguments) for c in calls]), cut
    shown, streamed = _streamed(fmt, text, range(len(text)))
    assert shown.strip() or None == got_content and len(streamed) == len(calls)


def test_partial_markers_are_held_until_clear():
    stream = CallStream(call_format("hermes"))
    assert stream.feed("a <tool_") == ("a ", [])
    assert stream.feed("box>", finished=True) == ("<tool_box>", [])
    stream = CallStream(call_format("llama3_json"))
    assert stream.feed("  ") == ("", [])  # the output could still open with {
    assert stream.feed("Hello {") == ("  Hello {", [])  # it did not: everything after is answer


def test_aliases_and_unknown_names():
    assert call_format("qwen3_xml") is FORMATS["qwen3_coder"]
    assert reasoning_format("deepseek_v3").end == "</think>"
    with pytest.raises(ValueError, match="choose one of"):
        call_format("nope")


@pytest.mark.parametrize("name,text,starts,reasoning,answer", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", False, "\nLet me think.\n", "Paris."),
    ("qwen3", "Paris.", False, None, "Paris."),  # thinking off: all answer
    ("deepseek_r1", "Let me think.</think>Paris.", True, "Let me think.", "Paris."),  # the prompt opened it
    ("deepseek_r1", "Still thinking when cut", True, "Still thinking when cut", ""),
    ("mistral", "[THINK]hmm[/THINK]Paris.", False, "hmm", "Paris."),
    ("seed_oss", "<seed:think>hmm</seed:think>Paris.", False, "hmm", "Paris."),
])
def test_reasoning_whole_and_streamed(name, text, starts, reasoning, answer):
    fmt = reasoning_format(name)
    assert split_reasoning(fmt, text, starts) == (reasoning, answer)
    for cut in range(len(text) + 1):
        stream = ReasoningStream(fmt, starts)
        r1, a1 = stream.feed(text[:cut])
        r2, a2 = stream.feed(text[cut:], finished=True)
        assert ((r1 + r2) if stream.has_reasoning else None, a1 + a2) == (reasoning, answer), cut


def test_tool_calls_read_after_the_reasoning_only():
    text = ('<think>I could write <tool_call>{"name": "x", "arguments": {}}</tool_call> but no.</think>'
            'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>')
    reasoning, content, calls = parse_turn(text, reasoning_format("qwen3"), False, call_format("hermes"))
    assert "<tool_call>" in reasoning and content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER)]
    stream = TurnStream(reasoning_format("qwen3"), False, call_format("hermes"), max_calls=1)
    pieces = [stream.feed(text[i:i + 5], finished=i + 5 >= len(text)) for i in range(0, len(text), 5)]
    assert "".join(p.reasoning for p in pieces) == reasoning
    assert "".join(p.content for p in pieces).strip() == "Checking." and len(stream.calls) == 1


# ---- fuzz: arbitrary model output ----------------------------------------------------------------

_FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "{", "}", "[", "]", '"name"', ": ", '"arguments"', '"parameters"',
              ", ", ";", '"get_weather"', '{"city": "Paris"}', "<function=", "<function=get_weather>", "</function>",
              "<parameter=", "<parameter=city>", "</parameter>", "\n", " ", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
              "<|python_tag|>", "f(", ")", "x=", "=", "1", "true", "null", "'", '"', "\\", "(" * 40, "[" * 300,
              "<think>", "</think>", "<thi", "</thin", "[THINK]", "[/THINK]", "<seed:think>", "</seed:think>", "é", "\x00"]
noise = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=8)), max_size=40).map("".join)
# noise, or a well-formed call of some format cut anywhere and wrapped in noise
model_output = st.one_of(noise, st.builds(lambda a, case, cut, b: a + case[1][:cut] + b, noise, st.sampled_from(CASES),
                                          st.integers(min_value=0, max_value=400), noise))
cut_points = st.lists(st.integers(min_value=0, max_value=400), max_size=8)


@pytest.mark.parametrize("parser", sorted(FORMATS))
@FUZZ
@given(text=model_output, cuts=cut_points)
def test_fuzz_tool_parsers_never_crash_nor_lose_text(parser, text, cuts):
    fmt = call_format(parser)
    whole = CallStream(fmt, SCHEMAS)
    shown, calls = whole.feed(text, finished=True)
    for call in calls:
        assert isinstance(call.name, str) and call.name
        assert isinstance(json.loads(call.arguments), dict)
    if not calls:
        assert shown == text  # nothing a parser does not take as a call is lost
    streamed_shown, streamed = _streamed(fmt, text, [c for c in cuts if c <= len(text)])
    assert (streamed_shown, [(c.name, c.arguments) for c in streamed]) == (shown, [(c.name, c.arguments) for c in calls])


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
@FUZZ
@given(text=model_output, cuts=cut_points, starts=st.booleans())
def test_fuzz_reasoning_parsers_never_crash(name, text, cuts, starts):
    fmt = reasoning_format(name)
    reasoning, answer = split_reasoning(fmt, text, starts)
    if not starts and fmt.start not in text:
        assert (reasoning, answer) == (None, text)
    stream = ReasoningStream(fmt, starts)
    bounds = [0, *sorted({c for c in cuts if c <= len(text)}), len(text)]
    parts = [stream.feed(text[bounds[k]:bounds[k + 1]], finished=k == len(bounds) - 2) for k in range(len(bounds) - 1)]
    assert ("".join(p[0] for p in parts) if stream.has_reasoning else None, "".join(p[1] for p in parts)) == (reasoning, answer)
