"""Benchmark tools: workloads read exactly, forced lengths honoured by every backend, counts right,
and `bench serve` against a live Octavo server completes with zero failures. No timing assertions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from octavo.bench.serve import run_serve_benchmark, summarise
from octavo.bench.throughput import OutputCountError, _check, run_hf, run_hf_cb, run_octavo
from octavo.simulator.workload import SimRequest, trace_workload
from tests.live_server import API_KEY, MODEL

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "workloads" / "random_n64.json"
TINY = [SimRequest(0.0, (101, 202, 303, 404, 505), 3), SimRequest(0.0, tuple(range(700, 709)), 6),
        SimRequest(0.0, (9, 8, 7), 2)]


@pytest.mark.skipif(not SHARED.is_file(), reason="../shared/workloads is not beside this checkout")
def test_replay_reads_the_shared_workload_exactly():
    raw = json.loads(SHARED.read_text())
    work = trace_workload(SHARED)
    assert len(work) == raw["meta"]["n"] == 64
    assert [list(w.prompt_token_ids) for w in work] == [r["prompt_token_ids"] for r in raw["requests"]]
    assert [w.output_len for w in work] == [r["max_tokens"] for r in raw["requests"]]
    assert sum(len(w.prompt_token_ids) for w in work) == raw["meta"]["total_prompt_tokens"]
    assert sum(w.output_len for w in work) == raw["meta"]["total_output_tokens"]


def test_count_check_refuses_a_backend_that_stops_early():
    _check("x", [3, 4], [3, 4])
    with pytest.raises(OutputCountError, match=r"\(1, 4, 2\)"):
        _check("x", [3, 4], [3, 2])


def test_octavo_backend_honours_forced_lengths_and_reports_counts(smol_dir):
    r = run_octavo(TINY, {"kv_cache_memory": 64 << 20}, progress=False)
    assert r.num_requests == 3 and r.output_tokens == 11 and r.prompt_tokens == 17
    assert r.extra["prompt_tokens_computed"] == 17 and r.extra["preemptions"] == 0
    assert 0 < r.extra["mean_kv_utilisation"] <= 1 and r.peak_memory_bytes > 0


@pytest.mark.parametrize("backend", ["hf", "hf-cb"])
def test_transformers_backends_honour_forced_lengths(smol_dir, backend):
    r = run_hf(TINY, smol_dir, batch_size=2, progress=False) if backend == "hf" else run_hf_cb(TINY, smol_dir, progress=False)
    assert r.backend == backend and r.num_requests == 3 and r.output_tokens == 11


def test_bench_serve_against_a_live_octavo_server(live_server):
    work = [SimRequest(0.0, tuple(range(300 + 10 * i, 310 + 10 * i + i)), 4 + i % 3) for i in range(8)]
    records, duration = asyncio.run(run_serve_benchmark(
        live_server.url, work, model=MODEL, request_rate=20.0, max_concurrency=4, api_key=API_KEY, progress=False))
    s = summarise(records, duration)
    assert s["completed"] == 8 and s["failed"] == 0, s["errors"]
    assert s["output_tokens"] == sum(w.output_len for w in work)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = s[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]


def test_bench_serve_counts_failures(live_server):
    work = [SimRequest(0.0, (1, 2, 3), 2)]
    records, duration = asyncio.run(run_serve_benchmark(live_server.url, work, api_key="wrong", progress=False))
    s = summarise(records, duration)
    assert s["failed"] == 1 and "HTTP 401" in s["errors"][0]


def test_compare_runs_each_round_on_every_server_and_tabulates_medians(live_server):
    from octavo.bench.serve import compare_servers, format_comparison

    rounds = [[SimRequest(0.0, tuple(range(400 + 20 * r + i, 410 + 20 * r + i)), 3) for i in range(2)] for r in range(3)]
    warmup = [SimRequest(0.0, (5, 6, 7), 2)]
    targets = [("a", live_server.url), ("b", live_server.url.rstrip("/") + "/")]
    results = asyncio.run(compare_servers(targets, rounds, warmup, model=MODEL, api_key=API_KEY, progress=False))
    assert list(results) == ["a", "b"] and all(len(runs) == 3 for runs in results.values())
    assert all(s["completed"] == 2 and s["failed"] == 0 and s["output_tokens"] == 6 for runs in results.values() for s in runs)
    table = format_comparison(results)
    assert "| figure (median of 3) | a | b | a vs b |" in table and "failed requests: a: 0 of 6, b: 0 of 6" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    for name in ("output tok/s", "TTFT median", "TPOT median", "ITL p90", "E2E median", "prompt tokens computed (server)"):
        assert rows[name].endswith("x |"), rows[name]  # a ratio
    assert "cold TTFT median" not in rows  # no request of the workload is cold
    # the server's own counters over each run: 2 prompts of 10 tokens (and nothing reused: fresh prompts)
    assert all(s["server"]["prompt_tokens"] == 20 and s["server"]["hits"] == 0 for runs in results.values() for s in runs)


def test_comparison_table_medians_and_ratios():
    from octavo.bench.serve import format_comparison

    def summary(tok_s: float, ttft: float) -> dict:
        p = {"p50": ttft, "p90": ttft, "p99": ttft, "mean": ttft}
        return {"output_throughput": tok_s, "ttft_ms": p, "tpot_ms": p, "itl_ms": p, "e2e_ms": p,
                "failed": 0, "completed": 4}

    table = format_comparison({"fast": [summary(90, 10), summary(100, 12), summary(300, 11)],
                               "slow": [summary(50, 30), summary(40, 33), summary(45, 99)]})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["output tok/s"] == ["100.0", "45.0", "2.22x"]  # medians 100 and 45
    assert rows["TTFT median"] == ["11.0 ms", "33.0 ms", "3.00x"]  # latency ratio: other / first


def test_each_server_goes_first_in_as_many_rounds_as_the_others():
    from octavo.bench.serve import round_order

    orders = [round_order(["a", "b", "c"], r) for r in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(o[0] for o in orders) == ["a", "a", "b", "b", "c", "c"]


def test_bench_serve_prints_no_line_per_request(live_server):
    """`octavo bench serve` as a user runs it: its summary, without httpx's INFO line per request."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "octavo.cli", "bench", "serve", "--base-url", live_server.url,
                          "--model-name", MODEL, "--api-key", API_KEY, "--num-requests", "3", "--input-len", "8",
                          "--output-len", "4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HTTP Request" not in out.stdout + out.stderr
    assert "output tok/s" in out.stdout or "tok/s" in out.stdout, out.stdout[-2000:]


def test_one_users_comparison_reports_the_bandwidth_its_steps_reach(live_server, smol, monkeypatch):
    """With one request at a time, each round's summary has the bytes a decode step reads (the
    server's gauges: its weights as held + KV at mid-answer), that over the TPOT median, and the
    share of the machine's read floor (here a fixed 10 GB/s: the arithmetic, not this machine)."""
    from octavo.bench import serve
    from octavo.models.loader import decode_read_bytes

    monkeypatch.setattr(serve, "read_floor", lambda: 10e9)
    rounds = [[SimRequest(0.0, tuple(range(600 + 30 * r, 620 + 30 * r)), 6)] for r in range(2)]
    results = asyncio.run(serve.compare_servers([("a", live_server.url), ("b", live_server.url + "/")], rounds, [],
                                                model=MODEL, api_key=API_KEY, progress=False, max_concurrency=1))
    model, _, _ = smol
    kv_per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2: K and V, 30 layers, 3 KV heads of 64, float32
    want = decode_read_bytes(model) + kv_per_token * (20 + 3)
    for runs in results.values():
        for s in runs:
            assert s["step_read_bytes"] == pytest.approx(want, rel=1e-6)
            assert s["read_gbps"] == pytest.approx(want / (s["tpot_ms"]["p50"] / 1e3) / 1e9)
            assert s["floor_share"] == pytest.approx(s["read_gbps"] * 10)
    table = serve.format_comparison(results)
    assert "| decode read at TPOT median (one user) |" in table and "| share of the measured read floor |" in table
    assert f"one user's decode step reads {want / 1e6:,.1f} MB" in table and "floor 10.0 GB/s" in table


def test_a_server_without_the_gauges_gets_no_bandwidth_rows():
    from octavo.bench.serve import format_comparison

    p = {"p50": 10.0, "p90": 10.0, "p99": 10.0, "mean": 10.0}
    table = format_comparison({"x": [{"output_throughput": 1.0, "ttft_ms": p, "tpot_ms": p, "itl_ms": p, "e2e_ms": p,
                                      "failed": 0, "completed": 1}]})
    assert "decode read" not in table and "read floor" not in table
