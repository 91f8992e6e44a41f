"""LoRA on `octavo serve`, through the real openai client: the `model` field selects an adapter,
/v1/models lists them, adapters load and unload at run time behind --allow-runtime-lora-updating,
and an adapter's completion equals transformers + peft."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL, start_server, stop_server
from tests.lora.conftest import PROMPTS

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, smol_dir, adapters):
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    alpha = adapters["alpha"][0]
    server = start_server(log, [
        "--api-key", API_KEY, "--kv-cache-memory", str(128 << 20), "--max-model-len", "512",
        "--enable-lora", "--max-loras", "2", "--lora-modules", f"alpha={alpha.lora_path}",
        "--allow-runtime-lora-updating", "--shutdown-timeout", "5",
    ])
    yield server
    stop_server(server)


def complete(client, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": 16}).choices[0].text


def test_adapters_by_model_name_load_and_unload(lora_server, adapters, smol_tokenizer):
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL, "alpha"} and listed["alpha"].parent == MODEL

    def expected(name: str) -> str:
        return smol_tokenizer.decode(adapters[name][1][0], skip_special_tokens=True)

    assert complete(client, "alpha", PROMPTS[0]) == expected("alpha")
    assert complete(client, MODEL, PROMPTS[0]) == smol_tokenizer.decode(adapters[None][1][0], skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError):
        complete(client, "beta", PROMPTS[0])

    beta = adapters["beta"][0]
    r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", headers=HEADERS,
                   json={"lora_name": "beta", "lora_path": beta.lora_path}, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(client, "beta", PROMPTS[0]) == expected("beta")
    assert {m.id for m in client.models.list().data} == {MODEL, "alpha", "beta"}

    bad = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", headers=HEADERS,
                     json={"lora_name": "nothing", "lora_path": "/no/such/dir"}, timeout=60)
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]

    r = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "beta"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "beta", PROMPTS[0])
    gone = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "beta"}, timeout=60)
    assert gone.status_code == 404


def test_runtime_updates_are_off_without_the_flag(live_server):
    r = httpx.post(f"{live_server.url}/v1/load_lora_adapter", headers=HEADERS,
                   json={"lora_name": "x", "lora_path": "/tmp"}, timeout=30)
    assert r.status_code == 404


def test_concurrent_loads_and_malformed_adapters(lora_server, adapters, smol_tokenizer, tmp_path):
    """Issue 20: loads at the same moment took the same id (one failed, or both claimed the name), and
    a malformed adapter file was a 500. Now each load gets its own id, one of two loads of one
    name wins, and a malformed file is a 400 that names the problem."""
    import asyncio

    beta = adapters["beta"][0]
    url = f"{lora_server.url}/v1/load_lora_adapter"

    async def load_all(bodies):
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(url, json=b, headers=HEADERS) for b in bodies))

    names = [f"b{i}" for i in range(4)]
    replies = asyncio.run(load_all([{"lora_name": n, "lora_path": beta.lora_path} for n in names] +
                                   [{"lora_name": "dup", "lora_path": beta.lora_path}] * 2))
    assert [r.status_code for r in replies[:4]] == [200] * 4, [r.text for r in replies]
    assert sorted(r.status_code for r in replies[4:]) == [200, 400]
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert {*names, "dup"} <= {m.id for m in client.models.list().data}
    expected = smol_tokenizer.decode(adapters["beta"][1][0], skip_special_tokens=True)
    for name in (names[0], names[-1], "dup"):
        assert complete(client, name, PROMPTS[0]) == expected
    for name in [*names, "dup"]:
        r = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": name}, timeout=60)
        assert r.status_code == 200, r.text
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("[1, 2]")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    r = httpx.post(url, headers=HEADERS, json={"lora_name": "broken", "lora_path": str(broken)}, timeout=60)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
