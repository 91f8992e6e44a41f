"""The thread governor: fewer OpenMP threads while other processes keep the cores busy, all of
them back once the cores stay free (octavo/threads.py; the measurement behind it is in
docs/RELIABILITY.md)."""

from __future__ import annotations

import pytest
import torch

from octavo.threads import CALM_CHECKS, CHECK_EVERY_S, CpuUse, StepThread, ThreadGovernor


def test_threads_follow_the_load_down_at_once_and_up_after_calm():
    before = torch.get_num_threads()
    try:
        governor = ThreadGovernor(max_threads=2, num_cores=2)
        t = 0.0
        assert governor.tick(t, busy_elsewhere=0) == 2
        t += CHECK_EVERY_S
        assert governor.tick(t, busy_elsewhere=2) == 1 and torch.get_num_threads() == 1  # busy: down now
        assert governor.tick(t + CHECK_EVERY_S / 2, busy_elsewhere=0) == 1  # not checked again yet
        for i in range(CALM_CHECKS - 1):
            t += CHECK_EVERY_S
            assert governor.tick(t, busy_elsewhere=0) == 1  # calm, but not for long enough
        t += CHECK_EVERY_S
        assert governor.tick(t, busy_elsewhere=0.8) == 1  # about one busy core: one free; the calm restarts
        for i in range(CALM_CHECKS):
            t += CHECK_EVERY_S
            governor.tick(t, busy_elsewhere=0)
        assert governor.threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_another_process_spinning_is_seen_as_busy_and_this_ones_work_is_not():
    import subprocess
    import sys
    import time

    cpu = CpuUse()
    if cpu.others_cores() is None and CpuUse._read() is None:
        pytest.skip("no /proc/stat on this system")
    # Other processes of a busy machine (a parallel test run) count as others: the claim is that
    # this process's own busy loop adds nothing to them, against the load just before and after.
    cpu.others_cores()
    time.sleep(0.5)
    before = cpu.others_cores()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # this process busy: not "other processes"
        pass
    during = cpu.others_cores()
    time.sleep(0.5)
    after = cpu.others_cores()
    assert during < max(before, after) + 0.5, (before, during, after)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        cpu.others_cores()  # from here the spinner runs the whole interval
        time.sleep(1.0)
        assert cpu.others_cores() > 0.6
    finally:
        spinner.kill()
        spinner.wait()


def test_the_thread_count_does_not_change_the_output(make_llm):
    """Why changing it mid-run is safe for the oracle: greedy tokens and their logprobs are bit for
    bit the same at 1 and 2 threads (a kernel that split a reduction across threads would fail here)."""
    from octavo.sampling.params import SamplingParams

    llm = make_llm()
    prompts = ["Write a long story about the sea and a lighthouse keeper.", "def fib(n):", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs])
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1]


def test_a_step_on_another_thread_warns_once_per_move(caplog):
    import logging
    import threading

    watch = StepThread()
    moved: list[bool] = []

    def step_twice() -> None:
        moved.extend([watch.check(), watch.check()])
    with caplog.at_level(logging.WARNING, logger="octavo"):
        assert watch.check() is False  # the thread that built it
        worker = threading.Thread(target=step_twice)
        worker.start()
        worker.join()
        assert moved == [True, False]  # warned on the move, not again on the same thread
        assert watch.check() is True  # and back
    assert caplog.text.count("another thread than the one that built") == 2
