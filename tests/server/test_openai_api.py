"""The OpenAI-compatible server, driven by the real `openai` client against a live `octavo serve`."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from octavo.sampling.params import SamplingParams
from tests.live_server import API_KEY, MAX_MODEL_LEN, MODEL, free_port, wait_healthy

KEYED = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    """Flat {sample name + sorted labels: value} of the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_greedy_completion_equals_offline_generate(client, make_llm):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    offline = make_llm().generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    (choice,) = resp.choices
    assert choice.text == offline.outputs[0].text
    assert choice.finish_reason == offline.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert resp.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_completion_concatenates_to_the_full_text_with_usage(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len([c for c in chunks if c.choices]) > 3  # it really streamed


def test_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == resp.choices[0].message.content


def test_n_2_stop_strings_and_seeds(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=5)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: reproducible
    other = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=6)
    assert [c.text for c in other.choices] != [c.text for c in resp.choices]

    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free.split()[2]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[: free.index(stop)]


def test_logprobs_are_present_and_consistent(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens) == resp.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and max(top.values()) == pytest.approx(logprob, abs=1e-5)
    # logprobs 0: the sampled token's own entry (OpenAI's), not an empty one
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0).choices[0].logprobs
    assert [list(top) for top in zero.top_logprobs] == [[t] for t in zero.tokens]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)


def test_sampling_extensions_and_usage_counts(client, live_server):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.8, top_p=0.9, seed=1,
                                     presence_penalty=0.5, frequency_penalty=0.5,
                                     extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
                                                 "min_tokens": 10, "ignore_eos": True, "cache_salt": "s"})
    assert resp.usage.completion_tokens == 10 and resp.choices[0].finish_reason == "length"
    count = httpx.post(f"{live_server.url}/tokenize", json={"prompt": PROMPT}, headers=KEYED).json()["count"]
    assert resp.usage.prompt_tokens == count


@pytest.mark.parametrize(
    "kwargs, status, needle",
    [
        ({"prompt": "word " * 1100}, 400, f"maximum context length is {MAX_MODEL_LEN} tokens, but the prompt has"),
        ({"prompt": "x" * (MAX_MODEL_LEN * 200)}, 400, "characters, more than that many tokens can hold"),
        ({"prompt": PROMPT, "temperature": -1}, 400, "temperature: Input should be greater than or equal to 0"),
        ({"prompt": PROMPT, "top_p": 7}, 400, "top_p: Input should be less than or equal to 1"),
        ({"prompt": PROMPT, "max_tokens": 5000}, 400, "exceeds max_model_len"),
        ({"prompt": PROMPT, "model": "no-such-model"}, 404, "does not exist"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_still_answers(client, kwargs, status, needle):
    kwargs = {"model": MODEL, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**kwargs)
    assert info.value.status_code == status
    assert needle in info.value.message
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens > 0


def test_missing_api_key_and_malformed_json(live_server):
    url = live_server.url
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x", "max_tokens": ', headers=headers)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"max_tokens": 3}, headers=headers)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/health").status_code == 200


def test_models_version_tokenize_detokenize(client, live_server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{live_server.url}/version").json()["version"]
    tok = httpx.post(f"{live_server.url}/tokenize", json={"prompt": PROMPT}, headers=KEYED).json()
    back = httpx.post(f"{live_server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=KEYED).json()
    assert back["prompt"] == PROMPT and tok["max_model_len"] == MAX_MODEL_LEN


def test_32_streams_with_a_quarter_disconnecting_free_every_block(live_server):
    url = live_server.url
    prompts = [f"Write a short story about the number {i}." for i in range(4)]
    sync = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    expected = [sync.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    before = metrics(url)

    async def one(i: int, aclient: openai.AsyncOpenAI) -> str | None:
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i % 4], max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        text = ""
        async for n, chunk in _enumerate(stream):
            text += chunk.choices[0].text if chunk.choices else ""
            if i % 4 == 3 and n == 2:
                await stream.close()  # disconnect mid-stream
                return None
        return text

    async def main() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(i, aclient) for i in range(32)))

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 4 == 3:
            assert text is None
        else:
            assert text == expected[i % 4], f"stream {i} differs"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = metrics(url)
        if after["octavo:num_requests_running{}"] == 0 and after["octavo:kv_cache_usage_perc{}"] == 0:
            break
        time.sleep(0.5)
    assert after["octavo:num_requests_running{}"] == 0 and after["octavo:num_requests_waiting{}"] == 0
    assert after["octavo:kv_cache_usage_perc{}"] == 0.0  # no block is held after the disconnects
    ok = after["octavo:request_success_total{finished_reason=length}"] - before.get("octavo:request_success_total{finished_reason=length}", 0)
    assert ok == 24
    assert after["octavo:generation_tokens_total{}"] - before["octavo:generation_tokens_total{}"] >= 24 * 16


async def _enumerate(stream):
    n = 0
    async for chunk in stream:
        yield n, chunk
        n += 1


def test_metrics_parse_and_count_the_requests_made(client, live_server):
    before = metrics(live_server.url)
    usage = [client.completions.create(model=MODEL, prompt=PROMPT + str(i), max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True}).usage for i in range(3)]
    after = metrics(live_server.url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("octavo:request_success_total{finished_reason=length}") == 3
    assert delta("octavo:generation_tokens_total{}") == sum(u.completion_tokens for u in usage) == 9
    assert delta("octavo:e2e_request_latency_seconds_count{}") == 3
    assert delta("octavo:time_to_first_token_seconds_count{}") == 3
    assert delta("octavo:request_queue_time_seconds_count{}") == 3
    assert delta("octavo:inter_token_latency_seconds_count{}") == 6
    assert delta("octavo:prompt_tokens_total{}") + delta("octavo:prefix_cache_hits_total{}") >= sum(u.prompt_tokens for u in usage)
    for name in ("octavo:prefix_cache_queries_total{}", "octavo:num_preemptions_total{}", "octavo:kv_cache_usage_perc{}"):
        assert name in after
    assert "prompt throughput" in live_server.log_text()  # the periodic log line while busy


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_0(smol_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "octavo.cli", "serve", "--port", str(port),
                             "--kv-cache-memory", str(64 << 20)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, lambda: proc.stdout.read().decode() if proc.poll() is not None else "")
    sync = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = sync.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    proc.send_signal(signal.SIGTERM)  # in the middle of the stream
    rest = list(chunks)
    finish = [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1]
    assert finish == "length"  # the in-flight request was allowed to finish
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode()[-2000:]
    # the proof that the stream was in flight when the signal came: the server counted it then
    assert b"shutdown requested (signal 15): 1 requests in flight" in out, out.decode()[-2000:]
    assert len([c for c in rest if c.choices and c.choices[0].text]) > 0  # and tokens still came after it
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)  # and it no longer accepts connections


def test_beam_search_completion_equals_offline_beam_search(client, make_llm):
    """vLLM's fields: use_beam_search with n = the beam width returns the n best beams, best first."""
    from octavo.sampling.params import BeamSearchParams

    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3,
                                     extra_body={"use_beam_search": True, "length_penalty": 0.5})
    offline = make_llm().beam_search(PROMPT, BeamSearchParams(3, max_tokens=12, length_penalty=0.5), use_tqdm=False)[0]
    assert [c.text for c in resp.choices] == [c.text for c in offline.outputs]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in offline.outputs)


@pytest.mark.parametrize("extra, param", [
    (dict(stream=True), "stream"), (dict(n=11), "n"), (dict(temperature=0.7), "temperature"), (dict(logprobs=2), "logprobs"),
])
def test_beam_search_refusals_name_the_field(client, extra, param):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"use_beam_search": True}) | extra
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs)
    assert err.value.body["param"] == param


def test_logit_bias_forces_a_token_and_out_of_range_is_refused(client, smol_tokenizer):
    token = smol_tokenizer.encode(" blue")[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     logit_bias={str(token): 100}, logprobs=0)
    assert resp.choices[0].logprobs.tokens == [smol_tokenizer.decode([token])] * 5
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={str(token): 150})
    assert err.value.body["param"] == "logit_bias"


def test_prompt_cache_key_is_accepted_and_bounded(client, live_server):
    # the openai client's own parameter (OpenAI: requests of one key share a prefix)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, prompt_cache_key="support-bot-v2")
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="prompt_cache_key"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_cache_key": "k" * 1025})
    names = metrics(live_server.url)
    assert "octavo:num_repreemptions_total{}" in names and "octavo:num_resumed_total{}" in names
