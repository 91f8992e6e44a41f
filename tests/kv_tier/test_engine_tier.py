"""The engine's side of the second tier at start: a tier that cannot be used (its probe write fails
on a full disk) leaves the engine running without it, with one log line, or refuses to start when
asked to; a folder an engine of this process still holds is an error, never a silent downgrade;
and `del llm` releases the folder for the next engine."""

from __future__ import annotations

import errno
import gc
import logging
import os

import pytest

from octavo.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TIER = dict(num_kv_blocks=32, kv_offload_size=32 << 20)


@pytest.fixture
def full_disk(monkeypatch):
    """Writes of more than 1 MiB fail as on a full disk (the tier's probe writes 8 blocks: ~6 MiB)."""
    real = os.pwrite

    def pwrite(fd, data, offset):
        if len(data) > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)


def test_a_full_disk_at_start_runs_without_the_tier_saying_so_once(make_llm, tmp_path, full_disk, caplog):
    with caplog.at_level(logging.WARNING, logger="octavo"):
        llm = make_llm(**TIER, kv_offload_path=str(tmp_path))
    assert llm.engine.tier is None and llm.engine.scheduler.kv_cache.tier is None
    lines = [r.getMessage() for r in caplog.records if "KV tier off" in r.getMessage()]
    assert len(lines) == 1 and "the disk is full" in lines[0] and "--kv-offload-required" in lines[0], lines
    out = llm.generate([[1, 2, 3, 4, 5]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    llm.close()


def test_a_full_disk_at_start_refuses_when_the_tier_is_required(make_llm, tmp_path, full_disk):
    with pytest.raises(ValueError, match="the second KV tier cannot be used: .*the disk is full"):
        make_llm(**TIER, kv_offload_path=str(tmp_path), kv_offload_required=True)


def test_del_llm_releases_the_folder_and_a_live_engine_holding_it_is_an_error(make_llm, tmp_path):
    first = make_llm(**TIER, kv_offload_path=str(tmp_path))
    assert first.engine.tier is not None
    with pytest.raises(ValueError, match="in use by another engine in this process .*del llm"):
        make_llm(**TIER, kv_offload_path=str(tmp_path))
    del first  # no close(), no gc.collect(): the LLM's refcount going to zero releases the folder
    second = make_llm(**TIER, kv_offload_path=str(tmp_path))
    assert second.engine.tier is not None
    engine = second.engine
    del second
    gc.collect()
    assert engine.tier is None  # closed with its LLM
