"""KV-cache sizing: how many bytes the cache gets, and how many blocks that makes."""

from __future__ import annotations

import os
from dataclasses import dataclass

from octavo.config import CacheConfig, ModelConfig, SchedulerConfig

GiB = 1 << 30
# On the CPU the default is a fixed budget, as vLLM's CPU backend does (its KV-cache space
# setting): "a fraction of RAM" would take most of a shared machine's memory.
CPU_DEFAULT_KV_BYTES = 4 * GiB
CPU_DEFAULT_MAX_SHARE = 0.25
GPU_DEFAULT_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class KVSizing:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once."""
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        return self.num_blocks / blocks_per_seq

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_bytes / GiB:.2f} GiB; max concurrency at max_model_len {self.max_model_len}: "
            f"{self.max_concurrency:.2f} requests"
        )


def keep_freed_memory_mapped() -> bool:
    """Ask glibc malloc to keep freed blocks of up to 32 MiB instead of returning them to the OS.

    A step allocates activations of several MiB per op; by default glibc serves each from a fresh
    mmap and unmaps it on free, so every op pays page faults on first touch (measured here: a
    37 MB copy takes 18 ms into fresh memory, 2 ms into reused memory). Process-wide, like
    torch.set_num_threads; called when a CPU model runner starts. Returns False off glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1
        return libc.mallopt(m_trim_threshold, 1 << 30) == 1 and ok
    except (OSError, AttributeError):
        return False


def total_device_memory(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_bytes(model: ModelConfig, sched: SchedulerConfig, dtype_bytes: int) -> int:
    """A generous estimate of one step's transient memory: per scheduled token the hidden state,
    fused q/k/v and gate/up outputs (a few live at once), plus float32 logits and sampler copies
    for every sequence that samples."""
    per_token = 4 * model.hidden_size + 2 * model.intermediate_size + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    return 2 * sched.max_num_batched_tokens * per_token * dtype_bytes + 3 * sched.max_num_seqs * model.vocab_size * 4


def size_kv_cache(
    cache: CacheConfig, sched: SchedulerConfig, model: ModelConfig, weight_bytes: int, kv_dtype_bytes: int, device: str
) -> KVSizing:
    """Blocks from, in order of precedence: an explicit block count, kv_cache_memory bytes, a
    memory fraction of the device (minus weights and activations), or the device default."""
    bytes_per_block = cache.block_size * model.kv_bytes_per_token(kv_dtype_bytes)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        else:
            fraction = cache.memory_fraction
            if fraction is None and not device.startswith("cuda"):
                budget = min(CPU_DEFAULT_KV_BYTES, int(CPU_DEFAULT_MAX_SHARE * total_device_memory(device)))
            else:
                fraction = GPU_DEFAULT_FRACTION if fraction is None else fraction
                budget = int(fraction * total_device_memory(device)) - weight_bytes - activation_bytes(model, sched, kv_dtype_bytes)
        num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: one block of {cache.block_size} tokens needs {bytes_per_block} bytes; "
            "raise kv_cache_memory or memory_fraction"
        )
    return KVSizing(num_blocks, cache.block_size, bytes_per_block, sched.max_model_len)
