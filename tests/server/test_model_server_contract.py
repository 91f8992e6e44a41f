"""`octavo serve --metrics-prefix vllm --kv-events-config ...`: what an endpoint picker (the Gateway
API inference extension, llm-d, KServe) and a KV-aware router (llm-d, Dynamo) read from vLLM,
read from Octavo, on a live server driven by the real openai client.

The metric table is the inference extension's model-server protocol
(kubernetes-sigs/gateway-api-inference-extension, docs/proposals/003-model-server-protocol: the
queue, KV utilisation under both of its names, lora_requests_info, cache_config_info) plus every
metric vLLM's own test expects on a text model (vllm tests/entrypoints/openai/test_metrics.py,
EXPECTED_METRICS_V1 less the deprecated ones it hides).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kv_events_subscriber import Subscriber
from tests.live_server import MODEL, start_server, stop_server

PROTOCOL = {  # name: (type, labels it must carry)
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:gpu_cache_usage_perc": ("gauge", ()),
    "vllm:lora_requests_info": ("gauge", ("max_lora", "running_lora_adapters", "waiting_lora_adapters")),
    "vllm:cache_config_info": ("gauge", ("block_size", "num_gpu_blocks")),
}
VLLM_EXPECTED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total", "vllm:cache_config_info", "vllm:request_success_total",
    *(f"vllm:{name}_{part}" for name in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for part in ("sum", "bucket", "count")),
]


@pytest.fixture(scope="module")
def contract_server(tmp_path_factory, smol_dir):
    tmp = tmp_path_factory.mktemp("contract")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp}/kv",
              "replay_endpoint": f"ipc://{tmp}/kv-replay", "topic": "kv", "hash_format": "bytes"}
    server = start_server(tmp / "server.log", [
        "--metrics-prefix", "vllm", "--enable-lora", "--max-loras", "2", "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps(events), "--kv-cache-memory", str(64 << 20), "--max-model-len", "1024"],
        threads=1)
    yield server, events
    stop_server(server)


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)}


def test_every_metric_the_picker_and_vllm_name_is_there_with_its_type_and_labels(contract_server):
    server, events = contract_server
    sub = Subscriber(events["endpoint"], events["replay_endpoint"], b"kv")
    sub.start(catch_up=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = "The history of the printing press begins in the fifteenth century, when " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt + "and", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert text
    got = families(server.url)
    samples = {s.name for f in got.values() for s in f.samples}
    # vLLM's test looks for each name in the text: a counter's samples add _total, a histogram's _bucket
    missing = [name for name in VLLM_EXPECTED if not {name, f"{name}_total", f"{name}_bucket"} & samples]
    assert not missing, missing
    for name, (kind, labels) in PROTOCOL.items():
        # prometheus_client's parser names a counter's family without _total; gauges keep their name
        assert name in got, f"{name} missing from /metrics"
        family = got[name]
        assert family.type == kind, (name, family.type)
        assert family.samples and all(set(labels) <= set(s.labels) for s in family.samples), (name, family.samples)
    info = got["vllm:cache_config_info"].samples[0].labels
    assert info["prefix_caching_hash_algo"] == "sha256_cbor" and info["block_size"] == "16"
    assert float(info["num_gpu_blocks"]) == got["vllm:kv_cache_num_blocks"].samples[0].value
    lora = got["vllm:lora_requests_info"].samples[0]
    assert lora.labels["max_lora"] == "2" and lora.value > 1.7e9  # a Unix time
    assert all(s.labels.get("engine") == "0" and s.labels.get("model_name") == MODEL
               for s in got["vllm:num_requests_running"].samples)
    success = sum(s.value for s in got["vllm:request_success"].samples if s.name == "vllm:request_success_total")
    assert success == 2
    prompt_tokens = {s.name: s.value for s in got["vllm:request_prompt_tokens"].samples}
    assert prompt_tokens["vllm:request_prompt_tokens_count"] == 2 and prompt_tokens["vllm:request_prompt_tokens_sum"] > 80
    hits = sum(s.value for s in got["vllm:prefix_cache_hits"].samples if s.name.endswith("_total"))
    assert hits >= 32  # the second prompt's shared full blocks
    # the KV events of those two requests reached an independent subscriber, hashes recomputable
    sub.wait_for(lambda s: len(s.index) >= hits // 16 and s.num_checked >= hits // 16, what="the stored blocks")
    assert all(m == "GPU" for m, _, _ in sub.index)
    assert sub.num_gaps == 0 and sub.bad_hashes == []
    sub.stop()
