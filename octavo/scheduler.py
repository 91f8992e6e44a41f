"""Scheduler: decides each step how many tokens every request computes, and applies the results.

There are no prefill and decode phases. Every request has `num_computed_tokens` trying to catch
up with `num_tokens` (prompt plus sampled outputs); a step hands out at most
`max_num_batched_tokens` of that catching up, running requests first (a decode is 1 token, an
unfinished prompt a chunk), then waiting requests in queue order. A prompt larger than what is
left of the budget is chunked. Waiting requests are admitted in queue order: arrival (fcfs),
priority then arrival, or (cache-aware, policies.py) the most tokens reused from the cache with
aging and a bound on the wait. When the pool runs out of blocks, a running request is preempted
(policies.py: the one whose loss costs least, or the most recently admitted, vLLM's rule); its full
blocks stay in the prefix cache, so it resumes from what is still cached and recomputes the rest.
With a second KV tier that is a swap: blocks the pool evicts go to the tier, and a running request
whose next blocks are there takes them before it computes (the tier's connector loads them before
the step's forward). What a request can never exceed is checked when it is added (limits.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

from octavo.beam_search import BeamGroup, Continuation
from octavo.config import SchedulerConfig
from octavo.kv_cache.costs import growth_blocks
from octavo.kv_cache.manager import Allocation, KVCacheManager
from octavo.limits import RequestLimits
from octavo.outputs import (ModelRunnerOutput, PooledChunk, PreemptionStats, SampleRow, ScheduledRequest, SchedulerOutput,
                             SchedulerStats)
from octavo.pooling import finish_embedding
from octavo.policies import choose_victims, count_passed_over, rank_waiting
from octavo.request import FinishReason, Request, RequestStatus, child_request_id
from octavo.request_queue import make_waiting_queue


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
        self.preemption = PreemptionStats()
        self._num_steps = 0
        self._run_loading: set[str] = set()  # running requests whose next blocks load this step
        self._rolled_back: set[str] = set()  # requests the runner left out (a load failed): their chunk is void
        # with a second tier, running requests take blocks ahead of their computed tokens from it
        self.connector = kv_cache.connector
        self._step_start = 0.0  # when the last step was scheduled: loads wait for its end
        self._admit_counter = itertools.count(1)
        self._finished_ids: list[str] = []
        self.limits = RequestLimits(config, kv_cache)  # what a request can never exceed
        self._last_num_scheduled_tokens = 0
        self._last_num_scheduled_requests = 0
        self._drafts: dict[str, list[int]] = {}  # this step's drafts (speculative decoding), by request
        self._num_pooling = 0  # embedding requests held (waiting or running)
        self._pooling_room: int | None = None  # this step's tokens left for embedding requests (None: no cap)

    # ---- admission ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises limits.RequestRefused when it could never fit; nothing is kept then."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.limits.admit(request)
        self.requests[request.request_id] = request
        self._num_pooling += request.sampling_params.pooling is not None
        self._sequences.setdefault(request.user_request_id, set()).add(request.request_id)
        if request.beam is not None:
            request.beam.start(request.request_id)
        request.queued_step = self._num_steps
        self.waiting.add(request)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Choose this step's work. Mutates queues, block tables and `num_computed_tokens`.
        `drafts`: tokens speculative decoding drafted after running requests' last tokens (the
        SpecDecodeController's): a decoding request verifies those the step's budget leaves room for.

        Running requests are served in admission order; if one cannot get blocks, victims
        (policies.choose_victims) are preempted until it can (or until it is itself the victim). Waiting
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
        self._pooling_room = self._pooling_budget()
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
        num_new = min(request.num_tokens - request.num_computed_tokens, budget, request.max_chunk_tokens or budget,
                      self._pooling_cap(request, budget))
        if num_new == 0:  # a beam waiting for the other beams of its search, or embeddings' share spent
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
        self._take_pooling_room(request, num_new)
        return budget - num_new

    def _pooling_budget(self) -> int | None:
        """The step's tokens for embedding requests: a share of the running generation requests
        (rounded up, at least 1) while generation requests are held; None (no cap) otherwise."""
        share = self.config.pooling_share
        if share is None or not self._num_pooling or len(self.requests) == self._num_pooling:
            return None  # (no embedding request held: nothing to count, the common step)
        num_generating = sum(r.sampling_params.pooling is None for r in self.running)
        return max(1, math.ceil(share * num_generating))

    def _pooling_cap(self, request: Request, budget: int) -> int:
        """The most tokens `request` may compute this step beside the budget: the embeddings'
        share left when it is an embedding request and the share is capped."""
        if request.sampling_params.pooling is None or self._pooling_room is None:
            return budget
        return self._pooling_room

    def _take_pooling_room(self, request: Request, num_new: int) -> None:
        if request.sampling_params.pooling is not None and self._pooling_room is not None:
            self._pooling_room -= num_new

    def _with_room(self, request: Request, attempt, scheduled, preempted: list[str]):
        """attempt() until it returns something, preempting victims (policies.choose_victims)
        between tries. Returns its result (None when `request` itself became the victim) and the
        budget victims gave back."""
        refund = 0
        result = attempt()
        while result is None:
            for victim in choose_victims(self.config, self.kv_cache, self.running, self._num_steps):
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
        ranked = rank_waiting(self.config, self.kv_cache, self.waiting, self._num_steps, budget, seats.num_seqs)
        latest = None  # the latest arrival admitted this step
        headroom = (growth_blocks(self.kv_cache, self.running, self.config.admission_headroom_steps)
                    if len(self.waiting) and budget > 0 else 0)
        passed: list[Request] = []  # embedding requests at the front, passed while their share is spent
        while len(self.waiting) and budget > 0:
            request = self.waiting.peek()
            if self._pooling_cap(request, budget) == 0:
                passed.append(self.waiting.pop())
                continue
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
            num_new = min(num_new, budget, request.max_chunk_tokens or budget, self._pooling_cap(request, budget))
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
            self._take_pooling_room(request, num_new)
            budget -= num_new
        for request in reversed(passed):  # back at the front, in their order
            self.waiting.add_preempted(request)
        if ranked and latest is not None:
            count_passed_over(self.waiting, latest)
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
        self.preemption.num_resumed += request.num_preemptions > 0
        self.running.append(request)

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
        self.preemption.num_recomputed_tokens += max(0, min(start + num_new, request.num_computed_before) - start)
        samples: list[SampleRow] = []
        drafts = drafts or []
        token_ids = request.all_token_ids[start : start + num_new - len(drafts)]
        if drafts:
            token_ids = token_ids + drafts
        if request.num_computed_tokens == request.num_tokens + len(drafts) and request.sampling_params.pooling is None:
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
            self.preemption.num_swaps += self.connector.swap_preempted
        if victim.beam is not None:
            victim.beam.forget(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_before = max(victim.num_computed_before, victim.num_computed_tokens - refund)
        victim.num_computed_tokens = 0
        self.preemption.num_repreemptions += victim.num_preemptions > 0
        victim.num_preemptions += 1
        victim.queued_step = self._num_steps
        self.preemption.num_preemptions += 1
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
            if request.sampling_params.pooling is not None:
                if self._pool(request, result.pooled.get(entry.request_id)):
                    changed.append(request)
                continue
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

    def _pool(self, request: Request, chunk: PooledChunk | None) -> bool:
        """Take an embedding request's pooled chunk; once its prompt is computed, set its embedding
        and finish it (True). A chunk at position 0 starts the sum over (after a preemption, the
        prompt is computed again from there: a mean or cls request takes no prefix-cache hits)."""
        pooling = request.sampling_params.pooling
        assert pooling is not None
        if chunk is not None:
            if pooling.pooling_type == "mean":
                if chunk.start_pos == 0 or request.pooled_sum is None:
                    request.pooled_sum = list(chunk.values)
                else:
                    request.pooled_sum = [a + b for a, b in zip(request.pooled_sum, chunk.values)]
            else:
                request.pooled_sum = list(chunk.values)
        if request.num_computed_tokens < request.num_prompt_tokens or request.pooled_sum is None:
            return False
        request.embedding = finish_embedding(request.pooled_sum, request.num_prompt_tokens, pooling)
        self._finish(request, FinishReason.STOP)
        return True

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
            request.push_token(token, logprob, now)
            num_taken += 1
            reason = request.stop_reason(self.config.max_model_len)
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
        """A new running sequence that shares all of `leader`'s blocks and tokens so far."""
        child = leader.fork(child_id, index)
        self.kv_cache.fork(leader, child)
        self.requests[child_id] = child
        self.limits.fork(leader, child_id)
        self._sequences.setdefault(child.user_request_id, set()).add(child_id)
        self.running.append(child)
        leader.num_samples_pending = 1
        return child

    def _append_token(self, request: Request, token: int, logprob, now: float) -> None:
        request.push_token(token, logprob, now)
        reason = request.stop_reason(self.config.max_model_len)
        if reason is not None:
            self._finish(request, reason)

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
        self._num_pooling -= request.sampling_params.pooling is not None
        request.finish_reason = reason
        request.finish_time = time.time()
        if request.pin and reason is not FinishReason.ABORT:
            self.kv_cache.pins.pin(request)
        self.kv_cache.remove(request)
        del self.requests[request.request_id]
        self.limits.forget(request.request_id)
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

    def lora_ids(self) -> tuple[set[int], set[int]]:
        """The LoRA ids of running requests, and of waiting ones (an id in both counts as running)."""
        running = {r.lora_id for r in self.running if r.lora_id is not None}
        return running, {r.lora_id for r in self.waiting if r.lora_id is not None} - running

    def reset_prefix_cache(self) -> int:
        return self.kv_cache.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage(),
            num_free_blocks=kv.num_free_blocks,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            num_scheduled_requests=self._last_num_scheduled_requests,
            prefix=dataclasses.replace(kv.stats),
            preemption=dataclasses.replace(self.preemption),
            tier=None if self.connector is None else self.connector.report(),
        )
