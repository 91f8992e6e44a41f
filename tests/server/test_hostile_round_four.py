"""Issue 60 (reliability, round four): the new surfaces as a hostile client would try them, each
asserting the fix. A server that trusts request templates, with a short template deadline."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "Hi"}]
LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
BOMB = "{{ 'x' * 30000000 }}"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_dir):
    log = tmp_path_factory.mktemp("round-four") / "server.log"
    s = start_server(log, ["--api-key", API_KEY, "--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
                           "--trust-request-chat-template", "--chat-template-timeout", "3", "--log-interval", "1",
                           "--shutdown-timeout", "5"])
    yield s
    stop_server(s)


def post(url: str, route: str, body: dict, timeout: float = 120, headers: dict | None = HEADERS) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=headers, timeout=timeout)


def rss_kib(pid: int) -> int:
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:"))


def chat(url: str, **extra) -> httpx.Response:
    return post(url, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0, **extra})


# ---- chat templates: a budget, a worker replaced, the server untouched -----------------------------

@pytest.mark.parametrize("template, bound", [(BOMB, "size bound"), (LOOP, "loop steps"),
                                             ("{{ '%1500000000s' % 'x' }}", "memory bound")])
def test_a_hostile_request_template_is_a_400_naming_its_bound(server, template, bound):
    assert chat(server.url).status_code == 200  # the server's first chat sizes its buffers: not measured
    before = rss_kib(server.process.pid)
    r = chat(server.url, chat_template=template)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert bound in error["message"] and error["param"] == "chat_template", error
    assert chat(server.url).status_code == 200
    assert rss_kib(server.process.pid) < before * 1.10 + 20_000, "the server's memory grew with the render"


def test_template_floods_stall_neither_health_nor_plain_chats(server):
    idle = chat(server.url)
    assert idle.status_code == 200
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        floods = [pool.submit(chat, server.url, chat_template=LOOP) for _ in range(4)]
        floods += [pool.submit(chat, server.url, chat_template=BOMB) for _ in range(2)]
        health = httpx.get(f"{server.url}/health", timeout=30)
        plain = chat(server.url)
        assert health.status_code == 200 and plain.status_code == 200, plain.text
        # the plain chat was answered while request templates still held their own lane
        assert not all(f.done() for f in floods[:4]), "the plain chat waited for the hostile templates"
        assert all(f.result().status_code == 400 for f in floods)


def test_the_models_own_template_is_budgeted_too(smol_dir):
    from octavo.chat_template.sandbox import RenderBudget, TemplateBudgetError
    from octavo.tokenizer import load_tokenizer, set_chat_template

    tokenizer = load_tokenizer(smol_dir)
    set_chat_template(tokenizer, LOOP)
    with pytest.raises(TemplateBudgetError, match="steps"):
        tokenizer.apply_chat_template(HI, tokenize=False, budget=RenderBudget(max_steps=10_000))


# ---- keys ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, route, body", [("POST", "/tokenize", {"prompt": "x"}),
                                                 ("POST", "/detokenize", {"tokens": [1]}),
                                                 ("GET", "/tokenizer_info", None)])
def test_tokenizer_routes_need_the_key(server, method, route, body):
    r = httpx.request(method, f"{server.url}{route}", json=body, timeout=30)
    assert r.status_code == 401, r.text
    assert httpx.request(method, f"{server.url}{route}", json=body, headers=HEADERS, timeout=30).status_code == 200


@pytest.mark.parametrize("route", ["/health", "/metrics", "/version"])
def test_probes_stay_open(server, route):
    assert httpx.get(f"{server.url}{route}", timeout=30).status_code == 200


# ---- limits and fields -----------------------------------------------------------------------------

def test_responses_takes_a_long_string_input(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    reply = client.responses.create(model=MODEL, input="sea " * 300, max_output_tokens=4)
    assert reply.status == "incomplete" or reply.status == "completed", reply
    r = post(server.url, "/v1/responses", {"model": MODEL, "input": "word " * 5000, "max_output_tokens": 2})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("field, value", [("response_format", {"type": "json_object"}), ("guided_regex", "a+"),
                                          ("logit_bias", {"1": 5}), ("n", 2), ("top_logprobs", 2),
                                          ("frequency_penalty", 0.5), ("best_of", 2), ("stop", ["x"])])
def test_messages_refuses_fields_it_does_not_read(server, field, value):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, field: value}
    r = post(server.url, "/v1/messages", body)
    assert r.status_code == 400 and field in r.text, r.text


@pytest.mark.parametrize("change, words", [
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "needs a 'text'"),
    ({"max_tokens": "8"}, "max_tokens"),
])
def test_messages_refuses_what_anthropic_refuses(server, change, words):
    r = post(server.url, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": HI, **change})
    assert r.status_code == 400 and words in r.text, r.text


@pytest.mark.parametrize("route, body, field", [
    ("/v1/embeddings", {"model": MODEL, "input": [True]}, "input"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "allowed_token_ids": ["1"]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": "yes"}, "stream"),
])
def test_types_are_strict(server, route, body, field):
    r = post(server.url, route, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_rerank_of_the_documented_maximum_is_served(server):
    r = post(server.url, "/v1/rerank", {"model": MODEL, "query": "sea", "documents": [f"doc {i}" for i in range(1024)],
                                        "top_n": 3}, timeout=600)
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 3


def test_models_retrieve(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
     "'image_url' are not supported"),
    ({"prompt": ""}, "prompt: is empty"),
    ({"prompt": [1.5]}, "prompt: must be a string, a list of token ids"),
])
def test_clear_messages_for_what_cannot_be_served(server, body, words):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(server.url, route, {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_anthropic_sdk_still_works_strictly(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    reply = client.messages.create(model=MODEL, max_tokens=4, messages=HI)
    assert reply.content[0].type == "text" and reply.usage.output_tokens >= 1
