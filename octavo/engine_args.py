"""EngineArgs: the flat, user-facing engine options (the Python API and CLI flags) -> EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Options named as vLLM users know them. `model` None means the embedded default model."""

    model: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | None = None  # bytes
    memory_fraction: float | None = None
    num_kv_blocks: int | None = None  # override: exactly this many blocks
    scheduling_policy: str = "fcfs"
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto", "cpu" (the C++ kernel) or "reference" (torch)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "cpu", "reference"):
            raise ValueError(f"attention_backend must be auto, cpu or reference, got {self.attention_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def to_config(self, model_config: ModelConfig) -> EngineConfig:
        max_len = self.max_model_len or model_config.max_position
        if max_len > model_config.max_position:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"({model_config.max_position})"
            )
        return EngineConfig(
            model=self.model,
            model_config=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=self.kv_cache_memory,
                memory_fraction=self.memory_fraction,
                num_blocks=self.num_kv_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            seed=self.seed,
        )
