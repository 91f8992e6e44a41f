"""vLLM's server extensions its users send, on the live server and on a stub one: SageMaker's
/invocations (keyed like /v1), custom chat roles, chat echo, pydantic's error type in 400s,
--root-path, --enable-request-id-headers, --enable-force-include-usage."""

from __future__ import annotations

import json

import httpx
import openai

from tests.live_server import API_KEY, MODEL
from tests.server.scripted import scripted_engine, serve_in_thread

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def test_invocations_route_by_body_and_need_the_key(live_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    direct = httpx.post(f"{live_server.url}/v1/chat/completions", headers=HEADERS, json=chat).json()
    via = httpx.post(f"{live_server.url}/invocations", headers=HEADERS, json=chat).json()
    assert via["object"] == "chat.completion" and via["choices"] == direct["choices"]
    assert direct["system_fingerprint"].startswith("fp_") and via["system_fingerprint"] == direct["system_fingerprint"]
    done = httpx.post(f"{live_server.url}/invocations", headers=HEADERS, json={"prompt": "Hi", "max_tokens": 2}).json()
    assert done["object"] == "text_completion"
    vec = httpx.post(f"{live_server.url}/invocations", headers=HEADERS, json={"input": "Hi"}).json()
    assert vec["object"] == "list" and len(vec["data"][0]["embedding"]) == 576
    assert httpx.post(f"{live_server.url}/invocations", json=chat).status_code == 401
    assert httpx.post(f"{live_server.url}/score", json={"text_1": "a", "text_2": ["b"]}).status_code == 401


def test_custom_roles_echo_and_error_types(live_server):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0)
    texts = [client.chat.completions.create(model=MODEL, messages=[{"role": "my-custom-role", "content": c}],
                                            max_tokens=6, temperature=0).choices[0].message.content
             for c in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
    assert texts[0] == texts[1]
    said = "An apple a day keeps"
    r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "A saying?"}, {"role": "assistant", "content": said}],
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith(said) and len(r.choices[0].message.content) > len(said)
    bad = httpx.post(f"{live_server.url}/v1/completions", headers=HEADERS, json={"prompt": "x", "seed": 2**70})
    assert bad.status_code == 400 and "[type=less_than_equal]" in bad.json()["error"]["message"]


def test_root_path_request_ids_forced_usage_and_names(smol_dir, smol_tokenizer):
    with serve_in_thread(scripted_engine(smol_dir, smol_tokenizer, "Hello there."), root_path="/llm",
                         enable_request_id_headers=True, enable_force_include_usage=True) as url:
        for base in (url, f"{url}/llm"):
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                           headers={"X-Request-Id": "abc-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
        assert len(httpx.get(f"{url}/health").headers["x-request-id"]) == 32  # a new one
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert all(c["usage"] is not None for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 3
