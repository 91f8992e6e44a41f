"""Frozen configuration dataclasses: model shape, KV cache, scheduler and the engine's bundle of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The embedded model's reference facts live with the loader; these defaults are the engine's own.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_WAIT_STEPS = 32  # cache-aware scheduling's bound on steps passed over (docs/BENCHMARKS.md)
DEFAULT_AGING_TOKENS_PER_STEP = 4  # cache-aware scheduling's aging (docs/BENCHMARKS.md)
DEFAULT_POOLING_SHARE = 0.35  # embedding tokens per step per generating request (docs/BENCHMARKS.md)
DEFAULT_ADMISSION_HEADROOM_STEPS = 64  # room kept for running requests at admission (docs/BENCHMARKS.md)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding: base theta and an optional scaling rule ("llama3" or "linear"), then
    per-dimension divisors of the frequencies where the model has them (`freq_factors`, one per
    rotary pair: what llama.cpp's converter writes for Llama 3.1+ as the `rope_freqs` tensor)."""

    theta: float = 10000.0
    scaling_type: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] | None = None
    # YaRN ("yarn"): rotary pairs between beta_fast and beta_slow rotations over the original context
    # blend extrapolation into interpolation by `factor`; cos and sin are scaled by attention_factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # the blend's ends rounded to whole pairs (llama.cpp always; gpt-oss's HF config: no)
    # LongRoPE ("longrope", Phi-3 128k / Phi-3.5 / Phi-4-mini): each pair's frequency divided by its
    # factor, the long set when the context served (`long`) passes original_max_position, else the
    # short one, as llama.cpp decides by its context size; cos and sin times attention_factor
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long: bool = False

    def __post_init__(self) -> None:
        if self.scaling_type not in (None, "llama3", "linear", "yarn", "longrope"):
            raise ValueError(
                f"rope scaling {self.scaling_type!r} is not supported; supported: llama3, linear, yarn, longrope, none"
            )
        if self.scaling_type == "longrope" and (
                len(self.short_factor) != len(self.long_factor) or not self.short_factor
                or not all(math.isfinite(f) and f > 0 for f in self.short_factor + self.long_factor)):
            raise ValueError("LongRoPE needs short and long factors of one length (one per rotary pair), positive")
        if self.freq_factors is not None and not all(math.isfinite(f) and f > 0 for f in self.freq_factors):
            raise ValueError("rope frequency factors must be positive finite numbers")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse mixture-of-experts feed-forward: each token's router picks `top_k` of `num_experts`
    gated MLPs of `intermediate_size` and sums their outputs with the router's weights. Routing
    "softmax_topk" (Qwen2/3-MoE): softmax over every expert, the top k, renormalised to sum 1 when
    `norm_topk_prob`; "topk_softmax" (gpt-oss): the k largest logits, then a softmax over those k.
    `shared_intermediate_size` > 0: one shared expert every token runs, scaled by sigmoid(a learned
    gate) (Qwen2-MoE). `router_bias`, `expert_bias`: the router's and every expert's projections
    carry biases (gpt-oss)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    routing: str = "softmax_topk"
    shared_intermediate_size: int = 0
    router_bias: bool = False
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"experts per token ({self.top_k}) must be in [1, {self.num_experts}] (the experts)")
        if self.intermediate_size < 1 or self.shared_intermediate_size < 0:
            raise ValueError("expert feed-forward sizes must be positive")
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"MoE routing {self.routing!r} is not supported; supported: softmax_topk, topk_softmax")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Our own model description, translated once from a Hugging Face config (models/registry.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # the gated MLP's activation: "silu", "gelu_tanh" or "swiglu_oai" (gpt-oss: gate clamped above
    # and up both ways at swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate))
    hidden_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Sliding-window attention: `sliding_window` keys (the query's own included) for the layers
    # marked "sliding" in `layer_types` (empty: every layer global). `local_rope`: those layers'
    # rotary embedding where it differs from `rope` (Gemma 3's local base).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None
    moe: MoEConfig | None = None  # every layer's feed-forward is this mixture of experts (None: dense)
    # Gemma 2's soft-capping: attention scores and final logits become cap * tanh(x / cap) (None: none)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    attn_sinks: bool = False  # a learned sink logit per query head in every softmax (gpt-oss)
    # partial rotary (Phi-4-mini): RoPE on the first rotary_dim values of each q/k head only (None: all)
    rotary_dim: int | None = None
    # LFM2's short convolutions: the layers marked "conv" in `layer_types` mix each channel of
    # B * x over the last `conv_kernel` positions (their own included) instead of attending
    conv_kernel: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ValueError(f"hidden_act must be 'silu', 'gelu_tanh' or 'swiglu_oai', got {self.hidden_act!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers; the model has {self.num_layers}")
        if set(self.layer_types) - {"full", "sliding", "conv"}:
            raise ValueError(f"layer_types may hold 'full', 'sliding' and 'conv' only, got {sorted(set(self.layer_types))}")
        if "sliding" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("sliding layers need a sliding_window >= 1")
        if "conv" in self.layer_types and (self.conv_kernel is None or self.conv_kernel < 2):
            raise ValueError("short-convolution layers need a conv_kernel >= 2")
        if self.rotary_dim is not None and not (2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in [2, head_dim {self.head_dim}], got {self.rotary_dim}")

    @property
    def rotary_width(self) -> int:
        """The values of each q/k head RoPE rotates (the first ones; the rest pass through)."""
        return self.rotary_dim or self.head_dim

    def is_conv(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is a short convolution (LFM2) rather than attention."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "conv"

    def conv_slots(self) -> int:
        """K/V tensor pairs one short-convolution layer's input takes per token: its `hidden_size`
        values stored across pairs of [num_kv_heads, head_dim] slots (LFM2-1.2B: 2048 values in 2 pairs of 2 x 512)."""
        return -(-self.hidden_size // (2 * self.num_kv_heads * self.head_dim))

    def layer_window(self, layer_idx: int) -> int | None:
        """The number of keys layer `layer_idx` attends to (None: all earlier tokens)."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding":
            return self.sliding_window
        if self.is_conv(layer_idx):
            return self.conv_kernel
        return None

    def kv_row_bytes(self, kv_dtype: str) -> int:
        """Bytes one token's K (or V) of one KV head holds in the cache in `kv_dtype`, its scale included."""
        return kv_row_bytes(self.head_dim, kv_dtype)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes of K and V for one token over all layers, in `kv_dtype` (KV_CACHE_DTYPES)."""
        return 2 * self.num_layers * self.num_kv_heads * self.kv_row_bytes(kv_dtype)

    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The layers grouped by attention kind for the paged KV cache, global groups first.

        Every group takes the same number of K/V tensor pairs (the gcd of the kinds' totals), so
        one block of the pool holds block_size tokens of any one group: Gemma 3 270M's 3 global
        and 15 sliding layers make 1 global and 5 sliding groups of 3 layers. A model whose
        layers are all of one kind has one group of every layer (the plain paged cache).
        Short-convolution layers (LFM2) are a kind of their own ("conv": each token's B * x, read
        back over the last conv_kernel positions, a window), `conv_slots` pairs a layer.
        """
        conv = [i for i in range(self.num_layers) if self.is_conv(i)]
        full = [i for i in range(self.num_layers) if self.layer_window(i) is None]
        sliding = [i for i in range(self.num_layers) if self.layer_window(i) is not None and not self.is_conv(i)]
        m = self.conv_slots()
        if not conv and (not full or not sliding):
            return (KVGroup(self.sliding_window if sliding else None, tuple(range(self.num_layers))),)
        size = math.gcd(len(full), len(sliding), len(conv) * m)
        if conv and size % m:
            raise ValueError(f"{len(conv)} short-convolution layers of {m} K/V slots each and {len(full) + len(sliding)} "
                             "attention layers cannot share one block size")
        kinds = ((None, full, "attention", size), (self.sliding_window, sliding, "attention", size),
                 (self.conv_kernel, conv, "conv", size // m))
        return tuple(
            KVGroup(window, tuple(layers[i : i + per_group]), kind)
            for window, layers, kind, per_group in kinds
            for i in range(0, len(layers), per_group)
        )

    def kv_bytes_per_block(self, block_size: int, kv_dtype: str) -> int:
        """Bytes of one pool block: block_size tokens of K and V for one KV group's layers, in `kv_dtype`."""
        return 2 * self.kv_slots_per_block() * block_size * self.num_kv_heads * self.kv_row_bytes(kv_dtype)

    def kv_slots_per_block(self) -> int:
        """K/V tensor pairs one pool block spans (a group's layers; a conv layer takes conv_slots)."""
        group = self.kv_groups()[0]
        return len(group.layers) * (self.conv_slots() if group.kind == "conv" else 1)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers whose KV shares one block table: `window` keys each (None: global attention)."""

    window: int | None
    layers: tuple[int, ...]
    kind: str = "attention"  # or "conv": short convolutions' inputs, read back over `window` positions


def blocks_to_hold(
    group_windows: tuple[int | None, ...], num_tokens: int, block_size: int, max_chunk: int | None = None
) -> int:
    """Blocks one sequence of `num_tokens` tokens holds at most, over all KV groups, computed in
    chunks of at most `max_chunk` tokens: a global group holds one per block of tokens; a
    sliding-window group of window W the blocks of the last W - 1 tokens plus a chunk (every
    token of a chunk gets its slots before the window moves past it), plus one for the partial
    block at the window's edge, never more than a global group. The one formula behind the
    scheduler's admission, the start-up line and /metrics."""
    def blocks(n: int) -> int:
        return -(-n // block_size)

    chunk = num_tokens if max_chunk is None else min(num_tokens, max_chunk)
    total = 0
    for window in group_windows:
        if window is None:
            total += blocks(num_tokens)
        else:
            total += min(blocks(num_tokens), blocks(min(num_tokens, window - 1 + chunk)) + 1)
    return total


PREFIX_HASH_ALGOS = ("sha256", "sha256_cbor")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache shape and sizing. `num_blocks` is None until the engine sizes the pool."""

    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; wins over gpu_memory_utilization
    gpu_memory_utilization: float | None = None  # share of device memory for weights + activations + KV
    num_blocks: int | None = None
    kv_offload_bytes: int = 0  # the second KV tier's size (0: no tier)
    kv_offload_path: str | None = None  # its folder (None: one per model and setting under the cache)
    kv_offload_medium: str = "auto"  # disk, host (memory), or auto: host on CUDA, disk on the CPU
    kv_offload_required: bool = False  # a tier that cannot be used stops the start (else: run without it)
    pinned_prefix_share: float = 0.25  # the most of the pool pinned prefixes may hold
    # how full blocks are hashed (kv_cache/prefix_cache.py): sha256 of pickle, or sha256 of
    # canonical CBOR (vLLM's sha256_cbor: reproducible outside Python, what KV events publish)
    prefix_caching_hash_algo: str = "sha256"
    cache_dtype: str = "float32"  # what a K or V value is held in (KV_CACHE_DTYPES; "auto" is resolved before)

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_offload_medium not in ("auto", "disk", "host"):
            raise ValueError(f"kv_offload_medium must be auto, disk or host, got {self.kv_offload_medium!r}")
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_size must be >= 0 bytes, got {self.kv_offload_bytes}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError("the second KV tier (kv_offload_size) keeps prefix-cache blocks: it needs prefix caching on")
        if self.prefix_caching_hash_algo not in PREFIX_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_HASH_ALGOS)}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if not 0.0 <= self.pinned_prefix_share < 1.0:
            raise ValueError(f"pinned_prefix_share must be in [0, 1), got {self.pinned_prefix_share}")


SCHEDULING_POLICIES = ("fcfs", "priority", "cache-aware")
# What the KV cache can hold a value in (--kv-cache-dtype): (bytes a value, bytes a scale, values a
# scale covers; 0: unscaled). int8 is symmetric with a float16 scale per 32 values of a token's
# head (llama.cpp's q8_0 granularity), the scales stored after the row's head_dim values
# (kernels/kv_format.py), so a block carries its scales wherever it goes.
KV_CACHE_DTYPES = {"float32": (4, 0, 0), "bfloat16": (2, 0, 0), "float16": (2, 0, 0), "int8": (1, 2, 32)}
# What the flag accepts: auto picks one per model and device by a stated rule (kernels/kv_dtype_rule.py).
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes one token's K (or V) of one KV head takes in the cache in `kv_dtype`, its scales included."""
    value_bytes, scale_bytes, group = KV_CACHE_DTYPES[kv_dtype]
    return head_dim * value_bytes + (-(-head_dim // group) * scale_bytes if group else 0)
# What --activation-dtype accepts: float32 (the exact path: each quantized weight rebuilt exactly and
# met by float32 activations) or int8 (activations quantized per 32 values, integer dot products:
# kernels/cpu/quant_linear_i8.cpp; not exact, `octavo eval` measures the cost).
ACTIVATION_DTYPES = ("float32", "int8")
# What the flag accepts: auto (the default) picks one of them per model and CPU by a stated rule
# (kernels/activation_rule.py); an engine's config holds the one chosen.
ACTIVATION_CHOICES = ("auto", *ACTIVATION_DTYPES)

# What --quantization accepts: auto (a GGUF's own formats, else float), none (dense), and the
# schemes quantization.HF_SCHEMES quantizes float weights into (a test keeps the two in step)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
PREEMPTION_VICTIMS = ("cheapest", "newest")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
DEFAULT_SPEC_MAX_BATCH = 4  # decoding requests above which no step drafts (docs/BENCHMARKS.md)
DEFAULT_SPEC_COST_BATCH = 4.0  # batch at which a step's extra token costs half a decode step (docs/BENCHMARKS.md)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: each decoding request's next step also computes up to
    `num_speculative_tokens` drafted tokens, and keeps those the model agrees with."""

    method: str = "ngram"  # ngram: prompt lookup in the request's own tokens; suffix: + recent requests'; draft: a model
    draft_model: str | None = None  # method "draft": the drafting model (same tokenizer), as --model takes it
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # n-gram sizes matched (longest first)
    prompt_lookup_max: int = 4
    # back-off: no drafts while more than this many requests decode (a wide step already reads the
    # weights for many tokens: verifying drafts there costs compute, not reads)
    max_batch: int = DEFAULT_SPEC_MAX_BATCH
    # back-off per request: after a verification that accepts nothing, it skips drafting for
    # 1, 2, 4, ... steps (up to this many); an accepted draft resets it
    max_backoff_steps: int = 16
    # the cost model of the adaptive draft length: with B requests decoding, one more token in a
    # step costs B / (B + this) of a decode step (this CPU: about 4, tools/spec_step_cost.py); each
    # request drafts the k that maximises its expected tokens per unit of step cost
    draft_cost_batch: float = DEFAULT_SPEC_COST_BATCH

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative method 'draft' needs a draft model (--speculative-model), and only it takes one")
        if self.max_batch < 1 or self.max_backoff_steps < 0 or self.draft_cost_batch <= 0:
            raise ValueError("speculative max_batch must be >= 1, max_backoff_steps >= 0 and draft_cost_batch > 0")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits and policies of the scheduler."""

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_loras: int | None = None  # distinct LoRA adapters per step (None: LoRA is off)
    # cache-aware: a request passed over (a later arrival admitted while it waits) in this many
    # steps goes ahead of every request that arrived after it (at its priority), whatever they
    # would reuse from the cache: it then waits no longer than first come, first served makes it
    max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS
    # cache-aware: tokens of score a waiting request gains per step it waits (aging), so a cold
    # request overtakes one that reuses N more tokens after N / this steps
    aging_tokens_per_step: int = DEFAULT_AGING_TOKENS_PER_STEP
    # which running request a full pool preempts: the one whose loss costs least (tokens to
    # recompute, or blocks to swap), or the most recently admitted (vLLM's rule)
    preemption_victim: str = "cheapest"
    # a request re-admitted after a preemption is not chosen again as a victim for this many
    # steps, nor while it recomputes what it lost (unless every running request is protected)
    resume_protect_steps: int = 32
    # a waiting request is admitted only if the pool keeps free the blocks the running requests
    # take over their next this-many tokens (0: admit while any block is free, vLLM's rule):
    # admitting into memory the running requests are about to need is what makes preemptions
    admission_headroom_steps: int = DEFAULT_ADMISSION_HEADROOM_STEPS
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # embedding (pooling) requests' prompt tokens per step while generation requests are held: this
    # share of the running generation requests, rounded up (at least 1; None: no limit beyond the
    # step's budget). Embeddings are prefill only, and on a compute-bound CPU each prompt token
    # costs about half a decode's: taking the step's whole budget they would stretch every chat's
    # step many times over. With no generation held they take the whole step.
    pooling_share: float | None = DEFAULT_POOLING_SHARE

    def __post_init__(self) -> None:
        if self.pooling_share is not None and not 0 < self.pooling_share <= 1024:
            raise ValueError(f"pooling_share must be in (0, 1024] (or None), got {self.pooling_share}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if self.preemption_victim not in PREEMPTION_VICTIMS:
            raise ValueError(f"preemption victim must be one of {', '.join(PREEMPTION_VICTIMS)}, got {self.preemption_victim!r}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1, got {self.max_wait_steps}")
        if min(self.aging_tokens_per_step, self.resume_protect_steps, self.admission_headroom_steps) < 0:
            raise ValueError("aging_tokens_per_step, resume_protect_steps and admission_headroom_steps must be >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}) "
                "so that any admitted prompt fits in one step"
            )


KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's --kv-events-config: publish the prefix cache's changes (octavo/kv_events.py). The
    names and defaults are vLLM's; `hash_format` and `encoding` are Octavo's (vLLM sets the first
    by an environment variable and has changed the second between releases)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # null or zmq; None: zmq when enabled
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has * (or is ipc:// / inproc://), else connected
    replay_endpoint: str | None = None  # ROUTER socket a subscriber asks for missed batches on
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publishing thread
    topic: str = ""
    hash_format: str = "int"  # int: a hash's last 8 bytes, big-endian (vLLM's default); bytes: all 32
    encoding: str = "map"  # events as tagged maps (vLLM's current form) or arrays (its earlier one)

    def __post_init__(self) -> None:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        if publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, got {publisher!r}")
        object.__setattr__(self, "publisher", publisher)
        if self.hash_format not in ("int", "bytes"):
            raise ValueError(f"kv_events_config hash_format must be int or bytes, got {self.hash_format!r}")
        if self.encoding not in ("map", "array"):
            raise ValueError(f"kv_events_config encoding must be map or array, got {self.encoding!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config {name} must be an integer >= 1, got {value!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config endpoint must be a tcp://, ipc:// or inproc:// address, got {self.endpoint!r}")

    @property
    def is_on(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str | dict) -> KVEventsConfig:
        """From vLLM's JSON form (or a dict); ValueError naming what is wrong."""
        import json

        conf = text
        if isinstance(text, str):
            try:
                conf = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        if not isinstance(conf, dict):
            raise ValueError('kv_events_config must be a JSON object, e.g. {"enable_kv_cache_events": true}')
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(conf) - known)
        if unknown:
            raise ValueError(f"kv_events_config keys not supported: {', '.join(unknown)} (supported: {', '.join(sorted(known))})")
        for key, value in conf.items():
            want = cls.__dataclass_fields__[key].type
            ok = (isinstance(value, bool) if want == "bool" else
                  isinstance(value, int) and not isinstance(value, bool) if want == "int" else
                  isinstance(value, str) or (value is None and "None" in want))
            if not ok:
                raise ValueError(f"kv_events_config {key} must be {want}, got {value!r}")
        return cls(**conf)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine was started with; derived values come as new objects (dataclasses.replace)."""

    model: str | None
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    enforce_eager: bool = True  # False: CUDA graphs for decode-only steps (CUDA + triton only)
    max_lora_rank: int = 16  # LoRA is on when scheduler.max_loras is set
    seed: int = 0
    grammar_cache_bytes: int = 256 << 20  # compiled structured-output grammars kept
    model_path: str | None = None  # the weights' resolved folder or file (the KV tier's fingerprint)
    quantization: str = "auto"
    activation_dtype: str = "float32"  # what quantized layers' activations meet their weights in (ACTIVATION_DTYPES)
    # whether scheduler.max_model_len is the user's (a pool that cannot hold it is an error) or the
    # model's (capped to what the pool holds)
    max_model_len_explicit: bool = True
    kv_events: KVEventsConfig | None = None  # publishing KV events (None: off)
