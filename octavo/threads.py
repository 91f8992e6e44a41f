"""The engine's OpenMP thread count, following the machine's load: all configured threads while the
cores are free, fewer while other processes keep them busy.

Measured side by side (tools/thread_policy.py, docs/BENCHMARKS.md): on 2 cores with 2 other busy
processes, 2 OpenMP threads waiting actively (libgomp's default) took 37-39 s instead of 0.2 s
for 32 tokens in 6 of 16 rounds over four runs (a spinning thread holds a core while the thread it waits
for is descheduled); a shorter spin (GOMP_SPINCOUNT=100000) did the same in 4 of 13; passive
waiting never did but made every idle step 2.5x slower; 1 thread never did and cost 1.3x idle.
So the engine keeps its threads while the machine is idle and drops to what is free when it is
not: no spin-wait pathology, no idle cost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

logger = logging.getLogger("octavo.threads")

CHECK_EVERY_S = 0.5
CALM_CHECKS = 2  # consecutive checks with free cores before taking threads back (1 s)


class CpuUse:
    """How many cores other processes kept busy since the last reading: the machine's busy CPU
    time (/proc/stat) less this process's (/proc/self/stat), over the wall time of all cores. An
    average over the interval, not a snapshot of who is runnable (which races with this process's
    own threads going to sleep)."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int] | None:
        """(all cores' busy ticks, all cores' ticks, this process's ticks), or None without /proc."""
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            ours = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user already)
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        busy = user + nice + system + irq + softirq
        total = busy + idle + iowait + steal
        return busy, total, int(ours[11]) + int(ours[12])  # utime + stime

    def others_cores(self) -> float | None:
        """Cores' worth of CPU other processes used since the last call; None without /proc or
        before any time has passed."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[1] <= last[1]:
            return None
        num_cores = os.cpu_count() or 1
        others = (now[0] - last[0]) - (now[2] - last[2])
        return max(0.0, others / (now[1] - last[1]) * num_cores)


class ThreadGovernor:
    """Call `tick()` between steps on the thread that runs them. Every CHECK_EVERY_S it sets
    torch's intra-op threads to the cores other processes leave free (at least 1, at most
    `max_threads`): down at once, back up after CALM_CHECKS calm checks."""

    def __init__(self, max_threads: int, num_cores: int | None = None) -> None:
        self.max_threads = max_threads
        self.num_cores = num_cores or os.cpu_count() or 1
        self.threads = max_threads
        self._next_check = 0.0
        self._calm = 0
        self._cpu: CpuUse | None = None

    def tick(self, now: float | None = None, busy_elsewhere: float | None = None) -> int:
        """The thread count to run the next step with (applied to torch when it changes).
        `busy_elsewhere`: cores other processes use (measured here when not given)."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return self.threads
        self._next_check = now + CHECK_EVERY_S
        if busy_elsewhere is None:
            if self._cpu is None:
                self._cpu = CpuUse()  # the first interval starts now
                return self.threads
            busy_elsewhere = self._cpu.others_cores()
            if busy_elsewhere is None:
                return self.threads
        free = max(1, min(self.max_threads, self.num_cores - round(busy_elsewhere)))
        if free < self.threads:
            self._calm = 0
            self._set(free, busy_elsewhere)
        elif free > self.threads:
            self._calm += 1
            if self._calm >= CALM_CHECKS:
                self._calm = 0
                self._set(free, busy_elsewhere)
        else:
            self._calm = 0
        return self.threads

    def _set(self, threads: int, busy: float) -> None:
        import torch

        logger.info("other processes use %.1f of %d cores: the engine steps with %d thread(s)", busy, self.num_cores,
                    threads)
        torch.set_num_threads(threads)
        self.threads = threads


class StepThread:
    """Warns (once per move) when an engine steps on another thread than the one that built it or
    stepped last: libgomp keeps one OpenMP thread pool per thread that opens parallel regions,
    and two pools on a small CPU made each step ~2x slower (docs/BENCHMARKS.md, session 4).
    Build and step an engine on the same thread."""

    def __init__(self) -> None:
        self.ident = threading.get_ident()

    def check(self) -> bool:
        """Whether the step moved thread (warned, and this thread is the one from now on)."""
        if self.ident == threading.get_ident():
            return False
        logging.getLogger("octavo").warning(
            "LLMEngine.step runs on another thread than the one that built or last stepped the engine; "
            "on few cores two OpenMP thread pools can halve its speed: build and step on one thread")
        self.ident = threading.get_ident()
        return True
