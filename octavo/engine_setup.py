"""What an engine is built from, before its first step: the model the user's arguments name
(loaded here, or by a tensor-parallel group), the KV cache's size, the second tier opened beside
the runner, and the prefix files pinned at start. LLMEngine wires the result; none of this runs
again while it serves."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from octavo.config import EngineConfig
from octavo.distributed.executor import TensorParallelGroup, WorkerSpec, start_tensor_parallel
from octavo.engine_args import EngineArgs, resolve_device
from octavo.kv_cache.manager import KVCacheManager
from octavo.kernels.kv_dtype_rule import auto_kv_cache_dtype
from octavo.kv_tier.setup import OpenedTier, open_tier
from octavo.memory import CUDA_GRAPH_RESERVE_BYTES, KVSizing, size_kv_cache
from octavo.model_runner import ModelRunner
from octavo.models.loader import (
    auto_dtype, describe_weights, load_model, resolve_activation_dtype, resolve_model, stored_dtype, weight_bytes,
)
from octavo.models.registry import load_model_config
from octavo.chat_template.sandbox import chat_template_source
from octavo.tokenizer import load_tokenizer, set_chat_template

if TYPE_CHECKING:
    from octavo.distributed.executor import TensorParallelExecutor

logger = logging.getLogger("octavo")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(slots=True)
class LoadedModel:
    """A model ready for an engine: rank 0's module (the whole model without tensor parallelism),
    the engine's config resolved against it, its tokenizer, the bytes its weights hold, and the
    group of the other ranks (None: one process)."""

    config: EngineConfig
    model: torch.nn.Module
    tokenizer: Any
    weight_bytes: int
    group: TensorParallelGroup | None


def load(args: EngineArgs) -> LoadedModel:
    """Load the model `args` name (the embedded default when args.model is None) on its device,
    in its dtype ("auto": what the weights and the CPU make fastest), over tensor-parallel ranks
    when asked."""
    torch.manual_seed(args.seed)
    model_dir = resolve_model(args.model)
    device = resolve_device(args.device)
    quantization = args.quantization
    if device.startswith("cuda") and quantization == "auto":
        quantization = "none"  # no GPU kernels for GGUF blocks: they are dequantized to the dtype
    dtype = ("bfloat16" if device.startswith("cuda") else "float32") if args.dtype == "auto" else args.dtype
    group = None
    args.check_model(load_model_config(model_dir))  # before any rank starts or weight loads
    activation_dtype, why = resolve_activation_dtype(args.activation_dtype, model_dir, quantization, device)
    if args.activation_dtype == "auto":
        logger.info("activation dtype auto: %s (%s)", activation_dtype, why)
    if args.tensor_parallel_size > 1:
        model, model_config, group = start_tensor_parallel(args.tensor_parallel_size, model_dir, WorkerSpec(
            str(model_dir), dtype, device=device, quantization=quantization, activation_dtype=activation_dtype))
    else:
        model, model_config = load_model(model_dir, dtype=DTYPES[dtype], device=device, quantization=quantization,
                                         activation_dtype=activation_dtype, write_in_background=True)
        if args.dtype == "auto":
            dtype, why = auto_dtype(model, device, stored_dtype(model_dir))
            logger.info("dtype auto (dense tensors, the activations between layers): %s (%s)", dtype, why)
            model = model.to(DTYPES[dtype])
    config = dataclasses.replace(args, dtype=dtype, device=device, activation_dtype=activation_dtype).to_config(model_config)
    config = dataclasses.replace(config, model_path=str(model_dir), quantization=quantization)
    if args.kv_cache_dtype == "auto":
        logger.info("KV cache dtype %s (%s; --kv-cache-dtype int8 holds half of float16's bytes, float32 is exact)",
                    config.cache.cache_dtype, auto_kv_cache_dtype(dtype, device)[1])
    logger.info(describe_weights(model))
    try:
        tokenizer = load_tokenizer(model_dir)
        if args.chat_template is not None:
            set_chat_template(tokenizer, chat_template_source(args.chat_template))
            logger.info("chat template: from --chat-template (the model's own replaced)")
    except BaseException:
        if group is not None:
            group.close()
        raise
    return LoadedModel(config, model, tokenizer, weight_bytes(model), group)


def kv_cache_size(executor: ModelRunner | TensorParallelExecutor, config: EngineConfig, weight_bytes: int) -> KVSizing:
    """Blocks for the KV cache; on CUDA, from a profiled worst-case step unless given."""
    on_cuda = config.device.startswith("cuda")
    peak = None
    if on_cuda and config.cache.num_blocks is None and config.cache.kv_cache_memory is None:
        peak = executor.profile_activation_peak(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
        logger.info("profiling step (%d tokens): activation peak %.2f GiB",
                    config.scheduler.max_num_batched_tokens, peak / 2**30)
    return size_kv_cache(
        config.cache, config.scheduler, config.model_config, weight_bytes, config.cache.cache_dtype,
        config.device, activation_peak=peak,
        graph_bytes=CUDA_GRAPH_RESERVE_BYTES if on_cuda and not config.enforce_eager else 0,
        max_model_len_explicit=config.max_model_len_explicit, dtype_bytes=DTYPES[config.dtype].itemsize,
    )


def open_runner_tier(runner: ModelRunner, config: EngineConfig) -> OpenedTier | None:
    """The second KV tier config.cache asks for (kv_tier.setup.open_tier), its store attached to
    the runner; None without one (or when it cannot be used and is not required)."""
    if not config.cache.kv_offload_bytes:
        return None

    def prefill_seconds(num_tokens: int) -> float:
        start = time.perf_counter()
        runner.profile_activation_peak(num_tokens, 1)
        return time.perf_counter() - start
    opened = open_tier(config, runner.tier_block_bytes(), runner.host_buffer, runner.device.type == "cuda",
                       runner.attention_backend, prefill_seconds)
    if opened is not None:
        runner.attach_tier(opened.store)
    return opened


def pin_prefix_files(pin_prefix: Callable[[Any], tuple[int, int]], kv: KVCacheManager, share: float,
                     paths: tuple[str, ...]) -> None:
    """`pin_prefix` (LLMEngine's) each file (text: a completion prompt; JSON: {"messages": [...]}
    or token ids), then log what is pinned (the start-up line names the files and the pool's
    `share` they may hold)."""
    names = []
    for path in paths:
        text = Path(path).read_text()
        prompt = json.loads(text) if path.endswith(".json") else text
        num_tokens, _ = pin_prefix(prompt)
        names.append(f"{Path(path).name} ({num_tokens} tokens)")
    logger.info("pinned prefixes: %s; %d of the pool's %d blocks (at most %d: --pinned-prefix-share %.2f)",
                ", ".join(names), kv.pins.num_blocks, kv.num_blocks, kv.pins.max_blocks, share)
