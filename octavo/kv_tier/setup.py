"""Opening the second KV tier at start: its medium and folder, and whether preempted requests
swap through it (measured against recomputing), or why the engine runs without it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from octavo.cache import cache_dir
from octavo.config import EngineConfig
from octavo.kv_cache.tier import TierIndex
from octavo.kv_tier import TierInUse, TierStore, TierUnavailable, open_disk_tier, open_host_tier, tier_fingerprint

logger = logging.getLogger("octavo")


@dataclass(slots=True)
class OpenedTier:
    store: TierStore  # what the runner moves blocks through
    index: TierIndex  # what the scheduler's side (kv_cache.connector) keeps track with
    swap_preempted: bool  # whether moving a preempted request's block out and back beats recomputing it


def open_tier(config: EngineConfig, slot_bytes: int, host_buffer: Callable[[int], Any], on_cuda: bool,
              attention_backend: str, prefill_seconds: Callable[[int], float]) -> OpenedTier | None:
    """The tier config.cache asks for: host memory on CUDA (pinned, `host_buffer`) or when asked,
    else files on disk; `prefill_seconds(n)` times one prefill of n tokens (the recompute side of
    the swap measurement). A tier that cannot be used (a full disk, a read-only or foreign folder,
    one held by another server) is logged once and None returned; with kv_offload_required, or
    when an engine of this same process still holds its folder, it is a ValueError."""
    cache = config.cache
    store = None
    try:
        if cache.kv_offload_medium == "host" or (cache.kv_offload_medium == "auto" and on_cuda):
            if cache.kv_offload_path is not None:
                logger.warning("KV tier in host memory: --kv-offload-path %s is not used", cache.kv_offload_path)
            store, index = open_host_tier(cache.kv_offload_bytes, slot_bytes, host_buffer)
            index.medium = "CPU"  # what KV events call host memory (vLLM's name)
        else:
            fingerprint = tier_fingerprint(config.model_path or str(config.model), config.model_config, config.dtype,
                                           cache.block_size, config.quantization, attention_backend,
                                           cache.prefix_caching_hash_algo, cache.cache_dtype, config.activation_dtype)
            store, index = open_disk_tier(tier_path(config, fingerprint), cache.kv_offload_bytes, slot_bytes, fingerprint)
        swap = _swap_is_cheaper(config, store, prefill_seconds)  # its probe writes and reads: a full disk fails it
    except TierUnavailable as exc:
        if store is not None:
            store.close()
        same_process = isinstance(exc, TierInUse) and exc.holder == os.getpid()
        if cache.kv_offload_required or same_process:
            raise ValueError(f"the second KV tier cannot be used: {exc}") from None
        logger.warning("KV tier off: %s; running without it (--kv-offload-required refuses to start instead)", exc)
        return None
    return OpenedTier(store, index, swap)


def _swap_is_cheaper(config: EngineConfig, store: TierStore, prefill_seconds: Callable[[int], float]) -> bool:
    """Measure what one block of a preempted request costs to move through the tier (out and
    back, cold) against recomputing it (a prefill step's time per token, best of two, times the
    block size); log both. Both grow with the request's length alike, so the choice holds for
    every victim of this engine. TierUnavailable if the tier's probe fails."""
    num_tokens = min(128, config.scheduler.max_num_batched_tokens, config.scheduler.max_model_len)
    move = store.measure_round_trip()
    recompute = min(prefill_seconds(num_tokens) for _ in range(2)) / num_tokens * config.cache.block_size
    swap = move < recompute
    logger.info("KV tier: a block costs %.2f ms to move out and back, %.2f ms to recompute: preempted requests %s",
                move * 1e3, recompute * 1e3, "swap through the tier" if swap else "recompute")
    return swap


def tier_path(config: EngineConfig, fingerprint: dict) -> str:
    """--kv-offload-path, or one folder per fingerprint: switching models never wipes another's tier."""
    if config.cache.kv_offload_path is not None:
        return config.cache.kv_offload_path
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return str(cache_dir() / "kv-tier" / digest)
