"""Online benchmark against any OpenAI-compatible server: arrivals, concurrency, streamed latencies.

Requests go to POST {base_url}/v1/completions with the prompt as token ids (text for code-edit), max_tokens and
ignore_eos (so every server does the same work), stream=true. Per request: TTFT (first text),
ITL (gaps between streamed chunks with text), TPOT ((end - first token) / (tokens - 1)), E2E.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from octavo.simulator.simulator import percentiles
from octavo.simulator.workload import SimRequest


@dataclass(slots=True)
class RequestRecord:
    ok: bool
    start: float
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None
    cold: bool = False  # the workload marked it cold (a prefix nobody else has): reported apart

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def _one(client: httpx.AsyncClient, url: str, model: str | None, w: SimRequest, headers: dict) -> RequestRecord:
    prompt = w.prompt_text if w.prompt_text is not None else list(w.prompt_token_ids)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": w.output_len, "temperature": 0,
                            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    rec = RequestRecord(ok=False, start=start, cold=w.cold)
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("usage"):
                    rec.output_tokens = data["usage"].get("completion_tokens", rec.output_tokens)
                if data.get("choices") and data["choices"][0].get("text"):
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    rec.chunk_times.append(now)
                    last = now
        rec.e2e = time.perf_counter() - start
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "no text was streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def run_serve_benchmark(
    base_url: str, workload: list[SimRequest], model: str | None = None, request_rate: float = float("inf"),
    burstiness: float = 1.0, max_concurrency: int | None = None, api_key: str | None = None, seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send the workload (gamma inter-arrivals of mean 1/rate; Poisson at burstiness 1); returns the
    records in workload order and the wall time of the whole run."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(workload), desc="bench serve", unit="req", disable=not progress)
    timeout = httpx.Timeout(None, connect=30.0)
    # A fresh connection per request: llama-server closes idle keep-alive connections, and a request
    # sent on one that it just closed fails with "Server disconnected without sending a response"
    # (seen: 4 of 24 llama.cpp requests failed that way, none once connections were not reused).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def guarded(w: SimRequest) -> RequestRecord:
            if limit is None:
                rec = await _one(client, url, model, w, headers)
            else:
                async with limit:
                    rec = await _one(client, url, model, w, headers)
            bar.update(1)
            return rec

        start = time.perf_counter()
        tasks = []
        for w in workload:
            tasks.append(asyncio.create_task(guarded(w)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


# the server counters a run reads (Octavo's names, found under either prefix of --metrics-prefix;
# a server without them reports n/a)
_COUNTERS = {
    "prompt_tokens": "octavo:prompt_tokens_total",
    "queries": "octavo:prefix_cache_queries_total",
    "hits": "octavo:prefix_cache_hits_total",
    "tier_hits": "octavo:kv_tier_hits_total",
    "preemptions": "octavo:num_preemptions_total",
    "recomputed": "octavo:recomputed_tokens_total",
    "repreemptions": "octavo:num_repreemptions_total",
    "load_wait_s": "octavo:kv_tier_load_wait_seconds_sum",
    "num_loading": "octavo:kv_tier_load_wait_seconds_count",
    "draft_tokens": "octavo:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "octavo:spec_decode_num_accepted_tokens_total",
    "drafts": "octavo:spec_decode_num_drafts_total",
}


async def scrape_counters(client: httpx.AsyncClient, base_url: str, headers: dict) -> dict[str, float]:
    """The server's counters of _COUNTERS (summed over label sets); empty if it has no /metrics."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    found: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        name = name.split("{", 1)[0]
        if name.startswith("vllm:"):
            name = "octavo:" + name[len("vllm:"):]
        for key, metric in _COUNTERS.items():
            if name == metric:
                found[key] = found.get(key, 0.0) + float(value)
    return found


_READ_GAUGES = {"weight_bytes": "octavo:decode_weight_bytes", "kv_bytes_per_token": "octavo:kv_bytes_per_token"}


async def scrape_read_bytes(client: httpx.AsyncClient, base_url: str, headers: dict) -> dict[str, float]:
    """What one of the server's decode steps reads (an Octavo server's gauges): weight_bytes and
    kv_bytes_per_token; empty for a server without them."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for line in resp.text.splitlines() if resp.status_code == 200 else ():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in _READ_GAUGES.items():
            if name == metric and " " in line:
                found[key] = float(line.rsplit(" ", 1)[1])
    return found if len(found) == len(_READ_GAUGES) else {}


def one_user_step_bytes(read: dict[str, float], workload: list[SimRequest]) -> float:
    """Bytes one user's decode step reads on average over `workload`: the weights, and the KV of
    the context at the middle of each answer (prompt + half the output)."""
    contexts = [len(w.prompt_token_ids) + w.output_len / 2 for w in workload]
    return read["weight_bytes"] + read["kv_bytes_per_token"] * sum(contexts) / max(len(contexts), 1)


def add_read_rates(summary: dict[str, Any], step_bytes: float, floor_bytes_per_s: float | None) -> None:
    """One user's decode bandwidth into `summary`: the step's bytes over its TPOT median (GB/s), and
    that as a share of the machine's measured read bandwidth."""
    tpot = summary["tpot_ms"].get("p50", math.nan) / 1e3
    summary["step_read_bytes"] = step_bytes
    summary["read_gbps"] = step_bytes / tpot / 1e9 if tpot and not math.isnan(tpot) else math.nan
    if floor_bytes_per_s:
        summary["floor_gbps"] = floor_bytes_per_s / 1e9
        summary["floor_share"] = 100 * summary["read_gbps"] * 1e9 / floor_bytes_per_s


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def summarise(records: list[RequestRecord], duration: float, server: dict[str, float] | None = None) -> dict[str, Any]:
    """Latencies and throughput of a run; `server`: its counters' change over the run (scrape_counters)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def ms(values: list[float]) -> dict[str, float]:
        return {k: v * 1000 for k, v in percentiles(values).items()}

    return {
        "server": server or {},
        "cold_ttft_ms": ms([r.ttft for r in ok if r.cold and r.ttft is not None]),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else math.nan,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "output_tokens": out_tokens,
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok if r.e2e is not None]),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.1f} s",
        f"request throughput {s['request_throughput']:.2f} req/s, output throughput {s['output_throughput']:.1f} tok/s",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = s[key]
        lines.append(f"{key[:-3].upper():5} ms  mean {p['mean']:9.1f}  median {p['p50']:9.1f}  p90 {p['p90']:9.1f}  p99 {p['p99']:9.1f}")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def plot_serve(records: list[RequestRecord], path: str) -> None:
    """Latency distributions (TTFT, ITL, E2E) and output tokens/s over time, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, values) in zip(
        axes.flat[:3],
        (("TTFT (ms)", [r.ttft * 1000 for r in ok]), ("ITL (ms)", [x * 1000 for r in ok for x in r.itl]),
         ("E2E latency (ms)", [r.e2e * 1000 for r in ok])),
    ):
        ax.hist(values, bins=40)
        ax.set_title(name)
        ax.set_ylabel("count")
    times = sorted(t for r in ok for t in r.chunk_times)
    ax = axes.flat[3]
    if times:
        t0 = min(r.start for r in ok)
        buckets: dict[int, int] = {}
        for t in times:
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
        xs = list(range(max(buckets) + 1))
        ax.plot(xs, [buckets.get(x, 0) for x in xs])
    ax.set_title("streamed chunks per second (~ output tokens/s)")
    ax.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- several servers, side by side ------------------------------------------------------------

# (label, summary key, sub-key or None, unit, higher is better): the figures a comparison reports;
# rows whose figure no server has (a server without /metrics, a workload without cold requests) are left out
COMPARED = (
    ("output tok/s", "output_throughput", None, "", True),
    ("TTFT median", "ttft_ms", "p50", " ms", False),
    ("TTFT p99", "ttft_ms", "p99", " ms", False),
    ("TPOT median", "tpot_ms", "p50", " ms", False),
    ("ITL p90", "itl_ms", "p90", " ms", False),
    ("decode read at TPOT median (one user)", "read_gbps", None, " GB/s", True),
    ("share of the measured read floor", "floor_share", None, "%", True),
    ("E2E median", "e2e_ms", "p50", " ms", False),
    ("cold TTFT median", "cold_ttft_ms", "p50", " ms", False),
    ("cold TTFT p99", "cold_ttft_ms", "p99", " ms", False),
    ("prompt tokens reused (server)", "server", "hits", "", True),
    ("prompt tokens computed (server)", "server", "prompt_tokens", "", False),
    ("preemptions (server)", "server", "preemptions", "", False),
    ("tokens recomputed (server)", "server", "recomputed", "", False),
    ("drafted tokens (server)", "server", "draft_tokens", "", True),
    ("drafts kept (server)", "server", "accepted_tokens", "", True),
)


def figure(summary: dict[str, Any], key: str, sub: str | None) -> float:
    value = summary.get(key, math.nan) if sub is None else summary.get(key, {}).get(sub, math.nan)
    return float(value)


def round_order(targets: list, round_index: int) -> list:
    """The servers in the order round `round_index` measures them: rotated one place a round, so
    each goes first as often as the others (the server measured first in a round runs a few
    percent slower on this machine, whichever it is; an even number of rounds cancels that)."""
    shift = round_index % len(targets) if targets else 0
    return targets[shift:] + targets[:shift]


async def compare_servers(
    targets: list[tuple[str, str]], rounds: list[list[SimRequest]], warmup: list[SimRequest], **kwargs: Any
) -> dict[str, list[dict[str, Any]]]:
    """Run each round's workload on every (label, base_url) in turn (`round_order`: drift on the
    machine hits every server alike), each preceded by the uncounted `warmup` requests. Give each
    round fresh prompts: both servers cache prefixes, so a repeated prompt would be a cache hit.
    Returns label -> one summary per round."""
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in targets}
    headers = {"Authorization": f"Bearer {kwargs['api_key']}"} if kwargs.get("api_key") else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        # one user's step reads the same bytes on every server of the same file: Octavo's gauges say how many
        read: dict[str, float] = {}
        for _, url in targets:
            read = read or await scrape_read_bytes(client, url, headers)
        floor = read_floor() if read and kwargs.get("max_concurrency") == 1 else None
        for r, workload in enumerate(rounds):
            for label, url in round_order(targets, r):
                if warmup:
                    await run_serve_benchmark(url, warmup, **{**kwargs, "request_rate": float("inf"), "progress": False})
                before = await scrape_counters(client, url, headers)
                records, duration = await run_serve_benchmark(url, workload, **kwargs)
                server = counters_delta(before, await scrape_counters(client, url, headers))
                results[label].append(summarise(records, duration, server))
                if floor is not None:
                    add_read_rates(results[label][-1], one_user_step_bytes(read, workload), floor)
    return results


def read_floor() -> float:
    """This machine's read bandwidth with as many threads as it has cores (memory_bandwidth: measured
    once per machine, ~1 s, then kept): the servers run on the same machine as this client."""
    import os

    from octavo.memory_bandwidth import measured

    return measured(os.cpu_count() or 1).bytes_per_s


def median(values: list[float]) -> float:
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def format_comparison(results: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table: each figure's median over the rounds per server, and each server's ratio
    to the first (for latencies: first / other, so > 1 means the first is faster)."""
    labels = list(results)
    first = labels[0]
    rounds = len(results[first])
    head = ["figure (median of %d)" % rounds, *labels] + [f"{first} vs {other}" for other in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, key, sub, unit, higher_better in COMPARED:
        meds = {label: median([figure(s, key, sub) for s in results[label]]) for label in labels}
        if all(math.isnan(v) for v in meds.values()):
            continue
        row = [name] + [f"{meds[label]:,.1f}{unit}" for label in labels]
        for other in labels[1:]:
            a, b = meds[first], meds[other]
            ratio = (a / b if higher_better else b / a) if a and b else math.nan
            row.append("n/a" if math.isnan(ratio) else f"{ratio:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    with_floor = [s for s in results[first] if "floor_gbps" in s]
    if with_floor:
        lines.append("")
        lines.append(f"one user's decode step reads {with_floor[0]['step_read_bytes'] / 1e6:,.1f} MB (weights as held + KV "
                     f"at mid-answer); this machine's measured read floor {with_floor[0]['floor_gbps']:.1f} GB/s, "
                     f"so a step takes >= {with_floor[0]['step_read_bytes'] / with_floor[0]['floor_gbps'] / 1e6:.1f} ms")
    failed = [f"{label}: {sum(s['failed'] for s in results[label])} of {sum(s['failed'] + s['completed'] for s in results[label])}" for label in labels]
    lines.append("")
    lines.append("failed requests: " + ", ".join(failed))
    return "\n".join(lines)
