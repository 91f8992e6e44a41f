"""EngineArgs: the flat, user-facing engine options (the Python API and CLI flags) -> EngineConfig."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from octavo.config import (
    DEFAULT_ADMISSION_HEADROOM_STEPS,
    DEFAULT_POOLING_SHARE,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_WAIT_STEPS,
    DEFAULT_SPEC_MAX_BATCH,
    ACTIVATION_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    PREEMPTION_VICTIMS,
    PREFIX_HASH_ALGOS,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from octavo.kernels.kv_dtype_rule import resolve_kv_cache_dtype
from octavo.memory import GPU_DEFAULT_UTILIZATION

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "reference")


def lora_module_text(entry: object) -> object:
    """A --lora-modules entry as name=path: vLLM's JSON form ({"name", "path", "base_model_name"})
    becomes its name=path (the base is the served model either way); anything else is kept as it
    is, for the check that names it."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            value = json.loads(entry)
        except ValueError:
            return entry
        if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("path"), str):
            return f"{value['name']}={value['path']}"
    return entry


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Options named as vLLM users know them. `model` None means the embedded default model."""

    model: str | None = field(default=None, metadata={
        "help": "HF model directory, .gguf file or packaged model name (gemma3-270m) (default: the embedded SmolLM2-135M-Instruct)"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per KV-cache block"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output, in tokens (default: the model's max_position_embeddings, capped to what "
                "the KV cache holds for one sequence; a value the cache cannot hold is refused at start)"})
    max_num_seqs: int = field(default=DEFAULT_MAX_NUM_SEQS, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, metadata={
        "help": "token budget of one step"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "share full KV blocks between requests by a hash of their tokens"})
    prefix_caching_hash_algo: str = field(default="sha256", metadata={
        "help": "how a full block's chained hash is made: sha256 of a pickle, or sha256_cbor (canonical CBOR, as "
                "vLLM's: reproducible outside the process, e.g. by a KV-event subscriber)", "choices": PREFIX_HASH_ALGOS})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prompts into chunks that share a step with decodes"})
    kv_cache_memory: int | None = field(default=None, metadata={
        "help": "bytes for the KV cache, e.g. 512MiB (default on CPU: 4 GiB, at most a quarter of RAM)", "bytes": True})
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "share of device memory for weights, activations and KV cache (vLLM's flag; on CUDA "
                f"default {GPU_DEFAULT_UTILIZATION}: the KV cache gets what a profiling step leaves; on the CPU "
                "unset means a fixed KV budget, see kv_cache_memory)"})
    kv_offload_size: int = field(default=0, metadata={
        "help": "a second KV tier of this many bytes on local disk, e.g. 20GiB: blocks the pool evicts go "
                "there, prefix lookups continue into it, preempted requests swap through it, and a restart "
                "finds it again (default 0: off)", "bytes": True})
    kv_offload_path: str | None = field(default=None, metadata={
        "help": "folder of the second KV tier (default: one per model and setting under the cache directory)"})
    kv_offload_medium: str = field(default="auto", metadata={
        "help": "where the second KV tier lives: disk (files, kept across restarts), host (memory: pinned on "
                "CUDA, gone at exit), or auto (host on CUDA, disk on the CPU)", "choices": ("auto", "disk", "host")})
    kv_offload_required: bool = field(default=False, metadata={
        "help": "refuse to start when the second KV tier cannot be used (a full disk, a read-only or foreign "
                "folder, one another server holds) instead of running without it (logged)"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "exactly this many KV blocks (overrides the memory-based sizing)"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs; priority (the request's `priority` field: lower runs first, and is preempted last); or "
                "cache-aware (waiting requests that reuse the most cached tokens first, with aging and a bound: "
                "see max_wait_steps; the priority field still comes first)",
        "choices": SCHEDULING_POLICIES})
    max_wait_steps: int = field(default=DEFAULT_MAX_WAIT_STEPS, metadata={
        "help": "cache-aware: a waiting request passed over (a later arrival admitted first) in this many steps "
                "goes ahead of everything that arrived after it"})
    preemption_victim: str = field(default="cheapest", metadata={
        "help": "which running request a full KV cache preempts: cheapest (fewest tokens to recompute, or blocks "
                "to swap; not one that just resumed) or newest (the last admitted, vLLM's rule)",
        "choices": PREEMPTION_VICTIMS})
    pinned_prefix: tuple[str, ...] = field(default=(), metadata={
        "help": "prompts whose KV stays in the pool for good (never evicted), computed at start: text files (a "
                "completion prompt) or JSON files ({\"messages\": [...]}: the chat template's rendering, a system "
                "prompt for instance; or a list of token ids); needs prefix caching", "nargs": True})
    pinned_prefix_share: float = field(default=0.25, metadata={
        "help": "the most of the KV pool pinned prefixes may hold (default 0.25)"})
    admission_headroom_steps: int = field(default=DEFAULT_ADMISSION_HEADROOM_STEPS, metadata={
        "help": "admit a waiting request only while the KV cache keeps room for the running requests' next N "
                "tokens each (0: admit while any block is free, vLLM's rule); fewer preemptions, fewer tokens "
                "recomputed"})
    pooling_share: float = field(default=DEFAULT_POOLING_SHARE, metadata={
        "help": "embedding requests' prompt tokens per step while generation runs, per running generation "
                "request (default 0.35: 16 chats let 6 in, and their TPOT stays within ~1.2x of their own; "
                "docs/BENCHMARKS.md); with no generation embeddings take the whole step"})
    speculative_method: str | None = field(default=None, metadata={
        "help": "speculative decoding (default: off): ngram (drafts from the request's own prompt and output: "
                "prompt lookup), suffix (from its own tokens and recent requests') or draft (a smaller model's, "
                "--speculative-model); each decoding step also "
                "verifies the drafts and keeps those the model agrees with: greedy output is unchanged, sampled "
                "output keeps its distribution", "choices": SPECULATIVE_METHODS})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "most drafted tokens verified per request per step (each request drafts fewer while few of its drafts are kept)"})
    speculative_max_batch: int = field(default=DEFAULT_SPEC_MAX_BATCH, metadata={
        "help": "no drafts while more than this many requests decode (a wide step gains little from them)"})
    speculative_model: str | None = field(default=None, metadata={
        "help": "speculative method draft: the drafting model (a smaller one of the same tokenizer; as MODEL "
                "takes it: a directory, a .gguf or a packaged name); it drafts greedily with a KV cache of its own"})
    prompt_lookup_min: int = field(default=2, metadata={"help": "ngram drafting: the shortest n-gram matched"})
    prompt_lookup_max: int = field(default=4, metadata={"help": "ngram drafting: the longest n-gram matched (tried first)"})
    speculative_config: str | None = field(default=None, metadata={
        "help": "vLLM's form, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                "\"prompt_lookup_min\": 2} (sets the flags of the same names)"})
    kv_events_config: str | None = field(default=None, metadata={
        "help": "vLLM's KV events, as JSON: {\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}: every block the prefix cache "
                "stores or evicts (and the KV tier's), msgpack over ZMQ (docs/API.md; needs pip install 'octavo[kv-events]')"})
    dtype: str = field(default="auto", metadata={
        "help": "activations, dense weights and KV cache. auto: float32 for quantized weights (the C++ "
                "kernels' input); for dense weights stored as bfloat16, bfloat16 where the CPU has AMX-BF16 "
                "tiles; else float32 (decided from the file and the CPU's flags, never from a timing)",
        "choices": SUPPORTED_DTYPES})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "what the KV cache holds each value in (vLLM's flag): auto (the model's dtype), float32, "
                "bfloat16, float16 (half the bytes), or int8 (a quarter and a scale: 1.06 bytes a value, symmetric, "
                "one float32 scale per token and KV head; read in place by the CPU kernels; not exact). The "
                "start-up line says what the cache holds and its bytes a token",
        "choices": KV_CACHE_DTYPE_CHOICES})
    quantization: str = field(default="auto", metadata={
        "help": "auto: a GGUF's Q4_0/Q4_1/Q8_0 tensors stay quantized (others, and HF weights, dense); "
                "none: dequantize everything to the dtype; int8 / int4: quantize every linear layer at load "
                "(Q8_0 symmetric / Q4_1 with a zero point, groups of 32; the embedding to Q8_0)",
        "choices": QUANTIZATION_CHOICES})
    activation_dtype: str = field(default="auto", metadata={
        "help": "quantized layers on the CPU: auto (int8 where it measured faster for this CPU kind and "
                "model size: every size without AVX-512, 512 MB of quantized weights and up with it; the "
                "start-up line says which and why), float32 (exact: every weight rebuilt as the file "
                "defines it, float32 products; greedy output equals transformers') or int8 (activations "
                "quantized per 32 values, integer dot products: 1.5-3x faster layers, not exact; prompts "
                "of 64+ tokens through AMX-BF16 tiles where the CPU runs them; `octavo eval` measures the "
                "accuracy cost)",
        "choices": ACTIVATION_CHOICES})
    device: str = field(default="auto", metadata={
        "help": "auto (CUDA when torch sees a GPU, else the CPU), cpu or cuda", "choices": DEVICES})
    attention_backend: str = field(default="auto", metadata={
        "help": "kernels of a step: triton (auto on CUDA), cpu (the C++ kernels; auto on a float32 CPU, "
                "compiled once per machine) or the torch reference", "choices": ATTENTION_BACKENDS})
    enforce_eager: bool = field(default=True, metadata={
        "help": "run every step eagerly; --no-enforce-eager captures CUDA graphs of decode-only steps at "
                "padded batch sizes (CUDA with the triton backend; off by default until verified on a GPU)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "shard the model over this many processes (gloo on the CPU; each holds its share of the heads "
                "and its own KV cache, so the cache holds that many times the tokens); dense weights"})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT directories) beside the base model, many in one step"})
    lora_modules: tuple[str, ...] = field(default=(), metadata={
        "help": "adapters loaded at start, as name=path or vLLM's JSON {\"name\": ..., \"path\": ...} (ids 1, 2, ... in "
                "order); needs --enable-lora",
        "nargs": True})
    max_loras: int = field(default=1, metadata={"help": "most distinct LoRA adapters in one step (their slots)"})
    max_lora_rank: int = field(default=16, metadata={"help": "highest LoRA rank an adapter may have"})
    seed: int = field(default=0, metadata={"help": "random seed (engine sampling, and the workload's)"})
    grammar_cache_bytes: int = field(default=256 << 20, metadata={
        "help": "memory for compiled structured-output grammars (default 256MiB; least recently used dropped first)",
        "bytes": True})
    chat_template: str | None = field(default=None, metadata={
        "help": "a chat template (a .jinja file's path, or the template itself; vLLM's flag): replaces the model's, "
                "or gives one to a model whose file has none; rendered in the same budgeted sandbox"})

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self._apply_speculative_config()
        if self.kv_events_config is not None:
            KVEventsConfig.from_json(self.kv_events_config)  # refused at start, not at the first step
        object.__setattr__(self, "lora_modules", tuple(lora_module_text(m) for m in self.lora_modules)
                           if isinstance(self.lora_modules, (list, tuple)) else self.lora_modules)
        object.__setattr__(self, "pinned_prefix", tuple(self.pinned_prefix) if isinstance(self.pinned_prefix, list)
                           else self.pinned_prefix)
        self._check_types_and_ranges()
        if self.chat_template is not None:
            from octavo.chat_template.sandbox import chat_template_source

            chat_template_source(self.chat_template)  # a missing file or a syntax error: refused at start
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.prefix_caching_hash_algo not in PREFIX_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_HASH_ALGOS)}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.activation_dtype not in ACTIVATION_CHOICES:
            raise ValueError(f"activation_dtype must be one of {', '.join(ACTIVATION_CHOICES)}, got {self.activation_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("--speculative-method draft needs --speculative-model (the drafting model), "
                             "and --speculative-model needs --speculative-method draft")
        if self.pinned_prefix and not self.enable_prefix_caching:
            raise ValueError("pinned prefixes (--pinned-prefix) are prefix-cache blocks: they need prefix caching on")
        bad = [m for m in self.lora_modules if "=" not in m or not m.split("=", 1)[0] or not m.split("=", 1)[1]]
        if bad:
            raise ValueError(f"lora_modules entries must be name=path, got {bad[0]!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora (--enable-lora)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError("LoRA with tensor parallelism is not supported: each rank would need its share of every "
                             "adapter (B cut by output rows like q|k|v and gate|up, A by input columns like o and "
                             "down), which the adapter loader does not do; use one of them")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}")
        if self.grammar_cache_bytes < 1 << 20:
            raise ValueError(f"grammar_cache_bytes must be at least 1MiB, got {self.grammar_cache_bytes}")
        if self.kv_offload_size and self.tensor_parallel_size > 1:
            raise ValueError("the second KV tier (kv_offload_size) is not supported with tensor parallelism: "
                             "each rank would keep its own share of every block; use one of them")
        if self.kv_offload_size and not self.enable_prefix_caching:
            raise ValueError("the second KV tier (kv_offload_size) keeps prefix-cache blocks: it needs prefix caching on")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def _check_types_and_ranges(self) -> None:
        """Every field of the type its annotation names (an int is no bool, a float is finite, a
        fractional number is no int) and inside its range (RANGES): ValueError naming the field,
        at construction, before any model is loaded; so a bad option is refused at start rather
        than at the first request."""
        import math

        for f in dataclasses.fields(self):
            value, allowed = getattr(self, f.name), str(f.type).split(" | ")
            if value is None and "None" in allowed:
                continue
            if not any(_is_of(value, kind) for kind in allowed if kind != "None"):
                kinds = [_KIND_WORDS.get(k, k) for k in allowed]
                raise ValueError(f"{f.name} must be {' or '.join(kinds)}, got {value!r}")
            if f.name in RANGES and isinstance(value, (int, float)) and not isinstance(value, bool):
                low, high = RANGES[f.name]
                if not (low <= value <= high) or (isinstance(value, float) and not math.isfinite(value)):
                    raise ValueError(f"{f.name} must be in [{low}, {high}], got {value!r}")

    def _apply_speculative_config(self) -> None:
        """vLLM's --speculative-config JSON (or a dict from Python) -> the speculative_* fields."""
        import json

        conf = self.speculative_config
        if isinstance(conf, str):
            try:
                conf = json.loads(conf)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        known = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
                 "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min",
                 "model": "speculative_model"}
        if not isinstance(conf, dict) or "method" not in conf:
            raise ValueError('speculative_config must be a JSON object with a "method", e.g. {"method": "ngram"}')
        unknown = sorted(set(conf) - set(known))
        if unknown:
            raise ValueError(f"speculative_config keys not supported: {', '.join(unknown)} (supported: {', '.join(known)})")
        for key, name in known.items():
            if key in conf:
                object.__setattr__(self, name, conf[key])
        object.__setattr__(self, "speculative_config", None)

    def check_model(self, model_config: ModelConfig) -> None:
        """ValueError naming a feature asked for that this model's architecture does not have:
        LoRA adapters and tensor parallelism on a mixture of experts (its experts are neither
        adapted nor sharded) or on short convolutions (LFM2: neither is built for its conv layers)."""
        kind = ("a mixture-of-experts model" if model_config.moe is not None
                else "a model with short convolutions" if "conv" in model_config.layer_types else None)
        if kind is not None:
            for asked, what in ((self.enable_lora, "LoRA adapters (--enable-lora)"),
                                (self.tensor_parallel_size > 1, "tensor parallelism (--tensor-parallel-size)")):
                if asked:
                    raise ValueError(f"{what} on {kind} ({model_config.architecture}) are not supported")

    def to_config(self, model_config: ModelConfig) -> EngineConfig:
        """The engine's configuration; dtype "auto" must have been resolved (the engine does it at load)."""
        self.check_model(model_config)
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved when the model loads: pass a concrete dtype to to_config")
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
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_blocks=self.num_kv_blocks,
                kv_offload_bytes=self.kv_offload_size,
                kv_offload_path=self.kv_offload_path,
                kv_offload_medium=self.kv_offload_medium,
                kv_offload_required=self.kv_offload_required,
                pinned_prefix_share=self.pinned_prefix_share,
                cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype, resolve_device(self.device),
                                                   model_config)[0],
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                max_wait_steps=self.max_wait_steps,
                preemption_victim=self.preemption_victim,
                admission_headroom_steps=self.admission_headroom_steps,
                pooling_share=self.pooling_share,
                max_loras=self.max_loras if self.enable_lora else None,
                speculative=SpeculativeConfig(
                    method=self.speculative_method, num_speculative_tokens=self.num_speculative_tokens,
                    max_batch=self.speculative_max_batch, prompt_lookup_min=self.prompt_lookup_min,
                    prompt_lookup_max=self.prompt_lookup_max, draft_model=self.speculative_model,
                ) if self.speculative_method is not None else None,
            ),
            dtype=self.dtype,
            device=resolve_device(self.device),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            max_lora_rank=self.max_lora_rank,
            seed=self.seed,
            grammar_cache_bytes=self.grammar_cache_bytes,
            quantization=self.quantization,
            activation_dtype=self.activation_dtype,
            max_model_len_explicit=self.max_model_len is not None,
            kv_events=None if self.kv_events_config is None else KVEventsConfig.from_json(self.kv_events_config),
        )


# Each numeric option's valid range (both ends included); every option is type-checked as well.
RANGES: dict[str, tuple[float, float]] = {
    "block_size": (1, 1024), "max_model_len": (2, 1 << 24), "max_num_seqs": (1, 1 << 16),
    "max_num_batched_tokens": (1, 1 << 24), "kv_cache_memory": (1, 1 << 50),
    "kv_offload_size": (0, 1 << 50), "num_kv_blocks": (1, 1 << 30), "max_wait_steps": (1, 1 << 30),
    "pinned_prefix_share": (0.0, 0.99), "admission_headroom_steps": (0, 1 << 20), "pooling_share": (0.001, 1024.0), "num_speculative_tokens": (1, 16),
    "speculative_max_batch": (1, 1 << 16), "prompt_lookup_min": (1, 1024), "prompt_lookup_max": (1, 1024),
    "tensor_parallel_size": (1, 1024), "max_loras": (1, 1024), "max_lora_rank": (1, 4096),
    "seed": (-(1 << 63), (1 << 63) - 1), "grammar_cache_bytes": (1 << 20, 1 << 50),
}
_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "tuple[str, ...]": "a list of strings", "None": "None"}


def _is_of(value: object, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "tuple[str, ...]":
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    raise AssertionError(f"EngineArgs field of an unchecked type {kind}")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without a GPU is a ValueError."""
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device "
            f"({'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}); use --device cpu or auto"
        )
    return device
