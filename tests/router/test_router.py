"""`octavo router` in front of two live `octavo serve` replicas (one thread each), through the real
openai client: cache-aware routing keeps every request of a prefix on one replica and round-robin
does not; streams pass through; a killed replica's traffic moves to the other."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL, free_port, start_server, stop_server, wait_healthy

A = "You are a helpful assistant for the lighthouse museum; answer briefly and kindly. " * 6
B = "Translate the following paragraph into French, keeping every proper name as it is. " * 6


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, smol_dir):
    servers = [
        start_server(tmp_path_factory.mktemp(f"replica{i}") / "server.log",
                     ["--api-key", API_KEY, "--kv-cache-memory", str(96 << 20), "--max-model-len", "512",
                      "--shutdown-timeout", "2"], threads=1)
        for i in range(2)
    ]
    yield servers
    for s in servers:
        stop_server(s)


def start_router(replicas, policy: str, log_path, *flags: str):
    port = free_port()
    cmd = [sys.executable, "-m", "octavo.cli", "router", "--policy", policy, "--port", str(port),
           "--health-interval", "0.5", *flags, *[a for r in replicas for a in ("--worker", r.url)]]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, lambda: log_path.read_text())
    return proc, url


def counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'octavo_router_requests_total\{worker="([^"]+)"\} (\S+)', text)}


def ask(client, prompt: str, stream: bool = False) -> str:
    if stream:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0).choices[0].text


@pytest.mark.parametrize("policy", ["cache-aware", "round-robin"])
def test_prefixes_stay_together_only_with_cache_aware(replicas, tmp_path, policy):
    proc, url = start_router(replicas, policy, tmp_path / "router.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        per_prefix = {}
        for name, prefix in (("A", A), ("B", B)):
            before = counts(url)
            for i in range(4):
                assert ask(client, prefix + f"Question {i}?", stream=i % 2 == 1)
            after = counts(url)
            per_prefix[name] = sorted(after.get(r.url, 0) - before.get(r.url, 0) for r in replicas)
        if policy == "cache-aware":
            assert per_prefix == {"A": [0, 4], "B": [0, 4]}
        else:
            assert per_prefix == {"A": [2, 2], "B": [2, 2]}
        assert {m.id for m in client.models.list().data} == {MODEL}
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_killed_replica_is_routed_around(tmp_path, smol_dir):
    servers = [start_server(tmp_path / f"r{i}.log", ["--max-model-len", "256", "--kv-cache-memory", str(64 << 20)],
                            threads=1) for i in range(2)]
    proc, url = start_router(servers, "cache-aware", tmp_path / "router.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        ask(client, A + "first")
        home = max(servers, key=lambda s: counts(url).get(s.url, 0))
        home.process.kill()
        home.process.wait(10)
        for i in range(3):  # the prefix's replica is gone: the other one answers
            assert ask(client, A + f"after {i}")
        other = next(s for s in servers if s is not home)
        assert counts(url).get(other.url, 0) >= 3
        deadline = time.time() + 10
        while time.time() < deadline and httpx.get(f"{url}/workers", timeout=5).json()["workers"][servers.index(home)]["healthy"]:
            time.sleep(0.2)
        assert not httpx.get(f"{url}/workers", timeout=5).json()["workers"][servers.index(home)]["healthy"]
    finally:
        proc.terminate()
        proc.wait(10)
        for s in servers:
            stop_server(s)


def test_a_client_disconnect_aborts_the_request_at_the_replica(replicas, tmp_path):
    proc, url = start_router(replicas, "round-robin", tmp_path / "router.log")
    try:
        body = {"model": MODEL, "prompt": B, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            next(r.iter_lines())  # the stream has started; now the client goes away
        closed = time.time()
        while sum(running_requests(s.url) for s in replicas) and time.time() < closed + 10:
            time.sleep(0.1)
        # aborted: 400 tokens take over 4 s here (>= 10 ms a token), the abort well under 2.5 s
        assert sum(running_requests(s.url) for s in replicas) == 0 and time.time() - closed < 2.5
    finally:
        proc.terminate()
        proc.wait(10)


def running_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r'^octavo:num_requests_running\{[^}]*\} (\S+)', text, re.M))


# ---- issue 20: a replica or client cannot hold the router up ------------------------------------

MALFORMED = [b"{not json", b'{"messages": 5, "max_tokens": 2}', b'{"messages": [1, [2]], "max_tokens": 2}',
             b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}], "max_tokens": 2}',
             b'{"prompt": {"a": [1]}, "max_tokens": 2}', b"[1, 2, 3]", b'"just a string"']


def test_bodies_the_router_cannot_read_get_the_replicas_own_answer(replicas, tmp_path):
    proc, url = start_router(replicas, "cache-aware", tmp_path / "router.log")
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    try:
        for route in ("/v1/completions", "/v1/chat/completions"):
            for body in MALFORMED:
                direct = httpx.post(f"{replicas[0].url}{route}", content=body, headers=headers, timeout=60)
                routed = httpx.post(f"{url}{route}", content=body, headers=headers, timeout=60)
                assert direct.status_code == 400 and routed.status_code == 400, (body, routed.text)
                assert routed.json()["error"]["message"] == direct.json()["error"]["message"]
        deep = b'{"prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
        r = httpx.post(f"{url}/v1/completions", content=deep, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "x"
        big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'  # over the router's 4 MiB: never read whole
        r = httpx.post(f"{url}/v1/completions", content=big, headers=headers, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_hung_replica_and_clients_that_give_up_do_not_stop_the_router(replicas, tmp_path):
    """One replica stops (SIGSTOP: its socket accepts, nothing answers, /health included) while
    clients that give up after 1 s keep sending; the other replica's traffic goes on, and once the
    health check takes the hung one out every request is answered (was: 503 for everyone)."""
    proc, url = start_router(replicas, "round-robin", tmp_path / "router.log", "--max-connections-per-replica", "4")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    hung = replicas[0]
    try:
        hung.process.send_signal(signal.SIGSTOP)
        impatient = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=1.0)
        answered = 0
        for i in range(12):
            try:
                ask(impatient, f"Impatient question {i}?")
                answered += 1
            except (openai.APITimeoutError, openai.APIConnectionError):
                pass
        assert answered >= 1  # the healthy replica's share got through meanwhile
        # the abandoned requests' upstream connections were closed, not left waiting on the hung
        # replica (at most the health check's own probe is open there)
        hung_port = int(hung.url.rsplit(":", 1)[1])
        deadline = time.time() + 10
        while time.time() < deadline and established_to(hung_port) > 1:
            time.sleep(0.2)
        assert established_to(hung_port) <= 1
        deadline = time.time() + 30
        while time.time() < deadline and httpx.get(f"{url}/workers", timeout=10).json()["workers"][0]["healthy"]:
            time.sleep(0.2)
        assert not httpx.get(f"{url}/workers", timeout=10).json()["workers"][0]["healthy"]
        for i in range(6):
            assert ask(client, f"Patient question {i}?")
    finally:
        hung.process.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(10)
    wait_healthy(hung.url, hung.process, lambda: hung.log_text(), 60)


def established_to(port: int) -> int:
    """Open (ESTABLISHED) IPv4 TCP connections whose far end is 127.0.0.1:port."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        if state == "01" and int(remote.split(":")[1], 16) == port:
            count += 1
    return count


def test_kv_events_routing_meets_a_prefix_sent_as_chat_and_as_rendered_text(tmp_path, smol_dir):
    """Two replicas publishing KV events; the router on kv-events tokenizes as they do. A chat
    request fills one replica with a system prompt's blocks; the same conversation rendered by the
    client through the chat template and sent as a plain completion shares no text with the chat
    body but all its tokens: it goes to that replica and hits its cache there."""
    import json

    from octavo.models.loader import resolve_model
    from octavo.tokenizer import load_tokenizer

    servers, endpoints = [], []
    for i in range(2):
        pub, replay = f"ipc://{tmp_path}/kv{i}", f"ipc://{tmp_path}/kv{i}-replay"
        conf = {"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay}
        servers.append(start_server(tmp_path / f"r{i}.log", [
            "--max-model-len", "512", "--kv-cache-memory", str(64 << 20), "--prefix-caching-hash-algo", "sha256_cbor",
            "--kv-events-config", json.dumps(conf)], threads=1))
        endpoints += ["--kv-events-endpoint", f"{pub},{replay}"]
    proc, url = start_router(servers, "kv-events", tmp_path / "router.log", *endpoints, "--kv-events-sent-ttl", "0.5")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        system = {"role": "system", "content": A}
        client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "When does it open?"}],
                                       max_tokens=2, temperature=0)
        home = max(servers, key=lambda s: counts(url).get(s.url, 0))
        deadline = time.monotonic() + 60  # the replica's events reach the router after its prefill
        while time.monotonic() < deadline:
            workers = {w["url"]: w for w in httpx.get(f"{url}/workers", timeout=5).json()["workers"]}
            if workers[home.url]["kv_blocks"] >= 5:
                break
            time.sleep(0.2)
        assert workers[home.url]["kv_blocks"] >= 5, workers
        tokenizer = load_tokenizer(resolve_model(None))
        rendered = tokenizer.apply_chat_template([system, {"role": "user", "content": "Is there a café?"}],
                                                 tokenize=False, add_generation_prompt=True)
        before = hits(home.url)
        time.sleep(1)  # past the router's memory of what it sent (0.5 s): only the published blocks can decide
        client.completions.create(model=MODEL, prompt=rendered, max_tokens=2, temperature=0,
                                  extra_body={"add_special_tokens": False})
        assert counts(url).get(home.url, 0) == 2 and hits(home.url) - before >= 5 * 16
        assert httpx.get(f"{url}/workers", timeout=5).json()["hashing_differently"] == []
    finally:
        proc.terminate()
        proc.wait(10)
        for s in servers:
            stop_server(s)


def hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r'^octavo:prefix_cache_hits_total\{[^}]*\} (\S+)', text, re.M))
