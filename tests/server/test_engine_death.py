"""An exception inside the model forward kills the engine: every running stream ends with an error
event and [DONE], every queued request (those that arrived during the failing step included) gets a
503 in the OpenAI shape, /health turns 503, and the process exits 1 unless asked to stay up."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.live_server import MODEL, start_server, stop_server

POISON = 7777
SCRIPT = str(Path(__file__).with_name("faulty_serve.py"))


def _stream_lines(url: str, body: dict, out: dict, key: str, first_chunk: threading.Event) -> None:
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        out[key + ":status"] = r.status_code
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first_chunk.set()
    out[key] = lines


def _post(url: str, body: dict, out: dict, key: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    out[key] = (r.status_code, r.json())


@pytest.mark.parametrize("keep_alive", [False, True])
def test_engine_death_fails_everything_clearly(tmp_path, smol_dir, monkeypatch, keep_alive):
    monkeypatch.setenv("OCTAVO_FAULT_DIR", str(tmp_path))
    flags = ["--kv-cache-memory", str(64 << 20), "--max-model-len", "512"]
    server = start_server(tmp_path / "server.log", flags + (["--keep-alive-on-engine-death"] if keep_alive else []),
                          entry=[sys.executable, SCRIPT])
    url, out, threads = server.url, {}, []
    try:
        long = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        started = [threading.Event() for _ in range(2)]
        for i in range(2):
            threads.append(threading.Thread(target=_stream_lines, args=(url, long, out, f"running{i}", started[i])))
            threads[-1].start()
        assert all(e.wait(60) for e in started)  # both streams are producing tokens
        poison = {"model": MODEL, "prompt": [POISON] * 4 + [1, 2], "max_tokens": 4}
        threads.append(threading.Thread(target=_post, args=(url, poison, out, "poison")))
        threads[-1].start()
        deadline = time.monotonic() + 60
        while not (tmp_path / "entered").exists():
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.05)
        # the failing step is stuck: these arrive while it runs and wait in the command queue
        queued = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        for i in range(3):
            threads.append(threading.Thread(target=_post, args=(url, queued, out, f"queued{i}")))
            threads[-1].start()
        threads.append(threading.Thread(target=_stream_lines,
                                        args=(url, {**queued, "stream": True}, out, "queued_stream", threading.Event())))
        threads[-1].start()
        time.sleep(1.0)
        (tmp_path / "release").touch()
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a request hung after the engine died"

        for i in range(2):  # running streams: an error event, then [DONE]
            lines = out[f"running{i}"]
            assert lines[-1] == "data: [DONE]", lines[-3:]
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["code"] == 503 and "injected fault" in error["message"]
        for key in ("poison", "queued0", "queued1", "queued2"):
            status, body = out[key]
            assert status == 503 and body["error"]["type"] == "ServiceUnavailableError", (key, body)
        assert out["queued_stream:status"] == 503
        if keep_alive:
            assert httpx.get(f"{url}/health").status_code == 503
            r = httpx.post(f"{url}/v1/completions", json=queued, timeout=30)
            assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
            assert server.process.poll() is None
        else:
            assert server.process.wait(60) == 1, server.log_text()[-3000:]
            assert "engine died; shutting the server down" in server.log_text()
    finally:
        stop_server(server)
