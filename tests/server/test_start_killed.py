"""A first start killed at any point, then started again, serves (issue 20): killed while converting
the model (SIGKILL), stopped while compiling the kernels (SIGTERM: it leaves at once and takes its
compiler with it) while a second server waits for that build and then builds itself, and killed
while serving. Each start after a kill serves the same greedy text as the session's server.

The cache is new and empty, so this test converts the model and compiles the kernels once
(~25 s on two idle cores); each deadline holds at 3x the usual time on a busy machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.live_server import API_KEY, MODEL, free_port, wait_healthy

pytestmark = pytest.mark.slow
PROMPT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


class Start:
    """One `octavo serve` on a cache directory, its log in a file."""

    def __init__(self, cache: Path, log: Path) -> None:
        self.port, self.log = free_port(), log
        env = {**os.environ, "OCTAVO_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as fh:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "octavo.cli", "serve", "--port", str(self.port), "--api-key", API_KEY,
                 "--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
                 "--activation-dtype", "float32", "--kv-cache-dtype", "float32"],  # compared with the exact path's
                stdout=fh, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, line: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while line not in self.text():
            assert self.process.poll() is None, f"the server exited before logging {line!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {line!r} in the log after {timeout_s:.0f} s:\n{self.text()}"
            time.sleep(0.2)

    def healthy(self, timeout_s: float) -> None:
        wait_healthy(self.url, self.process, self.text, timeout_s)

    def answer(self) -> str:
        r = httpx.post(f"{self.url}/v1/completions", json=PROMPT, headers=HEADERS, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _compilers_of(cache: Path) -> set[int]:
    """Pids of processes whose command line names a file in `cache` (the compiler of its build)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(cache).encode() in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_start_killed_at_any_point_then_started_again_serves(tmp_path, live_server):
    expected = httpx.post(f"{live_server.url}/v1/completions", json=PROMPT, headers=HEADERS, timeout=120).json()
    expected = expected["choices"][0]["text"]
    cache = tmp_path / "cache"
    starts: list[Start] = []
    try:
        # 1. SIGKILL while the model is converted: a temporary folder is all it leaves
        first = Start(cache, tmp_path / "first.log")
        starts.append(first)
        first.wait_for("converting", 180)
        first.kill()

        # 2. Two starts; the first compiles, the second waits for its lock. SIGTERM to the first:
        # it exits at once, its compiler with it, and the second builds and serves.
        second = Start(cache, tmp_path / "second.log")
        starts.append(second)
        second.wait_for("compiling Octavo's CPU kernels", 300)
        third = Start(cache, tmp_path / "third.log")
        starts.append(third)
        third.wait_for("waiting for the CPU kernel build", 120)
        compilers = _compilers_of(cache / "kernels") - {third.process.pid}
        assert compilers, "the compile of the second start was not seen"
        second.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert second.process.wait(30) == 0, second.text()
        assert time.monotonic() - start < 10, f"stopping a starting server took {time.monotonic() - start:.1f} s"
        assert "stopped while starting" in second.text()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in compilers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in compilers if _alive(p)], "the stopped start left its compiler running"
        third.healthy(600)
        assert "removed 1 unfinished build" in third.text()  # the stopped start's half build
        assert third.answer() == expected

        # 3. SIGKILL while serving; the next start takes the cached kernels and model as they are
        third.kill()
        fourth = Start(cache, tmp_path / "fourth.log")
        starts.append(fourth)
        fourth.healthy(180)
        assert "compiling" not in fourth.text() and "converting" not in fourth.text(), fourth.text()
        assert fourth.answer() == expected
        # the default quantized start never needed the 538 MB of float32 weights
        assert not list((cache / "models").glob("*/model.safetensors"))
    finally:
        for s in starts:
            s.kill()
