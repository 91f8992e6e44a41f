"""Soak: 200 concurrent streaming clients against a server whose KV pool is small enough to queue
and preempt; mixed lengths, some n=2, some salted, 20% disconnecting mid-stream. Every stream that
completes carries exactly its tokens; afterwards nothing runs or waits, no block is held, and the
block pool's invariants hold (no leaked or double-freed block)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL, start_server, stop_server
from tests.server.test_openai_api import metrics

NUM_CLIENTS = 200
TOPICS = ["the sea", "a lighthouse keeper", "bread", "the number seven", "a red bicycle", "winter in Oslo",
          "an old map", "a clock that runs backwards"]
PROMPTS = [f"Write a short story about {t}." + " Make it vivid and surprising." * (i % 4) for i, t in enumerate(TOPICS)]
LENGTHS = [8, 32, 64]


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory, smol_dir):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    server = start_server(log, ["--api-key", API_KEY, "--num-kv-blocks", "80", "--max-num-seqs", "32",
                                "--max-model-len", "512", "--enable-debug-endpoints", "--log-interval", "5",
                                # admit greedily (vLLM's way) so that the pool runs out and preempts;
                                # the default headroom holds requests back and made preemption a matter of timing
                                "--admission-headroom-steps", "0"])
    yield server
    stop_server(server)


def plan(i: int) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": LENGTHS[i % 3], "n": 2 if i % 5 == 1 else 1,
            "salt": f"tenant-{i % 3}" if i % 4 == 2 else None, "disconnect": i % 5 == 4}


@pytest.mark.slow
def test_200_streaming_clients_with_disconnects_leave_nothing_behind(soak_server):
    url = soak_server.url
    before = metrics(url)

    async def reference(client, prompt, max_tokens):
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def one(client, i: int, refs) -> str:
        p = plan(i)
        extra = {"ignore_eos": True, **({"cache_salt": p["salt"]} if p["salt"] else {})}
        stream = await client.completions.create(model=MODEL, prompt=p["prompt"], max_tokens=p["max_tokens"],
                                                 n=p["n"], temperature=0, stream=True, extra_body=extra,
                                                 stream_options={"include_usage": True})
        texts, usage, num_chunks = [""] * p["n"], None, 0
        async for chunk in stream:
            num_chunks += 1
            for c in chunk.choices:
                texts[c.index] += c.text
            usage = chunk.usage or usage
            if p["disconnect"] and num_chunks == 3:
                await stream.close()
                return "disconnected"
        expected = refs[(p["prompt"], p["max_tokens"])]
        assert texts == [expected] * p["n"], f"client {i}: {texts} != {expected!r}"
        assert usage.completion_tokens == p["max_tokens"] * p["n"], f"client {i}: {usage}"
        return "completed"

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=900) as client:
            keys = sorted({(p["prompt"], p["max_tokens"]) for p in map(plan, range(NUM_CLIENTS))})
            texts = await asyncio.gather(*(reference(client, *k) for k in keys))
            refs = dict(zip(keys, texts))
            start = time.monotonic()
            results = await asyncio.gather(*(one(client, i, refs) for i in range(NUM_CLIENTS)))
            return results, time.monotonic() - start

    results, seconds = asyncio.run(main())
    assert results.count("disconnected") == NUM_CLIENTS // 5
    assert results.count("completed") == NUM_CLIENTS - NUM_CLIENTS // 5
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        report = httpx.get(f"{url}/debug/kv_cache", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
        if report["num_running"] == 0 and report["num_waiting"] == 0:
            break
        time.sleep(0.2)
    assert report["num_running"] == 0 and report["num_waiting"] == 0
    assert report["num_free_blocks"] == report["num_blocks"] and report["problems"] == []
    after = metrics(url)
    preemptions = after["octavo:num_preemptions_total{}"] - before.get("octavo:num_preemptions_total{}", 0)
    assert preemptions > 0  # the pool really was small enough to preempt
    assert after["octavo:kv_cache_usage_perc{}"] == 0.0
    assert httpx.get(f"{url}/health").status_code == 200
    print(f"\nsoak: {NUM_CLIENTS} clients, {results.count('completed')} completed exactly, "
          f"{results.count('disconnected')} disconnected, {int(preemptions)} preemptions, "
          f"0 blocks leaked of {report['num_blocks']}, {seconds:.1f} s")
