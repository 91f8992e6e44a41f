"""KV-cache sizing: how many bytes the cache gets, and how many blocks that makes."""

from __future__ import annotations

import os
from dataclasses import dataclass

from octavo.config import CacheConfig, ModelConfig, SchedulerConfig, blocks_to_hold

GiB = 1 << 30
GPU_DEFAULT_UTILIZATION = 0.9  # of the GPU's memory, when --gpu-memory-utilization is not given
# On the CPU the default is a fixed budget, as vLLM's CPU backend does (its KV-cache space
# setting): "a fraction of RAM" would take most of a shared machine's memory.
CPU_DEFAULT_KV_BYTES = 4 * GiB
CPU_DEFAULT_MAX_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class KVSizing:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    # blocks one decoding sequence of max_model_len tokens holds (config.blocks_to_hold), and what
    # a cache blind to sliding windows would hold for it (the same without sliding layers)
    blocks_per_seq: int
    window_blind_blocks_per_seq: int
    groups: str = ""  # the KV groups, in words (empty: one group of every layer)
    capped_from: int | None = None  # the model's max_model_len, when it did not fit and was capped
    kv_dtype: str = "float32"  # what a K or V value is held in (KV_CACHE_DTYPES)
    bytes_per_token: int = 0  # of KV over all layers, scales included

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once."""
        return self.num_blocks / self.blocks_per_seq

    def describe(self) -> str:
        line = (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_bytes / GiB:.2f} GiB ({self.kv_dtype}, {self.bytes_per_token:,} bytes a token); "
            f"max concurrency at max_model_len {self.max_model_len}: {self.max_concurrency:.2f} requests"
        )
        if self.capped_from is not None:
            line += (f"; max_model_len capped to {self.max_model_len} from the model's {self.capped_from}, which "
                     "does not fit the cache (--max-model-len sets it; --kv-cache-memory gives the cache more)")
        if self.groups:
            blind = self.num_blocks / self.window_blind_blocks_per_seq
            line += (f" ({self.blocks_per_seq} blocks each; {blind:.2f} if windows were ignored); "
                     f"KV groups: {self.groups}")
        return line


def describe_groups(model: ModelConfig) -> str:
    """"1 global + 5 sliding-window (512 tokens) groups of 3 layers"; "" for a single group."""
    groups = model.kv_groups()
    if len(groups) == 1 and groups[0].window is None:
        return ""
    num_conv = sum(g.kind == "conv" for g in groups)
    num_sliding = sum(g.window is not None for g in groups) - num_conv
    kinds = [f"{len(groups) - num_sliding - num_conv} global"]
    if num_sliding:
        kinds.append(f"{num_sliding} sliding-window ({model.sliding_window} tokens)")
    if num_conv:
        kinds.append(f"{num_conv} short-convolution ({model.conv_kernel} positions)")
    return f"{' + '.join(kinds)} group{'s' if len(groups) > 1 else ''} of {len(groups[0].layers)} layers"


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


# Memory CUDA graphs of decode steps may take, reserved before the KV cache is sized (vLLM
# measures it; we reserve a bound and log what the capture really took).
CUDA_GRAPH_RESERVE_BYTES = 512 << 20


def size_kv_cache(
    cache: CacheConfig,
    sched: SchedulerConfig,
    model: ModelConfig,
    weight_bytes: int,
    kv_dtype: str,
    device: str,
    activation_peak: int | None = None,
    graph_bytes: int = 0,
    max_model_len_explicit: bool = True,
    dtype_bytes: int = 4,
) -> KVSizing:
    """Blocks from, in order of precedence: an explicit block count, kv_cache_memory bytes, a share
    of the device (gpu_memory_utilization; on CUDA 0.9 by default) minus the weights, the step's
    activation peak (`activation_peak` as measured by a profiling step, else an estimate) and
    `graph_bytes`, or the CPU's fixed default. `kv_dtype`: what the cache holds (KV_CACHE_DTYPES);
    `dtype_bytes`: the activations' bytes a value (the estimate of their peak).

    When not even one sequence of max_model_len tokens fits: a max_model_len the user set is an
    error naming both numbers and the flags to change (vLLM refuses to start so too); the model's
    own (`max_model_len_explicit` False) is capped to the longest that fits, as llama.cpp's default
    context is (`KVSizing.capped_from` says so)."""
    bytes_per_block = model.kv_bytes_per_block(cache.block_size, kv_dtype)
    windows = tuple(g.window for g in model.kv_groups())
    # a decoding sequence's blocks (a window group: its window's); while a chunk of a prompt is
    # computed its window groups briefly hold the chunk's blocks too (the scheduler admits by that)
    blocks_per_seq = blocks_to_hold(windows, sched.max_model_len, cache.block_size, max_chunk=1)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    elif cache.kv_cache_memory is not None:
        num_blocks = cache.kv_cache_memory // bytes_per_block
    elif cache.gpu_memory_utilization is None and not device.startswith("cuda"):
        budget = min(CPU_DEFAULT_KV_BYTES, int(CPU_DEFAULT_MAX_SHARE * total_device_memory(device)))
        num_blocks = budget // bytes_per_block
    else:
        utilization = GPU_DEFAULT_UTILIZATION if cache.gpu_memory_utilization is None else cache.gpu_memory_utilization
        total = total_device_memory(device)
        peak = activation_bytes(model, sched, dtype_bytes) if activation_peak is None else activation_peak
        budget = int(utilization * total) - weight_bytes - peak - graph_bytes
        num_blocks = max(0, budget) // bytes_per_block
        if num_blocks < blocks_per_seq and max_model_len_explicit:
            raise ValueError(
                f"not even one sequence of max_model_len {sched.max_model_len} tokens fits in the KV cache: "
                f"{utilization:.2f} x {total / GiB:.1f} GiB of {device} memory, minus {weight_bytes / GiB:.2f} GiB "
                f"of weights, {peak / GiB:.2f} GiB of activation peak and {graph_bytes / GiB:.2f} GiB for CUDA "
                f"graphs, leaves {num_blocks} blocks of {cache.block_size} tokens where {blocks_per_seq} are needed; "
                "raise --gpu-memory-utilization, or lower --max-model-len (or --max-num-batched-tokens)"
            )
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: one block of {cache.block_size} tokens needs {bytes_per_block} bytes; "
            "raise kv_cache_memory or gpu_memory_utilization"
        )
    max_len, capped_from = sched.max_model_len, None
    if num_blocks < blocks_per_seq:
        longest = longest_fitting_len(windows, num_blocks, cache.block_size, sched.max_model_len)
        if max_model_len_explicit or longest < 2:
            raise ValueError(
                f"--max-model-len {sched.max_model_len} does not fit the KV cache: one sequence of it needs "
                f"{blocks_per_seq} blocks of {cache.block_size} tokens, the cache holds {num_blocks} "
                f"({num_blocks * bytes_per_block / GiB:.2f} GiB); lower --max-model-len (at most {longest} fits) or "
                "give the cache more memory (--kv-cache-memory, --num-kv-blocks, --gpu-memory-utilization)")
        max_len, capped_from = longest, sched.max_model_len
        blocks_per_seq = blocks_to_hold(windows, max_len, cache.block_size, max_chunk=1)
    blind = len(windows) * -(-max_len // cache.block_size)
    return KVSizing(num_blocks, cache.block_size, bytes_per_block, max_len, blocks_per_seq, blind,
                    describe_groups(model), capped_from, kv_dtype, model.kv_bytes_per_token(kv_dtype))


def longest_fitting_len(windows: tuple[int | None, ...], num_blocks: int, block_size: int, upper: int) -> int:
    """The longest sequence (at most `upper` tokens) whose blocks, decoding (`blocks_to_hold`), fit
    in `num_blocks`; 0 if not even one token's do."""
    low, high = 0, upper  # blocks_to_hold grows with the length: the largest that fits, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if blocks_to_hold(windows, mid, block_size, max_chunk=1) <= num_blocks:
            low = mid
        else:
            high = mid - 1
    return low
