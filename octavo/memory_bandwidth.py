"""This machine's memory read bandwidth: a probe (torch's threads summing a buffer far larger than
any cache, about a second), kept per machine in the cache, and the floor it sets on a decode step
(the bytes a step reads over the bytes per second the machine reads). llama.cpp's users ask for the
same figure: model size x tokens per second against a STREAM-style read.

The probe runs only when asked (`octavo bench bandwidth`, and `octavo bench` runs it once per
machine): a start never times anything, so a busy moment at start cannot leave a wrong floor in the
cache for every later start to quote.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from octavo.cache import atomic_write_text, cache_dir

PROBE_BYTES = 1 << 30  # 1 GiB: 32x this machine kind's 32 MB L3
PROBE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """A measured read bandwidth: bytes_per_s, best of `reps` sums of `buffer_bytes` with `threads`
    threads, on the machine `machine` names, at `measured` (ISO date and time)."""

    bytes_per_s: float
    buffer_bytes: int
    threads: int
    reps: int
    machine: str
    measured: str

    def floor_s(self, num_bytes: int) -> float:
        """The least time reading `num_bytes` takes at this bandwidth."""
        return num_bytes / self.bytes_per_s


def machine_name() -> str:
    """The CPU's model name, its core count and memory: what the cached figure is kept for."""
    from octavo.cpu_features import cpuinfo_text

    model = platform.processor() or platform.machine()
    for line in cpuinfo_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return f"{model}, {os.cpu_count()} CPUs, {mem / 2**30:.0f} GiB"


def _cache_file(threads: int) -> Path:
    from octavo.cpu_features import cpu_flags_line

    key = hashlib.sha256(f"{machine_name()}|{cpu_flags_line()}|{threads}".encode()).hexdigest()[:16]
    return cache_dir() / "bandwidth" / f"{key}.json"


def measure(threads: int | None = None, buffer_bytes: int = PROBE_BYTES, seconds: float = PROBE_SECONDS) -> Bandwidth:
    """Sum a float32 buffer of `buffer_bytes` (touched first) with `threads` torch threads (default:
    torch's current count) for about `seconds`; the best rep's bytes per second."""
    import torch

    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        buf.sum()  # (pages faulted in by ones(); one warm pass)
        best, reps, start = float("inf"), 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - start < seconds:
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
            reps += 1
    finally:
        torch.set_num_threads(before)
    return Bandwidth(buf.numel() * 4 / best, buf.numel() * 4, threads, reps, machine_name(),
                     time.strftime("%Y-%m-%d %H:%M:%S"))


def cached(threads: int) -> Bandwidth | None:
    """The figure measured on this machine with `threads` threads, if one was kept."""
    try:
        return Bandwidth(**json.loads(_cache_file(threads).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def measured(threads: int, again: bool = False) -> Bandwidth:
    """This machine's figure for `threads` threads: the kept one, else (or when `again`) a probe,
    then kept."""
    found = None if again else cached(threads)
    if found is not None:
        return found
    result = measure(threads)
    path = _cache_file(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(asdict(result)))
    return result


def describe_floor(num_bytes: int, bandwidth: Bandwidth | None) -> str:
    """'a decode step reads N MB: >= T ms at B GB/s (measured ...)' for the start-up line."""
    text = f"a decode step reads {num_bytes / 1e6:,.1f} MB of weights"
    if bandwidth is None:
        return text + " (`octavo bench bandwidth` measures this machine's floor)"
    return (f"{text}: >= {bandwidth.floor_s(num_bytes) * 1e3:.1f} ms at the {bandwidth.bytes_per_s / 1e9:.1f} GB/s "
            f"read measured here with {bandwidth.threads} threads")
