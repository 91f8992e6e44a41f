"""The simulator on hand-checked traces, driving the real Scheduler and KVCacheManager."""

import dataclasses
import json
import subprocess
import sys

import pytest

import octavo.scheduler
from octavo.kv_cache.manager import KVCacheManager
from octavo.simulator.simulator import (
    BASELINE, SCHEDULING_POLICIES, Policy, SimConfig, StepCostModel, build_scheduler, simulate,
)
from octavo.simulator.workload import SimRequest, random_workload, shared_prefix_workload, trace_workload

STATIC = Policy("static", continuous=False)
UNIT_COST = StepCostModel(fixed_s=1.0, per_token_s=0.0, per_kv_token_s=0.0)  # one second per step


def req(prompt_start: int, output_len: int, prompt_len: int = 4, t: float = 0.0) -> SimRequest:
    return SimRequest(t, tuple(range(prompt_start, prompt_start + prompt_len)), output_len)


def test_static_batch_of_three_has_the_hand_computed_utilisation():
    # outputs 2, 4, 6: the batch runs 6 steps (prompts + first tokens in step 1); useful
    # slot-steps 2 + 4 + 6 = 12 out of 3 slots x 6 steps = 18
    work = [req(0, 2), req(100, 4), req(200, 6)]
    cfg = SimConfig(num_kv_tokens=64, block_size=4, max_num_seqs=3, max_model_len=32, cost=UNIT_COST)
    r = simulate(work, STATIC, cfg)
    assert r.num_steps == 6 and r.slot_utilisation == pytest.approx(12 / 18)
    assert r.output_tokens == 12 and r.makespan_s == pytest.approx(6.0)
    assert r.ttft_s["p50"] == pytest.approx(1.0)


def test_continuous_batching_beats_static():
    work = [req(100 * i, out) for i, out in enumerate([2, 8, 3, 8, 2, 7])]
    cfg = SimConfig(num_kv_tokens=256, block_size=4, max_num_seqs=3, max_model_len=32, cost=UNIT_COST)
    static, continuous = simulate(work, STATIC, cfg), simulate(work, BASELINE, cfg)
    assert static.output_tokens == continuous.output_tokens == 30
    assert continuous.num_steps < static.num_steps
    assert continuous.slot_utilisation > static.slot_utilisation
    assert continuous.throughput_tok_s > static.throughput_tok_s


def test_paging_holds_more_sequences_than_reserving_max_length():
    work = [req(100 * i, 4, prompt_len=8) for i in range(16)]
    cfg = SimConfig(num_kv_tokens=256, block_size=4, max_num_seqs=16, max_model_len=64, cost=UNIT_COST)
    paged, reserved = simulate(work, BASELINE, cfg), simulate(work, Policy("reserve", paged=False), cfg)
    assert reserved.peak_running == 256 // 64 == 4
    assert paged.peak_running == 16
    # paged: 128/128, 144/192, 160/192, 176/192 slots hold a token over the 4 steps
    assert paged.kv_utilisation == pytest.approx((1 + 0.75 + 160 / 192 + 176 / 192) / 4)
    assert reserved.kv_utilisation < 0.25


def test_shared_prefix_computes_only_the_unshared_tokens():
    prefix = tuple(range(32))  # two full blocks of 16
    work = [SimRequest(0.0, prefix + tuple(range(1000 + 8 * i, 1008 + 8 * i)), 2) for i in range(4)]
    cfg = SimConfig(num_kv_tokens=1024, block_size=16, max_num_seqs=8, max_model_len=128, cost=UNIT_COST)
    on = simulate(work, BASELINE, cfg)
    off = simulate(work, Policy("no cache", prefix_caching=False), cfg)
    assert off.prompt_tokens_computed == 4 * 40
    assert on.prompt_tokens_computed == 40 + 3 * 8


def test_the_simulator_drives_the_real_scheduler(monkeypatch):
    s = build_scheduler(BASELINE, SimConfig())
    assert type(s) is octavo.scheduler.Scheduler and type(s.kv_cache) is KVCacheManager
    calls = []
    real = octavo.scheduler.Scheduler.schedule

    def counting(self):
        calls.append(self)
        return real(self)

    monkeypatch.setattr(octavo.scheduler.Scheduler, "schedule", counting)
    r = simulate([req(0, 3), req(50, 5)], BASELINE, SimConfig(cost=UNIT_COST))
    assert len(calls) == r.num_steps == 5


def test_preemption_under_memory_pressure_keeps_every_request_whole():
    work = random_workload(24, input_len=40, output_len=30, range_ratio=0.5, seed=3)
    cfg = SimConfig(num_kv_tokens=512, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128)
    r = simulate(work, dataclasses.replace(BASELINE, admission_headroom_steps=0), cfg)
    assert r.preemptions > 0
    assert r.output_tokens == sum(w.output_len for w in work)
    assert r.prompt_tokens_computed > sum(len(w.prompt_token_ids) for w in work)  # recompute after preemption


def test_kv_smaller_than_one_max_length_sequence_is_refused():
    with pytest.raises(ValueError, match="must hold one sequence of max_model_len"):
        SimConfig(num_kv_tokens=100, max_model_len=200)


def test_workloads_are_seeded_and_traces_are_read(tmp_path):
    assert random_workload(5, 10, 5, 0.5, seed=1) == random_workload(5, 10, 5, 0.5, seed=1)
    shared = shared_prefix_workload(6, num_prefixes=2, prefix_len=10, suffix_len=3, output_len=4)
    assert shared[0].prompt_token_ids[:10] == shared[2].prompt_token_ids[:10] != shared[1].prompt_token_ids[:10]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([{"prompt_len": 5, "output_len": 3, "arrival_time": 1.5},
                                {"prompt_token_ids": [1, 2], "max_tokens": 2}]))
    t = trace_workload(path)
    assert [(len(w.prompt_token_ids), w.output_len, w.arrival_time) for w in t] == [(5, 3, 1.5), (2, 2, 0.0)]


def test_cli_compares_four_policy_pairs_and_plots(tmp_path):
    png, js = tmp_path / "sim.png", tmp_path / "sim.json"
    out = subprocess.run([sys.executable, "-m", "octavo.cli", "simulate", "--num-requests", "12", "--input-len", "64",
                          "--output-len", "16", "--max-num-seqs", "4", "--kv-tokens", "1024", "--max-model-len", "256",
                          "--plot", str(png),
                          "--json", str(js)], capture_output=True, text=True, check=True).stdout
    for title in ("static vs continuous", "reserve max length vs paging", "prefix caching off vs on", "chunked prefill off vs on"):
        assert title in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(js.read_text())
    assert len(data["comparisons"]) == 4 and data["baseline"]["num_requests"] == 12
    assert "scheduling policy" in out and "cache-aware" in out and "tokens recomputed" in out
    assert set(data["scheduling"]) == {"fcfs, vLLM's rules", "fcfs", "priority", "cache-aware"}


def test_cache_aware_reuses_more_than_fcfs_on_shared_prefixes_under_memory_pressure():
    # 8 prefixes of 8 blocks, round robin; the pool holds about two of them at a time; 8 clients
    work = shared_prefix_workload(48, num_prefixes=8, prefix_len=128, suffix_len=8, output_len=4, cold_fraction=0.1)
    assert sum(w.cold for w in work) == 4
    cfg = SimConfig(num_kv_tokens=512, max_num_seqs=8, max_model_len=256, concurrency=8)
    results = {p.name: simulate(work, p, cfg) for p in SCHEDULING_POLICIES}
    fcfs, aware = results["fcfs"], results["cache-aware"]
    assert aware.prompt_tokens_reused > 1.5 * fcfs.prompt_tokens_reused
    assert aware.prompt_tokens_computed < fcfs.prompt_tokens_computed
    assert aware.makespan_s < fcfs.makespan_s
    assert aware.max_passed_over <= cfg.max_wait_steps and fcfs.max_passed_over == 0
    assert aware.cold_ttft_s["p50"] > 0 and all(r.num_requests == 48 for r in results.values())


def test_a_closed_loop_keeps_at_most_concurrency_requests_in_flight(monkeypatch):
    seen = []
    real = octavo.scheduler.Scheduler.schedule

    def spy(self):
        seen.append(len(self.requests))
        return real(self)

    monkeypatch.setattr(octavo.scheduler.Scheduler, "schedule", spy)
    work = [req(100 * i, 3) for i in range(10)]
    res = simulate(work, BASELINE, SimConfig(num_kv_tokens=512, max_model_len=256, concurrency=3, cost=UNIT_COST))
    assert max(seen) == 3 and res.num_requests == 10


def test_the_default_rules_recompute_at_most_half_of_vllms_under_memory_pressure():
    work = random_workload(48, 64, 48, range_ratio=0.9, seed=1)
    cfg = SimConfig(num_kv_tokens=1024, max_num_seqs=32, max_model_len=256, max_num_batched_tokens=256)
    before, after = (simulate(work, policy, cfg) for policy in SCHEDULING_POLICIES[:2])
    assert before.recomputed_tokens > 0 and after.recomputed_tokens <= before.recomputed_tokens / 2
    assert after.max_preemptions <= 2 and after.preemptions < before.preemptions
