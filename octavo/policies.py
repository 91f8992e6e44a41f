"""The scheduler's two choices between requests: which waiting request is admitted first (the
cache-aware order; fcfs and priority are the queue's own), and which running request is preempted
when the pool runs out. Both weigh what the KV cache reports (kv_cache.costs); neither changes a
request or the cache."""

from __future__ import annotations

from typing import Callable, Iterable

from octavo.config import SchedulerConfig
from octavo.kv_cache.costs import preemption_cost, reusable_tokens_counter
from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request
from octavo.request_queue import FCFSQueue, PriorityQueue, RankedQueue


def rank_waiting(config: SchedulerConfig, kv: KVCacheManager, waiting: FCFSQueue | PriorityQueue | RankedQueue, step: int, budget: int,
                 num_seqs: int) -> bool:
    """Under the cache-aware policy, order the waiting queue for this step's admissions (not when
    nobody can be admitted: the order can wait). Returns whether it did."""
    ranked = (config.policy == "cache-aware" and budget > 0 and len(waiting) > 1 and num_seqs < config.max_num_seqs)
    if ranked:
        waiting.rank(cache_aware_key(config, kv, step))
    return ranked


def cache_aware_key(config: SchedulerConfig, kv: KVCacheManager, step: int) -> Callable[[Request], tuple]:
    """The cache-aware order: priority first; then preempted requests and those passed over by
    later arrivals in `max_wait_steps` steps (oldest first: the bound, after which nothing that
    arrived later goes ahead of them); then the most tokens reused from the cache, plus
    `aging_tokens_per_step` per step waited (so a cold request rises steadily). For one sort: the
    cache must not change meanwhile."""
    bound, aging = config.max_wait_steps, config.aging_tokens_per_step
    reusable = reusable_tokens_counter(kv)

    def key(request: Request) -> tuple:
        if request.num_preemptions or request.num_passed_over >= bound:
            return (request.priority, 0, 0, request.arrival_time)
        waited = step - request.queued_step
        return (request.priority, 1, -(reusable(request) + aging * waited), request.arrival_time)
    return key


def count_passed_over(waiting: Iterable[Request], latest: float) -> None:
    """Every waiting request that arrived before `latest` (admitted this step) was passed over:
    one step nearer the cache-aware order's bound."""
    for request in waiting:
        request.num_passed_over += request.arrival_time < latest


def choose_victims(config: SchedulerConfig, kv: KVCacheManager, running: list[Request], step: int) -> list[Request]:
    """The running requests to preempt next: the victim (`choose_victim`), with every running beam
    of its search when it is a beam (a search advances only when all its beams have their
    candidates, so its beams are preempted together)."""
    victim = choose_victim(config, kv, running, step)
    if victim.beam is None:
        return [victim]
    return [r for r in running if r.beam is victim.beam]


def choose_victim(config: SchedulerConfig, kv: KVCacheManager, running: list[Request], step: int) -> Request:
    """`cheapest`: among the running requests of the lowest priority but the oldest, the one whose
    loss costs least (kv_cache.costs.preemption_cost) among those that free a block, sparing
    requests that resumed lately; ties go to the newest. `newest`: the most recently admitted
    (under priorities: the latest arrival of the lowest priority)."""
    if config.preemption_victim == "newest":
        if config.policy == "fcfs":
            return running[-1]
        return max(running, key=lambda r: (r.priority, r.arrival_time, r.admit_seq))
    lowest = max(r.priority for r in running)
    candidates = [r for r in running if r.priority == lowest]
    if len(candidates) > 1 and candidates[0] is running[0]:
        candidates = candidates[1:]  # the oldest always progresses: no two requests starve each other
    candidates = [r for r in candidates if not is_resuming(config, r, step)] or candidates

    def cost(request: Request) -> tuple:
        num_tokens, num_freed = preemption_cost(kv, request)
        return (num_freed == 0, num_tokens, -request.admit_seq)
    return min(candidates, key=cost)


def is_resuming(config: SchedulerConfig, request: Request, step: int) -> bool:
    """A request re-admitted after a preemption, within `resume_protect_steps` of it or still
    recomputing what it lost: preempting it again is how preemption thrashes."""
    if not request.num_preemptions:
        return False
    recent = step - request.admit_step < config.resume_protect_steps
    return recent or request.num_computed_tokens < request.num_computed_before
