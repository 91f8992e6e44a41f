"""Multi-turn chat against an OpenAI-compatible server: conversations whose every turn resends the
whole history, with think time between turns; TTFT per turn, and the server's own counts of prompt
tokens computed and prefix hits per KV tier (read from its /metrics before and after)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import httpx

from octavo.bench.serve import RequestRecord, _one, median, round_order, scrape_counters
from octavo.simulator.simulator import percentiles
from octavo.simulator.workload import SimRequest

async def run_conversations(
    base_url: str, conversations: list[list[SimRequest]], think_time: float = 1.0, max_concurrency: int | None = None,
    model: str | None = None, api_key: str | None = None, seed: int = 0, progress: bool = True,
) -> tuple[list[tuple[int, RequestRecord]], dict[str, float], float]:
    """Run every conversation at once, each turn sent when its last one has ended plus an
    exponential think time of mean `think_time` s, at most `max_concurrency` requests in flight. Returns (turn index, record)
    pairs, the server counters' change over the run, and the wall time."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    thinks = [[rng.expovariate(1.0 / think_time) if think_time > 0 else 0.0 for _ in conv] for conv in conversations]
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(conversations))
    bar = tqdm(total=sum(len(c) for c in conversations), desc="bench multi-turn", unit="turn", disable=not progress)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:

        async def talk(conv: list[SimRequest], pauses: list[float]) -> list[tuple[int, RequestRecord]]:
            out = []
            for turn, (request, pause) in enumerate(zip(conv, pauses)):
                if turn:
                    await asyncio.sleep(pause)
                async with limit:  # requests in flight, not conversations: all of them stay open
                    out.append((turn, await _one(client, url, model, request, headers)))
                bar.update(1)
            return out

        before = await scrape_counters(client, base_url, headers)
        start = time.perf_counter()
        done = await asyncio.gather(*(talk(c, p) for c, p in zip(conversations, thinks)))
        duration = time.perf_counter() - start
        after = await scrape_counters(client, base_url, headers)
    bar.close()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    return [pair for conv in done for pair in conv], delta, duration


def summarise_turns(records: list[tuple[int, RequestRecord]], counters: dict[str, float], duration: float) -> dict[str, Any]:
    """TTFT percentiles over all turns, first turns and later turns (ms); prompt tokens computed and
    hit rates per tier from the server's counters (NaN where it has none)."""
    ok = [(t, r) for t, r in records if r.ok and r.ttft is not None]

    def ms(values: list[float]) -> dict[str, float]:
        return {k: v * 1000 for k, v in percentiles(values).items()}

    queries = counters.get("queries", math.nan)
    hits, tier = counters.get("hits", math.nan), counters.get("tier_hits", 0.0 if "hits" in counters else math.nan)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for _, r in records if r.error})[:5],
        "duration_s": duration,
        "ttft_ms": ms([r.ttft for _, r in ok]),
        "ttft_first_turn_ms": ms([r.ttft for t, r in ok if t == 0]),
        "ttft_later_turns_ms": ms([r.ttft for t, r in ok if t > 0]),
        "prompt_tokens_computed": counters.get("prompt_tokens", math.nan),
        "hit_rate": hits / queries if queries else math.nan,
        "pool_hit_rate": (hits - tier) / queries if queries else math.nan,
        "tier_hit_rate": tier / queries if queries else math.nan,
        "preemptions": counters.get("preemptions", math.nan),
        "recomputed_tokens": counters.get("recomputed", math.nan),
        "load_wait_ms": 1000 * counters["load_wait_s"] / counters["num_loading"] if counters.get("num_loading") else math.nan,
    }


# (row name, summary key, sub-key or None, unit, lower is better)
TURN_FIGURES = [
    ("TTFT p50", "ttft_ms", "p50", " ms", True),
    ("TTFT p99", "ttft_ms", "p99", " ms", True),
    ("TTFT p50, first turns", "ttft_first_turn_ms", "p50", " ms", True),
    ("TTFT p50, later turns", "ttft_later_turns_ms", "p50", " ms", True),
    ("prompt tokens computed", "prompt_tokens_computed", None, "", True),
    ("prefix hit rate (both tiers)", "hit_rate", None, "", False),
    ("  of which the pool", "pool_hit_rate", None, "", False),
    ("  of which the second tier", "tier_hit_rate", None, "", False),
    ("preemptions", "preemptions", None, "", True),
    ("tokens recomputed after preemption", "recomputed_tokens", None, "", True),
    ("tier load wait per loading request", "load_wait_ms", None, " ms", True),
    ("wall time", "duration_s", None, " s", True),
]


def _figure(summary: dict[str, Any], key: str, sub: str | None) -> float:
    value = summary[key] if sub is None else summary[key].get(sub, math.nan)
    return float(value)


def format_turns(results: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table: each figure's median over the rounds per server, and the first server's
    advantage over each other (> 1: the first is better; latencies and counts other / first)."""
    labels = list(results)
    first = labels[0]
    head = [f"figure (median of {len(results[first])})", *labels] + [f"{first} vs {o}" for o in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, key, sub, unit, lower_better in TURN_FIGURES:
        meds = {label: median([_figure(s, key, sub) for s in results[label]]) for label in labels}
        fmt = (lambda v: f"{v:.1%}") if "rate" in key else (lambda v: f"{v:,.1f}{unit}")
        row = [name] + [fmt(meds[label]) if not math.isnan(meds[label]) else "n/a" for label in labels]
        for other in labels[1:]:
            a, b = meds[first], meds[other]
            ratio = (b / a if lower_better else a / b) if a and b and not (math.isnan(a) or math.isnan(b)) else math.nan
            row.append("n/a" if math.isnan(ratio) or "rate" in key else f"{ratio:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    failed = [f"{label}: {sum(s['failed'] for s in results[label])}" for label in labels]
    lines += ["", "failed requests: " + ", ".join(failed)]
    return "\n".join(lines)


async def compare_conversations(
    targets: list[tuple[str, str]], rounds: list[list[list[SimRequest]]], **kwargs: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Each round's conversations on every (label, base_url) in turn (fresh conversations per
    round: a server would hit the last round's), in `round_order`. Returns label -> one summary
    per round."""
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in targets}
    for r, conversations in enumerate(rounds):
        for label, url in round_order(targets, r):
            records, counters, duration = await run_conversations(url, conversations, **kwargs)
            results[label].append(summarise_turns(records, counters, duration))
    return results
