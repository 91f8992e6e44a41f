"""A live `octavo serve` on 127.0.0.1 at a free port, shared by the server and bench tests of a session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, read_log, timeout_s: float = 180) -> None:
    """Poll /health until 200; fail with the server's log if it exits or never gets there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{read_log()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{read_log()}")


def start_server(log: Path, flags: list[str], entry: list[str] | None = None, threads: int = 2,
                 exact: bool = True) -> LiveServer:
    """`octavo serve` (or `entry`, a script taking the same flags) on a free port; healthy on return.
    `threads`: its torch threads (one each when several servers share the two cores). `exact`: the
    exact path pinned (--activation-dtype float32, --kv-cache-dtype float32) unless the flags name
    them: the defaults, auto, pick int8 activations on some CPUs and a float16 cache, and server tests
    compare greedy text with offline engines of the exact path; a test of what a user gets by
    default passes exact=False."""
    if exact and "--activation-dtype" not in flags:
        flags = ["--activation-dtype", "float32", *flags]
    if exact and "--kv-cache-dtype" not in flags:
        flags = ["--kv-cache-dtype", "float32", *flags]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    cmd = (entry or [sys.executable, "-m", "octavo.cli", "serve"]) + ["--port", str(port), *flags]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, lambda: log.read_text())
    return LiveServer(url, proc, log)


def stop_server(server: LiveServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(60)
        except subprocess.TimeoutExpired:
            server.process.kill()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory, smol_dir):  # smol_dir: the embedded model is converted before start
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = start_server(log, ["--api-key", API_KEY, "--kv-cache-memory", str(256 << 20),
                                "--max-model-len", str(MAX_MODEL_LEN), "--log-interval", "1", "--shutdown-timeout", "5"])
    yield server
    stop_server(server)
