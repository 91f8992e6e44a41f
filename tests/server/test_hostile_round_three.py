"""Issue 36's leftovers of round two, against the shared live server: nesting inside a string that
is parsed later (tool-call arguments, on chat and /tokenize) is a 400, not a
500; tool_choice "required" with a tool schema of local $defs/$ref works; a complete grammar ends
the request under min_tokens (it repeated EOS until min_tokens); a regex no output satisfies is a
400 at compile time."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
DEEP_ARGUMENTS = "[" * 5000


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=HEADERS, timeout=120)


def deep_call_messages() -> list[dict]:
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_nesting_inside_tool_call_arguments_is_a_400_naming_it(live_server, route):
    body = {"model": MODEL, "messages": deep_call_messages(), "max_tokens": 2}
    r = post(live_server.url, route, body)
    assert r.status_code == 400, r.text
    assert "nested deeper than 160" in r.json()["error"]["message"], r.text
    ok = post(live_server.url, route, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_tool_choice_required_with_local_defs_and_refs(live_server):
    """A tool whose parameters use "$defs" and "$ref" (what pydantic's model_json_schema writes):
    the forced-call grammar keeps the references pointing into the tool's own definitions."""
    location = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                "additionalProperties": False}
    parameters = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Location"}}, "required": ["where"],
                  "additionalProperties": False, "$defs": {"Location": location}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=tools, tool_choice="required", max_tokens=60, temperature=0)
    calls = reply.choices[0].message.tool_calls
    assert calls, reply
    for call in calls:
        schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_complete_grammar_ends_the_request_under_min_tokens(live_server):
    body = {"model": MODEL, "prompt": "Is water wet? Answer:", "max_tokens": 12, "min_tokens": 8, "temperature": 0,
            "guided_choice": ["yes"]}
    r = post(live_server.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "yes" and choice["finish_reason"] == "stop", choice
    assert r.json()["usage"]["completion_tokens"] <= 3, r.json()["usage"]  # the choice's tokens and one EOS


@pytest.mark.parametrize("field, value", [("guided_regex", "[^\\s\\S]"), ("guided_grammar", 'root ::= [^\\x00-\\U0010FFFF]')])
def test_a_constraint_no_output_satisfies_is_a_400(live_server, field, value):
    r = post(live_server.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert "no output satisfies this constraint" in r.json()["error"]["message"], r.text
