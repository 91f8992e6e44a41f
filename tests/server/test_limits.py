"""Backpressure and disconnects on a live server: a full waiting queue answers 429 with Retry-After,
a client that gives up while its request waits frees it at once (not when it would have run), and
a body over the limit is refused with 413 even when streamed without a Content-Length."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.live_server import API_KEY, MODEL
from tests.server.conftest import FAULT_MAX_NUM_SEQS, FAULT_MAX_WAITING

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def kv(url: str) -> dict:
    return httpx.get(f"{url}/debug/kv_cache", headers=HEADERS, timeout=30).json()


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_full_queue_gets_429_and_clients_that_give_up_while_waiting_are_freed(fault_server):
    url = fault_server.url
    stop = threading.Event()
    producing = [threading.Event() for _ in range(FAULT_MAX_NUM_SEQS)]

    def long_stream(i: int) -> None:  # keeps one of the 16 running slots busy until told to leave
        body = {"model": MODEL, "prompt": f"Count to a thousand, {i}:", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
            for _ in r.iter_lines():
                producing[i].set()
                if stop.is_set():
                    return  # closing the connection mid-stream aborts the request

    streams = [threading.Thread(target=long_stream, args=(i,)) for i in range(FAULT_MAX_NUM_SEQS)]
    for t in streams:
        t.start()
    try:
        assert all(e.wait(60) for e in producing)
        outcomes: dict[int, str] = {}

        def impatient(i: int) -> None:  # 64 prompts that can only wait; the client gives up after 3 s
            body = {"model": MODEL, "prompt": [f"prompt {i}-{k}" for k in range(64)], "max_tokens": 4}
            try:
                httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=3)
                outcomes[i] = "answered"
            except httpx.TimeoutException:
                outcomes[i] = "timed out"

        waiters = [threading.Thread(target=impatient, args=(i,)) for i in range(4)]
        for t in waiters:
            t.start()
        wait_for(lambda: kv(url)["num_waiting"] == 256, 10, "256 waiting prompts")
        r = httpx.post(f"{url}/v1/completions", headers=HEADERS, timeout=30,
                       json={"model": MODEL, "prompt": ["one more"] * 64, "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert f"256 requests are already waiting (limit {FAULT_MAX_WAITING}; this request adds 64)" in r.json()["error"]["message"]
        for t in waiters:
            t.join(30)
        assert list(outcomes.values()) == ["timed out"] * 4
        # freed as soon as the clients left, while the 16 streams still hold every running slot
        report = wait_for(lambda: (rep := kv(url))["num_waiting"] == 0 and rep, 5, "the waiting queue to empty")
        assert report["num_running"] == FAULT_MAX_NUM_SEQS
    finally:
        stop.set()
        for t in streams:
            t.join(120)
    report = wait_for(lambda: (rep := kv(url))["num_running"] == 0 and rep, 30, "the streams to be aborted")
    assert report["num_free_blocks"] == report["num_blocks"] and report["problems"] == []


def test_a_body_over_the_limit_is_413_declared_or_streamed(fault_server):
    url = fault_server.url
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'", "max_tokens": 1}'
    r = httpx.post(f"{url}/v1/completions", content=big, headers={**HEADERS, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"

    # streamed without a Content-Length, just over the limit: refused when the last chunk arrives
    just_over = b'{"prompt": "' + b"a" * ((1 << 20) - 10) + b'", "max_tokens": 1}'

    def chunks():
        for i in range(0, len(just_over), 64 << 10):
            yield just_over[i : i + (64 << 10)]

    try:
        r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={**HEADERS, "Content-Type": "application/json"})
        assert r.status_code == 413
    except httpx.HTTPError:
        pytest.fail("the server should answer 413, not drop the connection")
    assert httpx.get(f"{url}/health").status_code == 200
