"""An idle `octavo serve` with the default 4 GiB KV pool holds under 1 GiB resident: the pool's
pages are taken as requests first write them (octavo.model_runner.allocate_kv_caches)."""

from __future__ import annotations

import re

import httpx

from tests.live_server import API_KEY, MODEL, start_server, stop_server


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_idle_server_with_the_default_pool_holds_under_1_gib(tmp_path, smol_dir):
    server = start_server(tmp_path / "server.log", ["--api-key", API_KEY])  # default KV pool
    try:
        pool = re.search(r"KV cache: \d+ blocks x \d+ tokens = \d+ tokens, ([\d.]+) GiB", server.log_text())
        assert pool is not None, server.log_text()
        assert float(pool.group(1)) >= 2.0, "the default pool is small here: this test would prove nothing"
        r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                       json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        rss = _rss_bytes(server.process.pid)
        assert rss < 1 << 30, f"idle server holds {rss / 2**30:.2f} GiB resident with a {pool.group(1)} GiB pool"
    finally:
        stop_server(server)
