"""Structured outputs, forced tool calls, echo / prompt_logprobs and the Responses API on a live
`octavo serve` with the embedded model, through the real `openai` client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import API_KEY, MODEL
from tests.structured.schemas import PET_SCHEMA

SCHEMA = PET_SCHEMA
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_json_schema_twenty_samples_all_validate(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=20, temperature=1.0, seed=11, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 10  # sampled, not one answer repeated


def test_json_schema_streamed_and_json_object(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.8, seed=2, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    r = client.completions.create(model=MODEL, prompt="A JSON object with a person's name and age:", temperature=0,
                                  max_tokens=250, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def test_regex_and_choice_through_vllm_fields(client):
    r = client.completions.create(model=MODEL, prompt="A product code:", n=5, temperature=1.0, seed=4, max_tokens=20,
                                  extra_body={"guided_regex": r"[A-Z]{3}-\d{4}"})
    for c in r.choices:
        assert re.fullmatch(r"[A-Z]{3}-\d{4}", c.text), c.text
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
                                       n=4, temperature=1.0, seed=5, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Answer:", temperature=0, max_tokens=10,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def test_bad_schema_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}})
    assert "`not`" in str(err.value) and "#/properties/a" in str(err.value)
    assert err.value.body["param"] == "response_format"


def test_required_and_named_tool_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
                                       tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Time in Berlin?"}],
                                            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=120, stream=True)
    streamed = [(tc.function.name, tc.function.arguments) for ch in stream for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(streamed) == 1  # parallel_tool_calls false: the grammar allows one call
    jsonschema.validate(json.loads(streamed[0][1]), schemas[streamed[0][0]])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       n=3, temperature=1.0, seed=9, max_tokens=200)
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            temperature=0, max_tokens=200, stream=True)
    name, args = "", ""
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_echo_with_logprobs_and_prompt_logprobs(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    lp = c.logprobs
    num_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    # the prompt's own token is always among them (OpenAI: the top N and the chosen token)
    assert all(t[tok] == v for t, tok, v in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]))
    assert "".join(lp.tokens) == c.text and lp.text_offset[1] == len(lp.tokens[0])
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert c.text == prompt + plain.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == num_prompt and all(1 <= len(e) <= 2 for e in plp[1:])


def test_suffix_and_unknown_vllm_fields_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="a", suffix="b", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"bad_words": ["x"]})


def test_vllm_sampling_extensions(client, live_server):
    """allowed_token_ids, return_token_ids, truncate_prompt_tokens, prompt_logprobs null when not
    asked, continuous usage in a stream, return_tokens_as_token_ids."""
    allowed = [281, 314, 355]
    r = client.completions.create(model=MODEL, prompt="The colour of the sky is", max_tokens=6, temperature=1.0,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    choice = r.choices[0].model_dump()
    assert choice["token_ids"] and set(choice["token_ids"]) <= set(allowed) and choice["prompt_logprobs"] is None
    assert len(choice["prompt_token_ids"]) == r.usage.prompt_tokens
    cut = client.completions.create(model=MODEL, prompt="one two three four five six seven", max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].model_dump()["prompt_token_ids"] == choice_ids_of(
        live_server, "one two three four five six seven")[-3:]
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens for c in chunks)
    assert chunks[-1].usage.completion_tokens == 4
    lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                        logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") for t in lp.choices[0].logprobs.content)
    named = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           logprobs=True, top_logprobs=5, extra_body={
                                               "logprob_token_ids": [100, 5000], "allowed_token_ids": [42],
                                               "return_tokens_as_token_ids": True})
    entry = named.choices[0].logprobs.content[0]
    assert entry.token == "token_id:42" and {t.token for t in entry.top_logprobs} == {"token_id:42", "token_id:100",
                                                                                       "token_id:5000"}
    # cut by max_tokens inside a character: the text is what decoding the tokens gives (U+FFFD at the end)
    cat = client.completions.create(model=MODEL, prompt="cat", max_tokens=2, extra_body={
        "allowed_token_ids": [15107], "return_token_ids": True})  # 15107 is the first byte-token of an emoji
    assert cat.choices[0].text == tokenizer_decode(live_server, cat.choices[0].model_dump()["token_ids"])


def tokenizer_decode(live_server, ids: list[int]) -> str:
    return httpx.post(f"{live_server.url}/detokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"tokens": ids}).json()["prompt"]


def choice_ids_of(live_server, text: str) -> list[int]:
    return httpx.post(f"{live_server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": text}).json()["tokens"]


def test_responses_api_text_stream_state_and_schema(client, live_server):
    r = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 8 and r.output[0].content[0].type == "output_text"
    again = httpx.get(f"{live_server.url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert again["output"][0]["content"][0]["text"] == r.output_text
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=8, temperature=0,
                                     input=[{"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}])
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens
    short = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"

    events = list(client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text and [e.sequence_number for e in events] == list(range(len(events)))

    r = client.responses.create(model=MODEL, input="Describe a pet.", temperature=1.0, max_output_tokens=300,
                                text={"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
