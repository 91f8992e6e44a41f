"""Replay a workload through the real Scheduler and KVCacheManager, with a cost model for step time.

Policies are expressed with the real objects, not re-implemented:
  * continuous batching: requests are added to the scheduler as they arrive;
    static batching: a batch of up to max_num_seqs arrived requests is added only once the
    previous batch has completely finished, and each step is charged as if every slot of the
    batch computed (finished sequences are padding, as in a static `generate`);
  * paging: blocks of `block_size`; reserving the maximum length: one block of max_model_len
    tokens per sequence, which is exactly what a contiguous reservation is;
  * prefix caching and chunked prefill: the scheduler's and manager's own switches;
  * the waiting order (fcfs, priority, cache-aware) and the preemption victim rule: the
    scheduler's own policies (SCHEDULING_POLICIES below runs them on one trace).
With `concurrency`, arrival times are ignored: a closed loop of that many clients, each sending
its next request when the last one ends (as `octavo bench serve --max-concurrency` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from octavo.config import DEFAULT_ADMISSION_HEADROOM_STEPS, DEFAULT_MAX_WAIT_STEPS, SchedulerConfig
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
    scheduling: str = "fcfs"
    victim: str = "cheapest"
    admission_headroom_steps: int = DEFAULT_ADMISSION_HEADROOM_STEPS


BASELINE = Policy("continuous+paged+cache+chunked")
COMPARISONS = (
    ("static vs continuous batching", Policy("static batching", continuous=False), BASELINE),
    ("reserve max length vs paging", Policy("reserve max length", paged=False), BASELINE),
    ("prefix caching off vs on", Policy("prefix caching off", prefix_caching=False), BASELINE),
    ("chunked prefill off vs on", Policy("chunked prefill off", chunked_prefill=False), BASELINE),
)
# the waiting order and the preemption rules, side by side on one trace ("fcfs, vLLM's rules":
# the newest running request is the victim, and admission takes any free block; what the
# scheduler did before cache-aware scheduling)
SCHEDULING_POLICIES = (
    Policy("fcfs, vLLM's rules", victim="newest", admission_headroom_steps=0),
    Policy("fcfs"),
    Policy("priority", scheduling="priority"),
    Policy("cache-aware", scheduling="cache-aware"),
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_kv_tokens: int = 16384
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    cost: StepCostModel = field(default_factory=StepCostModel)
    concurrency: int | None = None  # a closed loop of this many clients (None: arrival times)
    max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS

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
    prompt_tokens_reused: int = 0  # prompt tokens taken from the prefix cache (a resumed request's own included)
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    repreemptions: int = 0  # preemptions of a request preempted before
    resumed: int = 0  # admissions of a preempted request
    max_preemptions: int = 0  # the most times one request was preempted
    max_wait_steps: int = 0  # the longest any request waited from arrival to its first admission
    max_passed_over: int = 0  # the most steps any request was passed over by a later arrival (cache-aware)
    cold_ttft_s: dict[str, float] = field(default_factory=dict)  # requests marked cold in the workload
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
            enable_chunked_prefill=policy.chunked_prefill, policy=policy.scheduling,
            preemption_victim=policy.victim, max_wait_steps=cfg.max_wait_steps,
            admission_headroom_steps=policy.admission_headroom_steps,
        ),
        kv,
    )


def _attended(out: SchedulerOutput) -> int:
    """KV tokens read by this step's attention: each new token attends to all tokens up to itself."""
    return sum(e.num_tokens * e.start_pos + e.num_tokens * (e.num_tokens + 1) // 2 for e in out.scheduled)


def used_slots(s: Scheduler) -> int:
    """Slots holding a token, each shared block counted once (read through the KV cache's view,
    every group)."""
    view, fill = s.kv_cache.view(), {}
    bs = view.block_size
    for req in s.running:
        for table in view.table_entries(req.request_id):
            for idx, block_id in enumerate(table):
                if block_id is not None:
                    filled = min(bs, max(0, req.num_computed_tokens - idx * bs))
                    fill[block_id] = max(fill.get(block_id, 0), filled)
    return sum(fill.values())


class _Feed:
    """Which workload requests enter the scheduler when: at their arrival times (all of a static
    batch at once), or, with `cfg.concurrency`, whenever fewer than that many are unfinished."""

    def __init__(self, workload: list[SimRequest], policy: Policy, cfg: SimConfig) -> None:
        self.workload, self.policy, self.cfg = workload, policy, cfg
        self.pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
        self.next_idx = 0
        self.batch_size = 0

    def has_more(self) -> bool:
        return self.next_idx < len(self.pending)

    def next_arrival(self) -> float:
        return self.workload[self.pending[self.next_idx]].arrival_time

    def take(self, sched: Scheduler, clock: float) -> list[Request]:
        """The requests to add now (each arriving at `clock` in a closed loop)."""
        policy, cfg, out = self.policy, self.cfg, []
        if not policy.continuous and sched.has_unfinished_requests():
            return out
        while self.has_more():
            if cfg.concurrency is not None:
                if len(sched.requests) + len(out) >= cfg.concurrency:
                    break
            elif self.next_arrival() > clock or (not policy.continuous and len(out) == cfg.max_num_seqs):
                break
            w = self.workload[self.pending[self.next_idx]]
            arrival = clock if cfg.concurrency is not None else w.arrival_time
            params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
            out.append(Request(str(self.pending[self.next_idx]), list(w.prompt_token_ids), params,
                               arrival_time=arrival, priority=w.priority))
            self.next_idx += 1
        if out and not policy.continuous:
            self.batch_size = len(out)
        return out


@dataclass(slots=True)
class _Record:
    """What a run observed, step by step."""

    token_times: dict[str, list[float]] = field(default_factory=dict)
    added_step: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    useful_slot_steps: int = 0
    kv_util_sum: float = 0.0
    kv_steps: int = 0
    prompt_computed: int = 0
    peak_running: int = 0
    timeline: dict[str, list[float]] = field(
        default_factory=lambda: {"t": [], "running": [], "allocated_slots": [], "used_slots": []})

    def step(self, sched: Scheduler, out: SchedulerOutput, clock: float) -> None:
        self.steps += 1
        self.useful_slot_steps += len(out.scheduled)
        self.prompt_computed += sum(max(0, min(e.start_pos + e.num_tokens, len(e.prompt_token_ids)) - e.start_pos)
                                    for e in out.scheduled)
        for e in out.scheduled:
            self.first_step.setdefault(e.request_id, self.steps)
        view = sched.kv_cache.view()
        allocated = (view.num_blocks - view.num_free_blocks) * view.block_size
        used = used_slots(sched)
        if allocated:
            self.kv_util_sum += used / allocated
            self.kv_steps += 1
        self.peak_running = max(self.peak_running, len(sched.running))
        for key, value in (("t", clock), ("running", len(sched.running)), ("allocated_slots", allocated), ("used_slots", used)):
            self.timeline[key].append(value)


def simulate(workload: list[SimRequest], policy: Policy, cfg: SimConfig, on_step=None) -> SimResult:
    """Run the workload to completion under `policy`; the clock advances by the cost model.
    `on_step(scheduler, output, clock, step_seconds)` after each step (the dashboard's replay)."""
    sched = build_scheduler(policy, cfg)
    feed, rec = _Feed(workload, policy, cfg), _Record()
    requests: dict[str, Request] = {}
    clock = 0.0
    while feed.has_more() or sched.has_unfinished_requests():
        for req in feed.take(sched, clock):
            sched.add_request(req)  # raises RequestRefused for a request that can never fit
            requests[req.request_id], rec.token_times[req.request_id] = req, []
            rec.added_step[req.request_id] = rec.steps
        if not sched.has_unfinished_requests():
            clock = max(clock, feed.next_arrival())
            continue
        out = sched.schedule()
        num_tokens, attended = out.num_scheduled_tokens, _attended(out)
        if not policy.continuous:  # padding: idle slots of the static batch compute too
            idle = max(0, feed.batch_size - len(out.scheduled))
            longest = max((e.start_pos + e.num_tokens for e in out.scheduled), default=0)
            num_tokens, attended = num_tokens + idle, attended + idle * longest
        seconds = cfg.cost.step_time(num_tokens, attended)
        clock += seconds
        rec.step(sched, out, clock)
        sampled = {sid: [(len(requests[sid].output_token_ids) * 7919 + int(sid)) % 49152]
                   for e in out.scheduled for sid in e.sample_ids}
        for req in sched.update(out, ModelRunnerOutput(tokens=sampled)):
            rec.token_times[req.request_id].append(clock)
        if on_step is not None:
            on_step(sched, out, clock, seconds)
    assert all(r.status is RequestStatus.FINISHED for r in requests.values())
    return _result(policy, cfg, sched, requests, rec, clock, workload)


def _result(policy: Policy, cfg: SimConfig, sched: Scheduler, requests: dict[str, Request], rec: _Record,
            clock: float, workload: list[SimRequest]) -> SimResult:
    times = rec.token_times
    ttft = {rid: times[rid][0] - r.arrival_time for rid, r in requests.items() if times[rid]}
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    output_tokens = sum(r.num_output_tokens for r in requests.values())
    steps = rec.steps
    return SimResult(
        policy=policy.name,
        num_requests=len(requests),
        num_steps=steps,
        makespan_s=clock,
        output_tokens=output_tokens,
        prompt_tokens_computed=rec.prompt_computed,
        throughput_tok_s=output_tokens / clock if clock else math.nan,
        slot_utilisation=rec.useful_slot_steps / (cfg.max_num_seqs * steps) if steps else math.nan,
        kv_utilisation=rec.kv_util_sum / rec.kv_steps if rec.kv_steps else math.nan,
        preemptions=sched.preemption.num_preemptions,
        peak_running=rec.peak_running,
        ttft_s=percentiles(list(ttft.values())),
        itl_s=percentiles(itl),
        timeline=rec.timeline,
        prompt_tokens_reused=sched.stats().prefix.num_hits_tokens,
        recomputed_tokens=sched.preemption.num_recomputed_tokens,
        repreemptions=sched.preemption.num_repreemptions,
        resumed=sched.preemption.num_resumed,
        max_preemptions=max((r.num_preemptions for r in requests.values()), default=0),
        max_wait_steps=max((rec.first_step[rid] - rec.added_step[rid] - 1 for rid in rec.first_step), default=0),
        max_passed_over=max((r.num_passed_over for r in requests.values()), default=0),
        cold_ttft_s=percentiles([t for rid, t in ttft.items() if workload[int(rid)].cold]),
    )
