"""tool_choice "auto": the model's own Hermes-style <tool_call> blocks become OpenAI tool calls,
whole and streamed. The parser alone, then through a real server whose stub model always writes a
fixed answer (a small model will not call tools on its own), talked to with the openai client."""

import json

import httpx
import openai
import pytest

from octavo.server.tools import HermesStream, parse_hermes
from tests.server.scripted import scripted_engine, serve_in_thread

ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]


def test_parse_hermes_whole():
    content, calls = parse_hermes(ANSWER)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    content, calls = parse_hermes("<tool_call>not json</tool_call>")  # not a call: left as written
    assert calls == [] and content == "<tool_call>not json</tool_call>"


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_stream_any_split_equals_whole(piece):
    stream = HermesStream()
    shown, calls = [], []
    pieces = [ANSWER[i:i + piece] for i in range(0, len(ANSWER), piece)]
    for k, p in enumerate(pieces):
        text, new = stream.feed(p, finished=k == len(pieces) - 1)
        assert "<tool_call" not in text  # (the joined text below catches a tag shown in pieces)
        shown.append(text)
        calls.extend(new)
    assert "".join(shown).strip() == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    # a partial tag that turns out not to be one is shown in the end
    stream = HermesStream()
    assert stream.feed("a <tool_") == ("a ", [])
    assert stream.feed("box>", finished=True) == ("<tool_box>", [])


@pytest.fixture(scope="module")
def scripted_url(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, ANSWER), tool_call_parser="hermes") as url:
        yield url


def test_auto_tool_calls_whole(scripted_url):
    client = openai.OpenAI(base_url=f"{scripted_url}/v1", api_key="x")
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
                                       tools=TOOLS, tool_choice="auto", max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    # parallel_tool_calls false: the first call only, whole and streamed
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, parallel_tool_calls=False, max_tokens=200)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    stream = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS, parallel_tool_calls=False, max_tokens=200, stream=True)
    names = [tc.function.name for ch in stream for tc in (ch.choices[0].delta.tool_calls or [])]
    assert names == ["get_weather"]
    # tool_choice "none": the same text comes back as text
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Hi"}],
                                       tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_auto_tool_calls_streamed_and_a_tool_turn(scripted_url):
    client = openai.OpenAI(base_url=f"{scripted_url}/v1", api_key="x")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    stream = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, max_tokens=200, stream=True)
    content, calls, finish = [], {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(content).strip() == "Let me check."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["arguments"]) == {"zone": "CET"} and finish == "tool_calls"
    # the calls and their results go back through the chat template as the next turn
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": calls[0]["id"], "type": "function", "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    ids = httpx.post(f"{scripted_url}/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(f"{scripted_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert "tool\n18 degrees, sunny" in prompt
