"""tool_choice "auto": the model's own Hermes-style <tool_call> blocks become OpenAI tool calls,
whole and streamed. The parser alone, then through a real server whose stub model always writes a
fixed answer (a small model will not call tools on its own), talked to with the openai client."""

import json

import httpx
import openai
import pytest

from octavo.server.parsers.tool_calls import CallStream, call_format, parse_calls
from octavo.server.tools import parse_forced_calls
from tests.server.scripted import scripted_engine, serve_in_thread

ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]


def parse_hermes(text):
    return parse_calls(call_format("hermes"), text)


def HermesStream():  # noqa: N802 (the stream's old name)
    return CallStream(call_format("hermes"))


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


# ---- issue 20: what a model writes never breaks the parsers -------------------------------------

REPEATED_CALL = '{"name": "get_time", "parameters": {"zone": "CET"}}'
REPEATING = "[" + ", ".join([REPEATED_CALL] * 40) + "]"  # a model that repeats its call until max_tokens
# deeper than json.loads can go (~1,000 levels), in ~600 tokens
DEEP = '<tool_call>\n{"name": "get_time", "arguments": ' + "[" * 1100 + "\n</tool_call> done"


def test_parsers_survive_nesting_too_deep_for_json():
    content, calls = parse_hermes(DEEP)
    assert calls == [] and content.startswith("<tool_call>")  # not a call: left as the model wrote it
    stream = HermesStream()
    shown, new = stream.feed(DEEP[:500])
    shown2, new2 = stream.feed(DEEP[500:], finished=True)
    assert new == new2 == [] and (shown + shown2).endswith("done")
    assert parse_forced_calls("[" * 3000, "required") is None
    assert parse_forced_calls("[" * 3000, "required", complete=False) is None


def test_a_required_array_cut_by_length_keeps_the_calls_written_whole():
    cut = REPEATING[: len(REPEATING) // 2]
    calls = parse_forced_calls(cut, "required", complete=False)
    assert calls is not None and 1 <= len(calls) < 40
    assert all(c.name == "get_time" and json.loads(c.arguments) == {"zone": "CET"} for c in calls)
    assert parse_forced_calls('[{"name": "get_ti', "required", complete=False) is None
    assert len(parse_forced_calls(REPEATING, "required")) == 40


@pytest.fixture(scope="module")
def repeating_url(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, REPEATING)) as url:
        yield url


def test_required_tool_calls_cut_by_length_return_the_calls_so_far(repeating_url):
    """What LiteLLM, LangChain, the openai SDK and pydantic-ai send (tool_choice "required", parallel
    calls allowed): a model that repeats its call ran to max_tokens and the client got no call."""
    client = openai.OpenAI(base_url=f"{repeating_url}/v1", api_key="x", max_retries=0)
    asked = dict(model="scripted", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
                 tool_choice="required", max_tokens=60)
    choice = client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "length"
    calls = choice.message.tool_calls
    # the calls written whole, then the one the cut fell in, as far as it went (OpenAI's answer to a
    # call cut by length): never an empty answer
    assert calls and all(c.function.name == "get_time" for c in calls)
    assert all(json.loads(c.function.arguments) == {"zone": "CET"} for c in calls[:-1])
    assert '{"zone": "CET"}'.startswith(calls[-1].function.arguments)
    streamed = [tc for ch in client.chat.completions.create(**asked, stream=True) for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == [c.function.name for c in calls]


def test_parse_forced_calls_keeps_the_cut_call():
    cut = parse_forced_calls('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": ', "required",
                             complete=False)
    assert [(c.name, c.arguments, c.complete) for c in cut] == [("f", '{"a": 1}', True), ("g", '{"b":', False)]

    class Named:
        class function:  # noqa: N801 (the shape of a NamedToolChoice)
            name = "get_time"
    (named,) = parse_forced_calls('{"zone": "C', Named, complete=False)
    assert (named.name, named.arguments, named.complete) == ("get_time", '{"zone": "C', False)


@pytest.fixture(scope="module")
def thinking_url(smol_dir, smol_tokenizer):
    """A model that opens its reasoning and ends without closing it (so a forced call never begins)."""
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, "<think>I wonder what time it is"),
                         reasoning_parser="qwen3") as url:
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_that_never_began_is_an_error_not_an_empty_answer(thinking_url, stream):
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 60, "stream": stream,
            "chat_template_kwargs": {"enable_thinking": True}}
    r = httpx.post(f"{thinking_url}/v1/chat/completions", json=body, timeout=120)
    if not stream:
        assert r.status_code == 500, r.text
        assert "without the tool call" in r.json()["error"]["message"]
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "without the tool call" in error["error"]["message"], events[-3:]


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses"])
def test_the_never_begun_call_is_an_error_on_messages_and_responses(thinking_url, route):
    if route == "/v1/messages":
        body = {"model": "scripted", "max_tokens": 60, "messages": [{"role": "user", "content": "Time?"}],
                "tools": [{"name": "get_time", "input_schema": TOOLS[1]["function"]["parameters"]}],
                "tool_choice": {"type": "tool", "name": "get_time"}, "thinking": {"type": "enabled", "budget_tokens": 50}}
    else:
        body = {"model": "scripted", "input": "Time?", "max_output_tokens": 60, "reasoning": {"effort": "low"},
                "tools": [{"type": "function", "name": "get_time", "parameters": TOOLS[1]["function"]["parameters"]}],
                "tool_choice": {"type": "function", "name": "get_time"}}
    r = httpx.post(f"{thinking_url}{route}", json=body, timeout=120)
    assert r.status_code == 500 and "without the tool call" in r.text, r.text


@pytest.fixture(scope="module")
def deep_url(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, DEEP), tool_call_parser="hermes") as url:
        yield url


def test_deeply_nested_output_is_content_whole_and_streamed(deep_url):
    """Was a 500, or a stream cut without [DONE]: the Hermes parser's RecursionError."""
    client = openai.OpenAI(base_url=f"{deep_url}/v1", api_key="x", max_retries=0)
    asked = dict(model="scripted", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, max_tokens=800)
    message = client.chat.completions.create(**asked).choices[0].message
    assert message.tool_calls is None and message.content.endswith("done")
    with httpx.stream("POST", f"{deep_url}/v1/chat/completions", json={**asked, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1])
    assert text.endswith("done") and "[[[" in text
