"""Anthropic's Messages API (/v1/messages) through the real `anthropic` SDK: text whole and streamed
(the same greedy text as chat completions), stop sequences and max_tokens as stop reasons, token
counting, errors in Anthropic's shape, tools forced by tool_choice on the real model, and a
reasoning + tool-use loop on a stub model that writes `<think>` and a Hermes call."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL
from tests.server.scripted import scripted_engine, serve_in_thread

WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                                 "required": ["city"]}}
GREEDY = {"temperature": 0}  # the SDK's 2.x create() has no temperature parameter: clients send it in the body


@pytest.fixture(scope="module")
def claude(live_server):
    return anthropic.Anthropic(base_url=live_server.url, api_key=API_KEY, max_retries=0)


def test_text_whole_and_streamed_match_chat_completions(claude, live_server):
    asked = dict(model=MODEL, max_tokens=24, system="You are terse.", extra_body=GREEDY,
                 messages=[{"role": "user", "content": "Name three colours."}])
    msg = claude.messages.create(**asked)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.stop_reason in ("end_turn", "max_tokens")
    chat = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY).chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}])
    assert msg.content[0].text == chat.choices[0].message.content
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert claude.messages.count_tokens(model=MODEL, system="You are terse.",
                                        messages=asked["messages"]).input_tokens == msg.usage.input_tokens
    with claude.messages.stream(**asked) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events


def test_stop_reasons_and_blocks_in_the_conversation(claude):
    free = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": [{"type": "text", "text": "Count: one, two,"}]}])
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 8
    word = free.content[0].text.split()[1]
    cut = claude.messages.create(model=MODEL, max_tokens=8, stop_sequences=[word], extra_body=GREEDY,
                                 messages=[{"role": "user", "content": [{"type": "text", "text": "Count: one, two,"}]}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == free.content[0].text[: free.content[0].text.index(word)]
    # an assistant turn to continue from, given as blocks
    two = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"}])
    assert two.content and two.usage.input_tokens > free.usage.input_tokens - 10


def test_errors_in_anthropic_shape(claude, live_server):
    with pytest.raises(anthropic.BadRequestError) as err:  # max_tokens is required
        claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus-9", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    bad = anthropic.Anthropic(base_url=live_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{live_server.url}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]})
    assert r.status_code == 400 and "'image'" in r.json()["error"]["message"]


def test_tool_choice_any_and_named_force_a_valid_call(claude):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        msg = claude.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER_TOOL], tool_choice=choice,
                                     extra_body=GREEDY, messages=[{"role": "user", "content": "Weather in Paris?"}])
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str), msg
        assert msg.stop_reason == "tool_use"
        with claude.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER_TOOL], tool_choice=choice,
                                    extra_body=GREEDY, messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
            streamed = s.get_final_message()
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]


SCRIPT = ('<think>\nThe user wants the weather; I should call the tool.\n</think>\n\nLet me check.'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')


@pytest.fixture(scope="module")
def thinking_url(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, SCRIPT), reasoning_parser="qwen3") as url:
        yield url


def test_thinking_text_and_tool_use_loop(thinking_url):
    claude = anthropic.Anthropic(base_url=thinking_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris for two days?"}]
    msg = claude.messages.create(model="scripted", max_tokens=200, tools=[WEATHER_TOOL], messages=messages,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking.strip() == "The user wants the weather; I should call the tool."
    assert msg.content[1].text == "Let me check."
    use = msg.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2} and use.id.startswith("toolu_")
    with claude.messages.stream(model="scripted", max_tokens=200, tools=[WEATHER_TOOL], messages=messages) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == use.input and final.content[0].thinking == msg.content[0].thinking
    assert {"thinking_delta", "text_delta", "input_json_delta"} <= set(deltas)
    # the call and its result go back as the next turn (tool_use / tool_result blocks)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    again = claude.messages.create(model="scripted", max_tokens=200, tools=[WEATHER_TOOL], messages=messages)
    assert again.stop_reason == "tool_use"
    counted = claude.messages.count_tokens(model="scripted", tools=[WEATHER_TOOL], messages=messages).input_tokens
    assert counted == again.usage.input_tokens > msg.usage.input_tokens
    # the chat route splits the same reasoning off into reasoning_content
    chat = openai.OpenAI(base_url=f"{thinking_url}/v1", api_key="x").chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Hi"}], max_tokens=200)
    message = chat.choices[0].message
    assert message.reasoning_content.strip().startswith("The user wants") and message.content.startswith("Let me check.")


CONSTRAINED = '<think>\nThe answer must be JSON.\n</think>{"city": "Paris"}'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def constrained_url(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, CONSTRAINED), reasoning_parser="qwen3") as url:
        yield url


def test_constraints_apply_to_the_answer_after_the_reasoning(constrained_url):
    """A JSON schema (or a forced call) constrains the answer, not the thinking before it: were it
    applied from the first token, the grammar would ban `<think>` and the stub's script would break."""
    client = openai.OpenAI(base_url=f"{constrained_url}/v1", api_key="x", max_retries=0)
    # not asked to think (and the prompt does not open the reasoning): constrained from the first
    # token, so the grammar refuses the stub's <think> and nothing comes back as reasoning
    plain = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Where?"}],
                                           max_tokens=100, response_format={"type": "json_object"})
    assert plain.choices[0].message.reasoning_content is None
    assert not (plain.choices[0].message.content or "").startswith("<think>")
    asked = dict(model="scripted", messages=[{"role": "user", "content": "Where?"}], max_tokens=100,
                 extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = client.chat.completions.create(**asked, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    message = r.choices[0].message
    assert message.reasoning_content.strip() == "The answer must be JSON." and message.content == '{"city": "Paris"}'
    tool = {"type": "function", "function": {"name": "locate", "parameters": CITY}}
    named = client.chat.completions.create(**asked, tools=[tool], tool_choice={"type": "function",
                                                                               "function": {"name": "locate"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "locate" and call.function.arguments == '{"city": "Paris"}'
    chunks = list(client.chat.completions.create(**asked, tools=[tool], stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "locate"}}))
    arguments = "".join(tc.function.arguments or "" for ch in chunks for tc in (ch.choices[0].delta.tool_calls or []))
    assert arguments == '{"city": "Paris"}'
