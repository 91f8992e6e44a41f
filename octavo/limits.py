"""What a request can never exceed: the checks a request passes before it is queued, and the
ledger they need (the most blocks each live request can hold, the blocks pins still to be
computed will hold). A request refused here is never kept; one accepted can always run alone."""

from __future__ import annotations

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request


class RequestRefused(ValueError):
    """A request that can never be served with this engine's limits."""


class RequestLimits:
    """Checks requests against the engine's limits and keeps the ledger of live ones."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._blocks_needed: dict[str, int] = {}  # live request -> the most blocks it can hold
        self._pending_pins: dict[str, int] = {}  # live pin request -> the blocks it pins when it ends

    def admit(self, request: Request) -> None:
        """Check `request` (RequestRefused) and, when it fits, enter it in the ledger; sets its
        largest prompt chunk (`max_chunk_tokens`)."""
        num_blocks, max_chunk = self.check(request)
        request.max_chunk_tokens = max_chunk
        self._blocks_needed[request.request_id] = num_blocks
        if request.pin:
            self._pending_pins[request.request_id] = self.kv_cache.pins.num_to_pin(request)

    def fork(self, leader: Request, child_id: str) -> None:
        """A sequence forked from `leader` can hold as many blocks as it."""
        self._blocks_needed[child_id] = self._blocks_needed.get(leader.request_id, 0)

    def forget(self, request_id: str) -> None:
        self._blocks_needed.pop(request_id, None)
        self._pending_pins.pop(request_id, None)

    def check(self, request: Request) -> tuple[int, int | None]:
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
            self._check_pin(request)
        kv = self.kv_cache
        # pinned blocks, and those pins not yet computed will hold, are not for it (but those its
        # prompt starts with)
        num_pinned = kv.pins.num_blocks + sum(self._pending_pins.values())
        room = kv.num_blocks - num_pinned + kv.pins.num_hits(request)
        budget = self.config.max_num_batched_tokens
        max_chunk = None
        num_blocks = width * kv.num_blocks_to_hold(total, budget)
        if num_blocks > room and any(w is not None for w in kv.group_windows):
            low, high = 1, budget - 1  # the largest chunk that fits: blocks grow with the chunk
            while low < high:
                mid = (low + high + 1) // 2
                if width * kv.num_blocks_to_hold(total, mid) <= room:
                    low = mid
                else:
                    high = mid - 1
            if width * kv.num_blocks_to_hold(total, low) <= room:
                max_chunk, num_blocks = low, width * kv.num_blocks_to_hold(total, low)
            else:
                num_blocks = width * kv.num_blocks_to_hold(total, 1)
        if num_blocks > room:
            pinned = f", {num_pinned} of them pinned" if num_pinned else ""
            raise RequestRefused(
                f"the request needs up to {total} tokens = {num_blocks} KV blocks of {kv.block_size}, "
                f"but the whole KV cache has {kv.num_blocks} blocks{pinned} "
                f"({kv.num_blocks * kv.block_size} tokens); "
                "shorten it or give the cache more memory"
            )
        return num_blocks, max_chunk

    def _check_pin(self, request: Request) -> None:
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
