"""Scheduler: decides each step how many tokens every request computes, and applies the results.

There are no prefill and decode phases. Every request has `num_computed_tokens` trying to catch
up with `num_tokens` (prompt plus sampled outputs); a step hands out at most
`max_num_batched_tokens` of that catching up, running requests first (a decode is 1 token, an
unfinished prompt a chunk), then waiting requests in queue order. A prompt larger than what is
left of the budget is chunked. Waiting requests are admitted in queue order: arrival (fcfs),
priority then arrival, or (cache-aware) the most tokens reused from the cache with aging and a
bound on the wait. When the pool runs out of blocks, a running request is preempted: the one whose
loss costs least (or the most recently admitted, vLLM's rule); its full blocks stay in the prefix
cache, so it resumes from what is still cached and recomputes the rest. With a second KV
tier that is a swap: blocks the pool evicts go to the tier, and a waiting request whose prefix
continues there waits one step while they load (the others run on).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from octavo.beam_search import BeamGroup, Continuation
from octavo.config import SchedulerConfig
from octavo.kv_cache.costs import preemption_cost, reusable_tokens_counter
from octavo.kv_cache.manager import Allocation, KVCacheManager
from octavo.outputs import ModelRunnerOutput, SampleRow, ScheduledRequest, SchedulerOutput, SchedulerStats
from octavo.request import FinishReason, Request, RequestStatus, child_request_id
from octavo.request_queue import make_waiting_queue


class RequestRefused(ValueError):
    """A request that can never be served with this engine's limits."""


@dataclass(slots=True)
class _Seats:
    """What the running set holds of a step's limits: sequences (a beam search counts its width),
    beam searches, LoRA adapters."""

    num_seqs: int
    searches: dict[int, BeamGroup]
    loras: set[int]

    @classmethod
    def of(cls, running: list[Request]) -> _Seats:
        searches = {id(r.beam): r.beam for r in running if r.beam is not None}
        num_seqs = sum(r.num_samples_pending for r in running if r.beam is None) + sum(g.width for g in searches.values())
        return cls(num_seqs, searches, {r.lora_id for r in running if r.lora_id is not None})

    def need(self, request: Request) -> int:
        """Seats the request takes when admitted: its n, or its search's width (once per search)."""
        if request.beam is not None:
            return 0 if id(request.beam) in self.searches else request.beam.width
        return request.num_samples_pending

    def add(self, request: Request, need: int) -> None:
        self.num_seqs += need
        if request.beam is not None:
            self.searches[id(request.beam)] = request.beam
        if request.lora_id is not None:
            self.loras.add(request.lora_id)


class Scheduler:
    """Owns the queues and is the only writer of `Request` objects."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}
        self._sequences: dict[str, set[str]] = {}  # user request id -> its live sequence ids
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_repreemptions = 0  # preemptions of a request preempted before
        self.num_resumed = 0  # admissions of a preempted request
        self.num_recomputed_tokens = 0
        self._num_steps = 0
        self.num_swaps = 0  # preemptions whose blocks go to the second tier (the rest recompute)
        self._run_loading: set[str] = set()  # running requests whose next blocks load this step
        self._rolled_back: set[str] = set()  # requests the runner left out (a load failed): their chunk is void
        # with a second tier, running requests take blocks ahead of their computed tokens from it
        self.connector = kv_cache.connector
        self._step_start = 0.0  # when the last step was scheduled: loads wait for its end
        self._admit_counter = itertools.count(1)
        self._finished_ids: list[str] = []
        self._blocks_needed: dict[str, int] = {}  # live request -> the most blocks it can hold (check_fits)
        self._pending_pins: dict[str, int] = {}  # live pin request -> the blocks it pins when it ends
        self._last_num_scheduled_tokens = 0
        self._last_num_scheduled_requests = 0
        self._drafts: dict[str, list[int]] = {}  # this step's drafts (speculative decoding), by request

    # ---- admission ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises RequestRefused when it could never fit; nothing is kept then."""
        num_blocks, max_chunk = self.check_fits(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.max_chunk_tokens = max_chunk
        self.requests[request.request_id] = request
        self._blocks_needed[request.request_id] = num_blocks
        if request.pin:
            self._pending_pins[request.request_id] = self.kv_cache.pins.num_to_pin(request)
        self._sequences.setdefault(request.user_request_id, set()).add(request.request_id)
        if request.beam is not None:
            request.beam.start(request.request_id)
        request.queued_step = self._num_steps
        self.waiting.add(request)

    def check_fits(self, request: Request) -> tuple[int, int | None]:
        """Raise RequestRefused, saying which limit and by how much, if `request` can never run
        (pinned blocks are not for it); else return the most blocks it can hold, and the largest
        prompt chunk it may compute in one step (None: the step's budget). A sliding-window group
        holds a chunk's blocks beside its window's, so a long prompt that does not fit computed in
        budget-sized chunks may fit in smaller ones: it is admitted with the largest that fits."""
        max_len = self.config.max_model_len
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise RequestRefused("the prompt is empty: at least one token is needed")
        if request.lora_id is not None and self.config.max_loras is None:
            raise RequestRefused("a LoRA adapter was asked for but LoRA is off: start with --enable-lora")
        num_samples = request.beam.width if request.beam is not None else request.num_samples_pending
        if num_samples > self.config.max_num_seqs:
            raise RequestRefused(
                f"n ({num_samples}) exceeds max_num_seqs ({self.config.max_num_seqs}): "
                "all n completions of a request run at once"
            )
        if num_prompt >= max_len:
            raise RequestRefused(
                f"the prompt has {num_prompt} tokens but max_model_len is {max_len}: "
                f"it must be at most {max_len - 1} tokens to leave room for one output token"
            )
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and num_prompt + max_tokens > max_len:
            raise RequestRefused(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"exceeds max_model_len ({max_len}); lower max_tokens to at most {max_len - num_prompt}"
            )
        total = num_prompt + max_tokens if max_tokens is not None else max_len
        # beams share blocks while running, but a preempted search recomputes each beam on its own
        # (without prefix caching, sharing nothing): it must fit with no sharing at all
        width = request.beam.width if request.beam is not None else 1
        if request.pin:
            self._check_pin_fits(request)
        # pinned blocks, and those pins not yet computed will hold, are not for it (but those its
        # prompt starts with)
        num_pinned = self.kv_cache.pins.num_blocks + sum(self._pending_pins.values())
        room = self.kv_cache.num_blocks - num_pinned + self.kv_cache.pins.num_hits(request)
        budget = self.config.max_num_batched_tokens
        max_chunk = None
        num_blocks = width * self.kv_cache.num_blocks_to_hold(total, budget)
        if num_blocks > room and any(w is not None for w in self.kv_cache.group_windows):
            low, high = 1, budget - 1  # the largest chunk that fits: blocks grow with the chunk
            while low < high:
                mid = (low + high + 1) // 2
                if width * self.kv_cache.num_blocks_to_hold(total, mid) <= room:
                    low = mid
                else:
                    high = mid - 1
            if width * self.kv_cache.num_blocks_to_hold(total, low) <= room:
                max_chunk, num_blocks = low, width * self.kv_cache.num_blocks_to_hold(total, low)
            else:
                num_blocks = width * self.kv_cache.num_blocks_to_hold(total, 1)
        if num_blocks > room:
            block_size = self.kv_cache.block_size
            pinned = f", {num_pinned} of them pinned" if num_pinned else ""
            raise RequestRefused(
                f"the request needs up to {total} tokens = {num_blocks} KV blocks of {block_size}, "
                f"but the whole KV cache has {self.kv_cache.num_blocks} blocks{pinned} "
                f"({self.kv_cache.num_blocks * block_size} tokens); "
                "shorten it or give the cache more memory"
            )
        return num_blocks, max_chunk

    def _check_pin_fits(self, request: Request) -> None:
        """Raise RequestRefused if pinning the request's prompt would pass the pinned share, or
        leave a live request more blocks than the rest of the pool."""
        kv = self.kv_cache
        num_new = kv.pins.num_to_pin(request)
        num_pinned = kv.pins.num_blocks + sum(self._pending_pins.values()) + num_new
        if num_pinned > kv.pins.max_blocks:
            raise RequestRefused(
                f"pinning this prefix would hold {num_pinned} KV blocks, over the pinned share of the pool "
                f"({kv.pins.max_blocks} of {kv.num_blocks} blocks); pin less, or raise --pinned-prefix-share"
            )
        largest = max(self._blocks_needed.values(), default=0)
        if largest > kv.num_blocks - num_pinned:
            raise RequestRefused(
                f"pinning this prefix would leave {kv.num_blocks - num_pinned} KV blocks, but a live request "
                f"needs up to {largest}: pin it when that request has ended"
            )

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Choose this step's work. Mutates queues, block tables and `num_computed_tokens`.
        `drafts`: tokens speculative decoding drafted after running requests' last tokens (the
        SpecDecodeController's): a decoding request verifies those the step's budget leaves room for.

        Running requests are served in admission order; if one cannot get blocks, victims
        (`_choose_victim`) are preempted until it can (or until it is itself the victim). Waiting
        requests are admitted only when nothing was preempted this step, so a freed block is not
        immediately fought over again.
        """
        budget = self.config.max_num_batched_tokens
        self._step_start = time.time()
        self._num_steps += 1
        scheduled: dict[str, tuple[ScheduledRequest, list[tuple[int, int]]]] = {}
        preempted: list[str] = []

        self._run_loading.clear()
        self._drafts = drafts or {}
        done: set[str] = set()  # running requests dealt with this step: always a prefix of `running`
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_preempted = len(preempted)
            budget = self._schedule_running(request, budget, scheduled, preempted)
            done.add(request.request_id)
            if len(preempted) == num_preempted:
                idx += 1
            else:  # victims left the list, before `idx` or at it
                idx = sum(r.request_id in done for r in self.running)

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        if not scheduled and not self._run_loading and len(self.waiting) and self.running:
            # Only beams waiting for siblings that cannot get in hold blocks: requeue them all, so
            # the queue's front search can be admitted whole (no step may leave everyone stuck).
            for victim in reversed(list(self.running)):
                self._preempt(victim, scheduled)
                preempted.append(victim.request_id)

        finished, self._finished_ids = self._finished_ids, []
        entries = [entry for entry, _ in scheduled.values()]
        self._last_num_scheduled_tokens = sum(e.num_tokens for e in entries)
        self._last_num_scheduled_requests = len(entries)
        stores, loads = self.connector.take_work() if self.connector is not None else ([], [])
        return SchedulerOutput(
            scheduled=entries,
            copies=[copy for _, copies in scheduled.values() for copy in copies],
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            tier_stores=stores,
            tier_loads=loads,
        )

    def _schedule_running(self, request: Request, budget: int, scheduled, preempted: list[str]) -> int:
        """Give a running request its next tokens (after what it takes from the cache), making
        room by preemption if needed (it may be the victim itself). Returns the budget left."""
        refund, computes = self._load_ahead(request, scheduled, preempted)  # loads count as computed
        budget += refund
        if request.status is not RequestStatus.RUNNING or not computes:
            return budget  # a victim, or it takes more of its history from the cache next step
        num_new = min(request.num_tokens - request.num_computed_tokens, budget, request.max_chunk_tokens or budget)
        if num_new == 0:  # a beam waiting for the other beams of its search
            return budget
        # a decoding request verifies what the budget leaves of its drafts (set afresh every step)
        request.spec_token_ids = self._drafts.get(request.request_id, [])[: budget - 1] if num_new == 1 else []
        num_new += len(request.spec_token_ids)
        allocation, refund = self._with_room(request, lambda: self.kv_cache.allocate_slots(request, num_new),
                                             scheduled, preempted)
        budget += refund
        if allocation is None:
            return budget  # `request` was a victim
        scheduled[request.request_id] = self._schedule_one(request, num_new, allocation, request.spec_token_ids)
        return budget - num_new

    def _with_room(self, request: Request, attempt, scheduled, preempted: list[str]):
        """attempt() until it returns something: first letting go of blocks held for waiting
        requests back from the tier, then preempting victims (`_choose_victim`). Returns its
        result (None when `request` itself became the victim) and the budget victims gave back."""
        refund = 0
        result = attempt()
        while result is None:
            for victim in self._victims():
                refund += self._preempt(victim, scheduled)
                preempted.append(victim.request_id)
            if request.status is not RequestStatus.RUNNING:
                return None, refund
            result = attempt()
        return result, refund

    def _load_ahead(self, request: Request, scheduled, preempted: list[str], make_room: bool = True) -> tuple[int, bool]:
        """Let a running request take its next blocks from the cache rather than compute them
        (KVCacheManager.extend_cached): pool blocks at once, second-tier blocks read before this
        step's forward, making room as for a chunk (unless not `make_room`). Either way they
        count as computed now (if a load fails, `_finish_tier_work` rolls the request back).
        Returns the budget victims gave back and whether the request computes on this step: not
        when its next block is cached too (more is taken next step) or it could take nothing."""
        if self.connector is None:
            return 0, True
        kv, connector = self.kv_cache, self.connector
        # a step takes a budget's worth of blocks at most (its reads are waited for); with window
        # groups the whole cached run at once: each piece taken would load its own window's blocks
        # (measured on Gemma 3: 450 blocks read for a 1,200-token hit in 32-block pieces, 235 at once)
        windowed = any(not g.holds_every_block for g in kv.groups)
        max_blocks = request.num_tokens if windowed else max(1, self.config.max_num_batched_tokens // kv.block_size)
        def attempt():
            return kv.extend_cached(request, max_blocks, connector.can_load)
        result, refund = self._with_room(request, attempt, scheduled, preempted) if make_room else (attempt(), 0)
        if result is None:
            return refund, False
        num_taken, loads = result
        start = request.num_computed_tokens // kv.block_size
        request.num_computed_tokens += num_taken * kv.block_size
        if loads:
            connector.start_loads(request.request_id, start, num_taken, loads)
            self._run_loading.add(request.request_id)
        else:
            self._count_cached(request, num_taken)
        return refund, not (num_taken and kv.num_cached_ahead(request, 1, connector.can_supply))

    def _count_cached(self, request: Request, num_blocks: int) -> None:
        """Blocks a request took from the cache before its first token count in its cached tokens."""
        if num_blocks and request.num_cached_tokens is not None and not request.output_token_ids:
            request.num_cached_tokens += num_blocks * self.kv_cache.block_size

    def _admit_waiting(
        self, budget: int, scheduled: dict[str, tuple[ScheduledRequest, list[tuple[int, int]]]]
    ) -> int:
        """Admit waiting requests in queue order while the budget, the seats and the pool allow;
        schedule their first chunk (or, with tier blocks ahead, their loads). Returns the budget left."""
        seats = _Seats.of(self.running)
        ranked = self._rank_waiting(budget, seats.num_seqs)
        latest = None  # the latest arrival admitted this step
        headroom = self._growth_blocks(self.config.admission_headroom_steps) if len(self.waiting) and budget > 0 else 0
        while len(self.waiting) and budget > 0:
            request = self.waiting.peek()
            need = seats.need(request)
            if self._must_wait(request, seats, need):
                break
            computed = self.kv_cache.get_computed_blocks(request)
            if self.kv_cache.is_prefix_in_flight(request, computed):
                break  # its next block is being computed now: admitted next step, it will hit it
            loads_ahead = self._tier_admission(request, computed)
            if loads_ahead is None:
                break
            num_hit = computed.num_tokens(self.kv_cache.block_size)
            num_new = 0 if loads_ahead else request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget, request.max_chunk_tokens or budget)
            if headroom and self.kv_cache.num_free_blocks - self.kv_cache.num_blocks_to_admit(request, num_new, computed) < headroom:
                break  # it would take blocks the running requests grow into soon (a preemption to come)
            allocation = self.kv_cache.allocate_slots(request, num_new, computed)
            if allocation is None:
                break
            self._admit(request, num_hit)
            latest = request.arrival_time if latest is None else max(latest, request.arrival_time)
            seats.add(request, need)
            if loads_ahead:
                _, computes = self._load_ahead(request, scheduled, [], make_room=False)  # preempts nobody
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                allocation = self.kv_cache.allocate_slots(request, num_new) if computes else None
                if allocation is None:
                    continue  # more to take, or no room for a chunk beside its loads: next step
            scheduled[request.request_id] = self._schedule_one(request, num_new, allocation)
            budget -= num_new
        if ranked and latest is not None:
            self._count_passed_over(latest)
        return budget

    def _must_wait(self, request: Request, seats: _Seats, need: int) -> bool:
        """Whether the queue's front waits for a running request to leave: past max_num_seqs (an
        n > 1 request counts all n, which fork at once), a beam search whose waiting beams do not
        all fit, or an adapter past the step's max_loras."""
        if seats.num_seqs + need > self.config.max_num_seqs:
            return True
        if request.beam is not None and not self._group_fits(request):
            return True
        return (request.lora_id is not None and request.lora_id not in seats.loras
                and len(seats.loras) >= (self.config.max_loras or 0))

    def _tier_admission(self, request: Request, computed) -> bool | None:
        """With a second tier whose blocks reach past the request's pool hit: True, admit it with
        the pool's hit and let it load the rest as it runs (in this step, computing after its
        loads, growing as a chunked prompt would); False, admit it with the pool's hit alone (no
        tier, nothing more there, or nothing runs and the pool cannot take the loads); None, it
        waits (another request loads its blocks now, or no room to load beside running requests)."""
        kv, connector = self.kv_cache, self.connector
        if connector is None:
            return False
        reach = kv.num_hit_blocks_with_tier(request, connector.can_supply)
        if reach <= computed.num_blocks:
            return False
        if kv.num_hit_blocks_with_tier(request, connector.can_load) < reach:
            return None  # next step those blocks are pool hits
        if computed.num_free() < kv.num_free_blocks:
            return True
        return None if self.running else False

    def _growth_blocks(self, num_steps: int) -> int:
        """New blocks the running requests take over their next `num_steps` tokens each (none past
        their max_tokens). O(running)."""
        if num_steps == 0:
            return 0
        bs, total = self.kv_cache.block_size, 0
        for r in self.running:
            max_tokens = r.sampling_params.max_tokens
            left = num_steps if max_tokens is None else min(num_steps, r.num_prompt_tokens + max_tokens - r.num_tokens)
            total += -(-(r.num_tokens + left) // bs) - -(-r.num_tokens // bs)
        return total

    def _admit(self, request: Request, num_hit: int) -> None:
        """Move the queue's front request to the running set with `num_hit` tokens from the cache."""
        self.waiting.pop()
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
            request.first_scheduled_time = time.time()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        request.admit_seq = next(self._admit_counter)
        request.admit_step = self._num_steps
        self.num_resumed += request.num_preemptions > 0
        self.running.append(request)

    def _rank_waiting(self, budget: int, num_seqs: int) -> bool:
        """Cache-aware: order the waiting queue for this step's admissions (not when nobody can be
        admitted: the order can wait). Returns whether it did."""
        ranked = (self.config.policy == "cache-aware" and budget > 0 and len(self.waiting) > 1
                  and num_seqs < self.config.max_num_seqs)
        if ranked:
            self.waiting.rank(self._cache_aware_key())
        return ranked

    def _count_passed_over(self, latest: float) -> None:
        """Every waiting request that arrived before `latest` (admitted this step) was passed over:
        one step nearer the bound."""
        for request in self.waiting:
            request.num_passed_over += request.arrival_time < latest

    def _cache_aware_key(self):
        """The cache-aware order: priority first; then preempted requests and those passed over
        by later arrivals in `max_wait_steps` steps (oldest first: the bound, after which nothing
        that arrived later goes ahead of them); then the most tokens reused from the cache, plus
        `aging_tokens_per_step` per step waited (so a cold request rises steadily)."""
        step, bound, aging = self._num_steps, self.config.max_wait_steps, self.config.aging_tokens_per_step
        reusable = reusable_tokens_counter(self.kv_cache)  # used by one sort: the cache does not change meanwhile

        def key(request: Request) -> tuple:
            if request.num_preemptions or request.num_passed_over >= bound:
                return (request.priority, 0, 0, request.arrival_time)
            waited = step - request.queued_step
            return (request.priority, 1, -(reusable(request) + aging * waited), request.arrival_time)
        return key

    def _group_fits(self, request: Request) -> bool:
        """A beam search is admitted only when all its waiting beams fit in the free blocks, so
        admitted beams never sit idle, holding blocks, waiting for siblings that cannot get in."""
        waiting = [
            self.requests[rid] for rid in self._sequences.get(request.user_request_id, ())
            if self.requests[rid].status is not RequestStatus.RUNNING
        ]
        budget = self.config.max_num_batched_tokens
        needed = sum(self.kv_cache.num_blocks_to_hold(r.num_tokens, r.max_chunk_tokens or budget) for r in waiting)
        return len(waiting) <= 1 or needed <= self.kv_cache.num_free_blocks

    def _schedule_one(
        self, request: Request, num_new: int, allocation: Allocation, drafts: list[int] | None = None
    ) -> tuple[ScheduledRequest, list[tuple[int, int]]]:
        """The step's entry for `request`: `num_new` tokens from its first uncomputed one, the
        last len(drafts) of them drafts after its last token (speculative decoding)."""
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new
        # tokens below what it had computed before a preemption are computed a second time
        self.num_recomputed_tokens += max(0, min(start + num_new, request.num_computed_before) - start)
        samples: list[SampleRow] = []
        drafts = drafts or []
        token_ids = request.all_token_ids[start : start + num_new - len(drafts)]
        if drafts:
            token_ids = token_ids + drafts
        if request.num_computed_tokens == request.num_tokens + len(drafts):
            samples = [SampleRow(request.request_id, request.sample_index, request.output_token_ids, drafts)]
            if request.num_samples_pending > 1:  # forks now: the new sequences sample from the prompt too
                parent = request.user_request_id
                samples += [SampleRow(child_request_id(parent, i), i) for i in range(1, request.num_samples_pending)]
        entry = ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_tables=allocation.block_tables,
            sampling_params=request.sampling_params,
            samples=samples,
            prompt_token_ids=request.prompt_token_ids,
            lora_id=request.lora_id,
        )
        return entry, allocation.copies

    def _choose_victim(self) -> Request:
        """`cheapest`: among the running requests of the lowest priority but the oldest, the one
        whose loss costs least (kv_cache.costs.preemption_cost) among those that free a block,
        sparing requests that resumed lately; ties go to the newest. `newest`: the most recently admitted (under
        priorities: the latest arrival of the lowest priority)."""
        if self.config.preemption_victim == "newest":
            if self.config.policy == "fcfs":
                return self.running[-1]
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.admit_seq))
        lowest = max(r.priority for r in self.running)
        candidates = [r for r in self.running if r.priority == lowest]
        if len(candidates) > 1 and candidates[0] is self.running[0]:
            candidates = candidates[1:]  # the oldest always progresses: no two requests starve each other
        candidates = [r for r in candidates if not self._is_resuming(r)] or candidates

        def cost(request: Request) -> tuple:
            num_tokens, num_freed = preemption_cost(self.kv_cache, request)
            return (num_freed == 0, num_tokens, -request.admit_seq)
        return min(candidates, key=cost)

    def _is_resuming(self, request: Request) -> bool:
        """A request re-admitted after a preemption, within `resume_protect_steps` of it or still
        recomputing what it lost: preempting it again is how preemption thrashes."""
        if not request.num_preemptions:
            return False
        recent = self._num_steps - request.admit_step < self.config.resume_protect_steps
        return recent or request.num_computed_tokens < request.num_computed_before

    def _victims(self) -> list[Request]:
        """The victim, with every running beam of its search when it is a beam: a search advances
        only when all its beams have their candidates, so its beams are preempted together."""
        victim = self._choose_victim()
        if victim.beam is None:
            return [victim]
        return [r for r in self.running if r.beam is victim.beam]

    def _preempt(
        self, victim: Request, scheduled: dict[str, tuple[ScheduledRequest, list[tuple[int, int]]]]
    ) -> int:
        """Free the victim's blocks and requeue it at the front; returns budget it gave back."""
        refund = 0
        if victim.request_id in scheduled:
            refund = scheduled.pop(victim.request_id)[0].num_tokens
        self.running.remove(victim)
        self._run_loading.discard(victim.request_id)
        self.kv_cache.free(victim, preempted=True)
        if self.connector is not None:
            self.num_swaps += self.connector.swap_preempted
        if victim.beam is not None:
            victim.beam.forget(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_before = max(victim.num_computed_before, victim.num_computed_tokens - refund)
        victim.num_computed_tokens = 0
        self.num_repreemptions += victim.num_preemptions > 0
        victim.num_preemptions += 1
        victim.queued_step = self._num_steps
        self.num_preemptions += 1
        self.waiting.add_preempted(victim)
        return refund

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Cache the blocks this step filled, append sampled tokens, fork n > 1 requests, finish
        those that hit a stop condition.

        Returns every sequence that received a token this step (finished ones included).
        """
        now = time.time()
        self._finish_tier_work(output, result)
        changed: list[Request] = []
        searches: dict[int, BeamGroup] = {}
        for entry in output.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or entry.request_id in self._rolled_back:
                continue  # gone, or a load it read failed: the runner skipped it
            if entry.samples and entry.samples[0].draft_token_ids:
                self._apply_verified(request, entry, result, now)
                changed.append(request)
                continue
            # The forward has now written KV for [0, start_pos + num_tokens): only now may those
            # full blocks be shared (before it, a preemption could leave hashes on unwritten KV).
            self.kv_cache.cache_blocks(request, entry.start_pos + entry.num_tokens)
            scored = result.prompt_logprobs.get(entry.request_id)
            if scored is not None:  # a recomputed chunk (after preemption) scores what is kept already
                first, entries = scored
                request.prompt_logprobs.extend(entries[max(0, 1 + len(request.prompt_logprobs) - first) :])
            if not entry.sample_ids:
                continue
            if request.beam is not None:
                request.beam.add_candidates(request.request_id, result.logprobs[request.request_id][0].top)
                searches[id(request.beam)] = request.beam
                continue
            if len(entry.sample_ids) > 1:
                sequences = [request] + [
                    self._fork(request, sid, index) for index, sid in enumerate(entry.sample_ids) if index
                ]
            else:
                sequences = [request]
            for sequence in sequences:
                (token,) = result.tokens[sequence.request_id]
                (logprob,) = result.logprobs.get(sequence.request_id, [None])
                self._append_token(sequence, token, logprob, now)
                changed.append(sequence)
        for search in searches.values():
            if search.is_ready:
                changed.extend(self._advance_search(search, now))
        return changed

    def _apply_verified(self, request: Request, entry: ScheduledRequest, result: ModelRunnerOutput, now: float) -> None:
        """Speculative decoding: append the tokens the runner kept (the drafts it agreed with,
        then its own next token) up to a stop condition; the request has computed the KV of its
        last token and of the drafts kept, and only that: the step's other slots (rejected
        drafts) are given back and never enter the prefix cache."""
        rid = request.request_id
        tokens = result.tokens[rid]
        logprobs = result.logprobs.get(rid) or [None] * len(tokens)
        reason, num_taken = None, 0
        for token, logprob in zip(tokens, logprobs):
            self._push_token(request, token, logprob, now)
            num_taken += 1
            reason = self._stop_reason(request)
            if reason is not None:
                break
        request.num_computed_tokens = entry.start_pos + num_taken
        request.spec_token_ids = []
        self.kv_cache.cache_blocks(request, request.num_computed_tokens)
        self.kv_cache.trim(request, request.num_computed_tokens)
        if reason is not None:
            self._finish(request, reason)

    def _finish_tier_work(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Apply the runner's tier reports: finished writes become findable; a request whose load
        failed stands at the blocks before the bad one, and if the runner left it out of the step
        (`result.left_out`) its chunk is void."""
        if self.connector is None:
            return
        if result.tier_stored:
            self.connector.finish_stores(result.tier_stored)
        self._rolled_back = set(result.left_out)
        waited = time.time() - self._step_start
        computing = {e.request_id for e in output.scheduled}
        for rid, outcome in self.connector.finish_loads(result.tier_loaded).items():
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # preempted or ended meanwhile: its loads only filled the prefix cache
            # computing beside its loads, it waited for the reads; otherwise for the whole step
            request.tier_load_wait += result.tier_read_seconds if rid in computing else waited
            self.kv_cache.note_extended(request, outcome.start, outcome.num_kept, outcome.num_loaded)
            self._count_cached(request, outcome.num_kept)
            if outcome.num_kept < outcome.num_planned:
                num_blocks = self.kv_cache.roll_back(request, outcome.start + outcome.num_kept)
                request.num_computed_tokens = num_blocks * self.kv_cache.block_size
        self._run_loading.clear()

    def _advance_search(self, search: BeamGroup, now: float) -> list[Request]:
        """Apply one beam-search round: fork the beams chosen more than once (they share every
        block; the first diverging write copies the partial one), append each continuation's
        token, drop the beams not chosen (their blocks are freed now). Returns the beams touched."""
        beams = {rid: self.requests[rid] for rid in search.running}
        decision = search.advance({rid: r.output_token_ids for rid, r in beams.items()})
        touched: list[Request] = []
        by_parent: dict[str, list[Continuation]] = {}
        for c in decision.continuations:
            by_parent.setdefault(c.parent_id, []).append(c)
        for parent_id, continuations in by_parent.items():
            parent = beams[parent_id]
            children = [(self._fork(parent, search.new_beam_id(parent.user_request_id), 0), c) for c in continuations[1:]]
            for beam, c in [(parent, continuations[0]), *children]:
                beam.output_token_ids.append(c.token_id)
                beam.all_token_ids.append(c.token_id)
                if beam.first_token_time is None:
                    beam.first_token_time = now
                search.running[beam.request_id] = c.cum_logprob
                touched.append(beam)
        for rid in decision.dropped:
            self._finish(beams[rid], FinishReason.STOP if decision.done else FinishReason.ABORT)
            touched.append(beams[rid])
        return touched

    def _fork(self, leader: Request, child_id: str, index: int) -> Request:
        """A new running sequence that shares all of `leader`'s blocks and tokens so far (an n > 1
        completion forked after the prompt, or a beam forked mid-generation)."""
        child = Request(
            request_id=child_id,
            prompt_token_ids=leader.prompt_token_ids,
            output_token_ids=list(leader.output_token_ids),
            beam=leader.beam,
            lora_id=leader.lora_id,
            lora_cache_key=leader.lora_cache_key,
            first_token_time=leader.first_token_time,
            sampling_params=leader.sampling_params,
            arrival_time=leader.arrival_time,
            eos_token_ids=leader.eos_token_ids,
            priority=leader.priority,
            cache_salt=leader.cache_salt,
            parent_id=leader.user_request_id,
            sample_index=index,
            status=RequestStatus.RUNNING,
            num_computed_tokens=leader.num_computed_tokens,
            num_cached_tokens=leader.num_cached_tokens,
            admit_seq=leader.admit_seq,
            max_chunk_tokens=leader.max_chunk_tokens,
        )
        self.kv_cache.fork(leader, child)
        self.requests[child_id] = child
        self._blocks_needed[child_id] = self._blocks_needed.get(leader.request_id, 0)
        self._sequences.setdefault(child.user_request_id, set()).add(child_id)
        self.running.append(child)
        leader.num_samples_pending = 1
        return child

    def _append_token(self, request: Request, token: int, logprob, now: float) -> None:
        self._push_token(request, token, logprob, now)
        reason = self._stop_reason(request)
        if reason is not None:
            self._finish(request, reason)

    @staticmethod
    def _push_token(request: Request, token: int, logprob, now: float) -> None:
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now

    def _stop_reason(self, request: Request) -> FinishReason | None:
        """Why the request ends with its last token (EOS, a stop token, max_tokens,
        max_model_len), or None."""
        params = request.sampling_params
        token, num_out = request.output_token_ids[-1], request.num_output_tokens
        # Under min_tokens the sampler bans EOS, unless a grammar leaves no other token (it is
        # complete): then the grammar wins and the request ends (it repeated EOS until min_tokens)
        if not params.ignore_eos and token in request.eos_token_ids and (
                num_out >= params.min_tokens or params.structured_outputs is not None):
            return FinishReason.STOP
        if num_out >= params.min_tokens and token in params.stop_token_ids:
            return FinishReason.STOP
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    # ---- ending requests ---------------------------------------------------------------------

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """End the given sequences wherever they are (a stop string, an abort); frees their blocks.
        Ending one beam of a beam search ends the whole search (its other beams would wait for it)."""
        ended = []
        expanded: list[str] = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and request.beam is not None:
                request.beam.done = True
                expanded.extend(self.sequences_of(request.user_request_id))
            else:
                expanded.append(rid)
        for rid in dict.fromkeys(expanded):
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is not RequestStatus.RUNNING:
                self.waiting.remove(request)
            self._finish(request, reason)
            ended.append(request)
        return ended

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.time()
        if request.pin and reason is not FinishReason.ABORT:
            self.kv_cache.pins.pin(request)
        self.kv_cache.remove(request)
        del self.requests[request.request_id]
        self._blocks_needed.pop(request.request_id, None)
        self._pending_pins.pop(request.request_id, None)
        siblings = self._sequences.get(request.user_request_id)
        if siblings is not None:
            siblings.discard(request.request_id)
            if not siblings:
                del self._sequences[request.user_request_id]
        self._finished_ids.append(request.request_id)

    def sequences_of(self, user_request_id: str) -> list[str]:
        """Internal ids of all live sequences of a user's request (one, or the n of a fork); O(n)."""
        return sorted(self._sequences.get(user_request_id, ()))

    # ---- reads -------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def reset_prefix_cache(self) -> int:
        return self.kv_cache.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        tier = kv.tier
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage(),
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.stats.num_queries_tokens,
            prefix_cache_hits=kv.stats.num_hits_tokens,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            num_scheduled_requests=self._last_num_scheduled_requests,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_repreemptions=self.num_repreemptions,
            num_resumed=self.num_resumed,
            tier_hits=kv.stats.num_tier_hits_tokens,
            tier_blocks_stored=tier.stats.num_stored if tier else 0,
            tier_blocks_loaded=tier.stats.num_loaded if tier else 0,
            tier_blocks_corrupt=tier.stats.num_corrupt if tier else 0,
            tier_usage=tier.usage() if tier else 0.0,
            tier_num_blocks=tier.num_slots if tier else 0,
            num_tier_loads=self.connector.num_load_rounds if self.connector else 0,
            num_swaps=self.num_swaps,
        )
