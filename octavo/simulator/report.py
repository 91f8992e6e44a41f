"""Side-by-side tables and a timeline plot of simulator results."""

from __future__ import annotations

from pathlib import Path

from octavo.simulator.simulator import SimResult

_ROWS = (
    ("throughput (out tok/s)", lambda r: f"{r.throughput_tok_s:.1f}"),
    ("makespan (s)", lambda r: f"{r.makespan_s:.1f}"),
    ("slot utilisation", lambda r: f"{r.slot_utilisation:.1%}"),
    ("KV memory utilisation", lambda r: f"{r.kv_utilisation:.1%}"),
    ("peak resident sequences", lambda r: str(r.peak_running)),
    ("prompt tokens computed", lambda r: str(r.prompt_tokens_computed)),
    ("preemptions", lambda r: str(r.preemptions)),
    ("TTFT p50 / p90 / p99 (s)", lambda r: "{p50:.2f} / {p90:.2f} / {p99:.2f}".format(**r.ttft_s)),
    ("ITL p50 / p90 / p99 (s)", lambda r: "{p50:.3f} / {p90:.3f} / {p99:.3f}".format(**r.itl_s)),
)


_SCHEDULING_ROWS = (
    ("throughput (out tok/s)", lambda r: f"{r.throughput_tok_s:.1f}"),
    ("makespan (s)", lambda r: f"{r.makespan_s:.1f}"),
    ("prompt tokens reused", lambda r: str(r.prompt_tokens_reused)),
    ("prompt tokens computed", lambda r: str(r.prompt_tokens_computed)),
    ("preemptions", lambda r: str(r.preemptions)),
    ("tokens recomputed", lambda r: str(r.recomputed_tokens)),
    ("re-preemptions / resumed / most of one", lambda r: f"{r.repreemptions} / {r.resumed} / {r.max_preemptions}"),
    ("longest wait / passed over (steps)", lambda r: f"{r.max_wait_steps} / {r.max_passed_over}"),
    ("TTFT p50 / p99 (s)", lambda r: "{p50:.2f} / {p99:.2f}".format(**r.ttft_s)),
    ("cold TTFT p50 / p99 (s)", lambda r: "{p50:.2f} / {p99:.2f}".format(**r.cold_ttft_s) if r.cold_ttft_s else "-"),
)


def format_table(title: str, results: list[SimResult], rows=_ROWS) -> str:
    """One column per result, one line per row of (name, format)."""
    table = [(title, *(r.policy for r in results))] + [(name, *(fmt(r) for r in results)) for name, fmt in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_comparison(title: str, variant: SimResult, baseline: SimResult) -> str:
    return format_table(title, [variant, baseline])


def format_scheduling(results: list[SimResult]) -> str:
    """The waiting order and victim rules side by side (SCHEDULING_POLICIES)."""
    return format_table("scheduling policy", results, _SCHEDULING_ROWS)


def plot_timelines(results: list[SimResult], path: str | Path) -> None:
    """Two panels over time: KV slots allocated vs holding tokens, and resident sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, batch) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for r in results:
        t = r.timeline["t"]
        (line,) = mem.plot(t, r.timeline["allocated_slots"], label=f"{r.policy}: allocated")
        mem.plot(t, r.timeline["used_slots"], linestyle="--", color=line.get_color(), label=f"{r.policy}: holding a token")
        batch.plot(t, r.timeline["running"], color=line.get_color(), label=r.policy)
    mem.set_ylabel("KV slots (tokens)")
    mem.set_title("KV memory over time (solid: allocated, dashed: holding a token)")
    mem.legend(fontsize=7, ncol=2)
    batch.set_ylabel("resident sequences")
    batch.set_xlabel("simulated time (s)")
    batch.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
