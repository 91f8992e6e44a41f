"""The Responses API's function tools, reasoning items, logprobs and background responses, through
the openai client: a stub model that reasons and calls a tool (whole, streamed, and the tool's
output sent back), and the real model for logprobs and background / cancel."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.live_server import API_KEY, MODEL
from tests.server.scripted import scripted_engine, serve_in_thread

SCRIPT = ('<think>\nThe user wants the weather; I should call the tool.\n</think>\n\nLet me check.'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def stub(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, SCRIPT), reasoning_parser="qwen3") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_reasoning_message_and_function_call_items(stub):
    r = stub.responses.create(model="scripted", input="Weather in Paris?", tools=[TOOL], max_output_tokens=200)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text.strip() == "The user wants the weather; I should call the tool."
    assert r.output_text == "Let me check."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    # the tool's output goes back as the next turn, after the stored conversation
    follow = stub.responses.create(model="scripted", previous_response_id=r.id, tools=[TOOL], max_output_tokens=200,
                                   input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert follow.usage.input_tokens > r.usage.input_tokens and follow.output[-1].type == "function_call"
    # or the whole conversation as items, without the store
    again = stub.responses.create(model="scripted", tools=[TOOL], store=False, max_output_tokens=200, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert again.usage.input_tokens > r.usage.input_tokens and again.output[-1].type == "function_call"


def test_streamed_items_events(stub):
    events = list(stub.responses.create(model="scripted", input="Weather?", tools=[TOOL], max_output_tokens=200,
                                        stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    final = events[-1].response
    assert [i.type for i in final.output] == added and json.loads(final.output[2].arguments) == {"city": "Paris"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0)


def test_logprobs_and_background_responses(client):
    r = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text
    queued = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0,
                                     background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline = time.monotonic() + 120
    while (got := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"background response still {got.status} after 120 s"
        time.sleep(0.1)
    assert got.status == "incomplete" and got.output_text == r.output_text  # cut by max_output_tokens, as r
    long = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=900,
                                   background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)  # not a background response
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model=MODEL, input="x", background=True, store=False)
