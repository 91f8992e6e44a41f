"""Replay a workload through the real Scheduler and KVCacheManager, with a cost model for step time.

Policies are expressed with the real objects, not re-implemented:
  * continuous batching: requests are added to the scheduler as they arrive;
    static batching: a batch of up to max_num_seqs arrived requests is added only once the
    previous batch has completely finished, and each step is charged as if every slot of the
    batch computed (finished sequences are padding, as in a static `generate`);
  * paging: blocks of `block_size`; reserving the maximum length: one block of max_model_len
    tokens per sequence, which is exactly what a contiguous reservation is;
  * prefix caching and chunked prefill: the scheduler's and manager's own switches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.request import Request, RequestStatus
from octavo.sampling.params import SamplingParams
from octavo.scheduler import Scheduler
from octavo.simulator.workload import SimRequest


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """step seconds = fixed_s + per_token_s x scheduled tokens + per_kv_token_s x attended KV tokens.

    Defaults fitted to Octavo's CPU path on the embedded model (2 threads, float32, measured with
    the random_n64 workload): a 64-sequence decode step at ~400 tokens of context took ~0.65 s, a
    single-sequence decode step ~0.1 s, a 2048-token prefill step ~5.5 s. This fit is decode-first:
    it overestimates prefill-heavy steps by about 40%.
    """

    fixed_s: float = 0.08
    per_token_s: float = 2.3e-3
    per_kv_token_s: float = 1.5e-5

    def step_time(self, num_tokens: int, num_attended: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens + self.per_kv_token_s * num_attended


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    continuous: bool = True
    paged: bool = True
    prefix_caching: bool = True
    chunked_prefill: bool = True


BASELINE = Policy("continuous+paged+cache+chunked")
COMPARISONS = (
    ("static vs continuous batching", Policy("static batching", continuous=False), BASELINE),
    ("reserve max length vs paging", Policy("reserve max length", paged=False), BASELINE),
    ("prefix caching off vs on", Policy("prefix caching off", prefix_caching=False), BASELINE),
    ("chunked prefill off vs on", Policy("chunked prefill off", chunked_prefill=False), BASELINE),
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_kv_tokens: int = 16384
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    cost: StepCostModel = field(default_factory=StepCostModel)

    def __post_init__(self) -> None:
        if self.num_kv_tokens < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.num_kv_tokens} tokens) must hold one sequence of max_model_len "
                f"({self.max_model_len}), or reserving the maximum length admits nothing; "
                "raise --kv-tokens or lower --max-model-len"
            )


@dataclass(slots=True)
class SimResult:
    policy: str
    num_requests: int
    num_steps: int
    makespan_s: float
    output_tokens: int
    prompt_tokens_computed: int
    throughput_tok_s: float
    slot_utilisation: float  # useful slot-steps / (max_num_seqs x steps)
    kv_utilisation: float  # slots holding a token / allocated slots, mean over steps
    preemptions: int
    peak_running: int
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    timeline: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "timeline"}  # type: ignore[attr-defined]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def pct(p: float) -> float:
        # linear interpolation between closest ranks
        pos = (len(ordered) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": sum(ordered) / len(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def build_scheduler(policy: Policy, cfg: SimConfig) -> Scheduler:
    """The real scheduler and KV-cache manager, configured for `policy` (same total KV tokens)."""
    block_size = cfg.block_size if policy.paged else cfg.max_model_len
    kv = KVCacheManager(cfg.num_kv_tokens // block_size, block_size, enable_prefix_caching=policy.prefix_caching)
    budget = cfg.max_num_batched_tokens if policy.chunked_prefill else max(cfg.max_num_batched_tokens, cfg.max_model_len)
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
            enable_chunked_prefill=policy.chunked_prefill,
        ),
        kv,
    )


def _attended(out: SchedulerOutput) -> int:
    """KV tokens read by this step's attention: each new token attends to all tokens up to itself."""
    return sum(e.num_tokens * e.start_pos + e.num_tokens * (e.num_tokens + 1) // 2 for e in out.scheduled)


def used_slots(s: Scheduler) -> int:
    """Slots holding a token, each shared block counted once."""
    kv, fill = s.kv_cache, {}
    bs = kv.block_size
    for req in s.running:
        for idx, block_id in enumerate(kv.block_ids(req.request_id)):
            filled = min(bs, max(0, req.num_computed_tokens - idx * bs))
            fill[block_id] = max(fill.get(block_id, 0), filled)
    return sum(fill.values())


def simulate(workload: list[SimRequest], policy: Policy, cfg: SimConfig) -> SimResult:
    """Run the workload to completion under `policy`; the clock advances by the cost model."""
    sched = build_scheduler(policy, cfg)
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    requests: dict[str, Request] = {}
    token_times: dict[str, list[float]] = {}
    clock, steps, useful_slot_steps, kv_util_sum, kv_steps, prompt_computed = 0.0, 0, 0, 0.0, 0, 0
    batch_size, peak_running = 0, 0
    timeline: dict[str, list[float]] = {"t": [], "running": [], "allocated_slots": [], "used_slots": []}
    next_idx = 0

    while next_idx < len(pending) or sched.has_unfinished_requests():
        may_add = policy.continuous or not sched.has_unfinished_requests()
        added = 0
        while may_add and next_idx < len(pending) and workload[pending[next_idx]].arrival_time <= clock:
            if not policy.continuous and added == cfg.max_num_seqs:
                break
            w = workload[pending[next_idx]]
            rid = str(pending[next_idx])
            req = Request(rid, list(w.prompt_token_ids), SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True),
                          arrival_time=w.arrival_time)
            sched.add_request(req)  # raises RequestRefused for a request that can never fit
            requests[rid], token_times[rid] = req, []
            next_idx += 1
            added += 1
        if added and not policy.continuous:
            batch_size = added
        if not sched.has_unfinished_requests():
            clock = max(clock, workload[pending[next_idx]].arrival_time)
            continue

        out = sched.schedule()
        num_tokens, attended = out.num_scheduled_tokens, _attended(out)
        if not policy.continuous:  # padding: idle slots of the static batch compute too
            idle = max(0, batch_size - len(out.scheduled))
            longest = max((e.start_pos + e.num_tokens for e in out.scheduled), default=0)
            num_tokens, attended = num_tokens + idle, attended + idle * longest
        clock += cfg.cost.step_time(num_tokens, attended)
        steps += 1
        useful_slot_steps += len(out.scheduled)
        prompt_computed += sum(max(0, min(e.start_pos + e.num_tokens, len(e.prompt_token_ids)) - e.start_pos) for e in out.scheduled)
        allocated = (sched.kv_cache.num_blocks - sched.kv_cache.num_free_blocks) * sched.kv_cache.block_size
        used = used_slots(sched)
        if allocated:
            kv_util_sum += used / allocated
            kv_steps += 1
        peak_running = max(peak_running, len(sched.running))
        for key, value in (("t", clock), ("running", len(sched.running)), ("allocated_slots", allocated), ("used_slots", used)):
            timeline[key].append(value)
        sampled = {sid: (len(requests[sid].output_token_ids) * 7919 + int(sid)) % 49152
                   for e in out.scheduled for sid in e.sample_ids}
        for req in sched.update(out, ModelRunnerOutput(sampled=sampled)):
            token_times[req.request_id].append(clock)

    ttft = [token_times[rid][0] - r.arrival_time for rid, r in requests.items() if token_times[rid]]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    output_tokens = sum(r.num_output_tokens for r in requests.values())
    assert all(r.status is RequestStatus.FINISHED for r in requests.values())
    return SimResult(
        policy=policy.name,
        num_requests=len(requests),
        num_steps=steps,
        makespan_s=clock,
        output_tokens=output_tokens,
        prompt_tokens_computed=prompt_computed,
        throughput_tok_s=output_tokens / clock if clock else math.nan,
        slot_utilisation=useful_slot_steps / (cfg.max_num_seqs * steps) if steps else math.nan,
        kv_utilisation=kv_util_sum / kv_steps if kv_steps else math.nan,
        preemptions=sched.num_preemptions,
        peak_running=peak_running,
        ttft_s=percentiles(ttft),
        itl_s=percentiles(itl),
        timeline=timeline,
    )
