"""The read-bandwidth probe (memory_bandwidth.py): a positive figure from a short probe, kept per
machine and thread count in the cache, and the floor line the start-up log prints."""

from __future__ import annotations

from octavo import memory_bandwidth as mb


def test_a_probe_measures_and_is_kept_per_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mb, "PROBE_BYTES", 64 << 20)
    monkeypatch.setattr(mb, "PROBE_SECONDS", 0.05)
    monkeypatch.setattr(mb, "measure", lambda threads: mb.Bandwidth(1e10, 1 << 20, threads, 3, mb.machine_name(), "now"))
    assert mb.cached(1) is None
    first = mb.measured(1)
    assert mb.cached(1) == first and mb.cached(2) is None
    monkeypatch.setattr(mb, "measure", lambda threads: mb.Bandwidth(2e10, 1 << 20, threads, 3, mb.machine_name(), "later"))
    assert mb.measured(1) == first  # kept: no second probe
    assert mb.measured(1, again=True).bytes_per_s == 2e10 and mb.cached(1).bytes_per_s == 2e10


def test_the_probe_reads_its_whole_buffer_and_restores_torch_threads():
    import torch

    before = torch.get_num_threads()
    found = mb.measure(threads=1, buffer_bytes=32 << 20, seconds=0.02)
    assert torch.get_num_threads() == before
    assert found.buffer_bytes == 32 << 20 and found.reps >= 3 and found.threads == 1
    assert 1e8 < found.bytes_per_s < 1e13  # (any machine: 0.1 GB/s to 10 TB/s)


def test_the_floor_line():
    bw = mb.Bandwidth(25e9, 1 << 30, 2, 10, "m", "t")
    assert bw.floor_s(50 * 10**6) == 0.002
    assert mb.describe_floor(50 * 10**6, bw) == ("a decode step reads 50.0 MB of weights: >= 2.0 ms at the 25.0 GB/s "
                                                 "read measured here with 2 threads")
    assert "`octavo bench bandwidth` measures" in mb.describe_floor(50 * 10**6, None)
