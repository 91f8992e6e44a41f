"""The KV-cache tensors: one lazily mapped pool on the CPU, zero, with every layer's K and V apart."""

from __future__ import annotations

import torch

from octavo.config import ModelConfig, RopeConfig
from octavo.model_runner import allocate_kv_caches

CFG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0), max_position=8192,
)


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_2_gib_pool_costs_no_resident_memory_until_written():
    num_blocks = 2 * 2**30 // (16 * CFG.kv_bytes_per_token("float32"))
    before = _rss_bytes()
    caches = allocate_kv_caches(CFG, num_blocks, 16, torch.float32, torch.device("cpu"))
    assert _rss_bytes() - before < 64 << 20
    assert len(caches) == 30 and caches[0][0].shape == (num_blocks, 16, 3, 64)
    caches[7][1][5].fill_(1.0)  # one block of one layer's V: resident, the rest still not
    assert _rss_bytes() - before < 64 << 20
    assert caches[7][1][5].sum().item() == 16 * 3 * 64
    assert caches[7][0].abs().sum().item() == 0 and caches[8][1].abs().sum().item() == 0
    assert caches[7][1][4].abs().sum().item() == 0 and caches[7][1][6].abs().sum().item() == 0


def test_bfloat16_pool_has_the_asked_dtype_and_distinct_tensors():
    caches = allocate_kv_caches(CFG, 4, 16, torch.bfloat16, torch.device("cpu"))
    ptrs = {t.data_ptr() for kv in caches for t in kv}
    assert len(ptrs) == 60 and all(t.dtype == torch.bfloat16 and t.is_contiguous() for kv in caches for t in kv)


def test_a_step_leaves_out_the_requests_whose_load_failed_with_their_grammar_rows():
    from octavo.model_runner import _without
    from octavo.outputs import SampleRow, ScheduledRequest, SchedulerOutput
    from octavo.sampling.params import SamplingParams

    def entry(rid, blocks):
        return ScheduledRequest(rid, [1], 0, [blocks], SamplingParams(), [SampleRow(rid, 0)], [1])

    sched = SchedulerOutput(scheduled=[entry("a", [0, 1]), entry("b", [2, 3]), entry("c", [4])], copies=[(5, 6)])
    mask = torch.tensor([[1], [2], [3]], dtype=torch.int32)
    kept, grammar = _without({"b"}, sched, (["a", "b", "c"], mask))
    assert [e.request_id for e in kept.scheduled] == ["a", "c"] and kept.copies == [(5, 6)]
    assert grammar[0] == ["a", "c"] and grammar[1].tolist() == [[1], [3]]
    assert [e.request_id for e in sched.scheduled] == ["a", "b", "c"]  # the scheduler's copy is untouched
