"""`octavo serve --speculative-method ngram` through the real openai client: the same greedy text
as the server without it (streamed and whole), valid structured output, and the drafts counted
in /metrics."""

import json

import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL, start_server, stop_server

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
MESSAGES = [{"role": "user", "content": f"Here is some code:\n\n{CODE}\nRepeat it exactly, nothing else."}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, smol_dir):
    log = tmp_path_factory.mktemp("spec-server") / "server.log"
    server = start_server(log, ["--api-key", API_KEY, "--kv-cache-memory", str(128 << 20), "--max-model-len", "1024",
                                "--speculative-method", "ngram", "--num-speculative-tokens", "4"], threads=1)
    yield server
    stop_server(server)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    lines = [line for line in text.splitlines() if line.startswith(f"{name}{{")]
    assert lines, f"{name} is not in /metrics"
    return float(lines[0].rsplit(" ", 1)[1])


def test_same_greedy_text_streamed_and_whole(spec_server, live_server):
    spec, plain = client_of(spec_server), client_of(live_server)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0)
    want = plain.chat.completions.create(**kwargs).choices[0].message.content
    assert spec.chat.completions.create(**kwargs).choices[0].message.content == want
    chunks = spec.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert counter(spec_server.url, "octavo:spec_decode_num_accepted_tokens_total") > 0
    assert counter(spec_server.url, "octavo:spec_decode_num_draft_tokens_total") >= \
        counter(spec_server.url, "octavo:spec_decode_num_accepted_tokens_total")
    assert "speculative decoding: ngram drafts, up to 4 tokens" in spec_server.log_text()


def test_structured_output_validates(spec_server):
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                         "minItems": 6, "maxItems": 6}},
              "required": ["names"], "additionalProperties": False}
    resp = client_of(spec_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Six names as JSON."}], max_tokens=100, temperature=0.9,
        seed=3, n=2, response_format={"type": "json_schema", "json_schema": {"name": "names", "schema": schema}})
    for choice in resp.choices:
        assert len(json.loads(choice.message.content)["names"]) == 6
