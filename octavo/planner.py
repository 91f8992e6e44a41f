"""Capacity planning from a model's config.json: KV bytes per token, what fits, what paging buys.

Pure arithmetic, no torch: it answers before anyone buys a GPU. Every figure is derived from the
fields reported in `PlanFields.used`, so a reader can check which config keys were read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from octavo.config import KV_CACHE_DTYPES, blocks_to_hold
from octavo.config import kv_row_bytes as config_kv_row_bytes
from octavo.hf_fields import window_layer_types

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class PlanFields:
    """The model shape the plan uses, and for each value the config key it came from (or the rule)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    gated_mlp: bool
    tie_word_embeddings: bool
    used: dict[str, str] = field(default_factory=dict)
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (None: no such layers)
    num_window_layers: int = 0  # layers that attend only within the window (the rest are global)
    # a mixture of experts: every layer's feed-forward is `num_experts` MLPs of
    # `expert_intermediate_size`, `experts_per_token` of them run per token (+ a shared one)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # LFM2's short convolutions: layers that hold no K/V but a state of their last conv_kernel - 1
    # inputs (hidden values each), kept in the pool as a window of conv_kernel positions
    num_conv_layers: int = 0
    conv_kernel: int = 0


def _window_layers(cfg: dict[str, Any], num_layers: int, used: dict[str, str]) -> tuple[int | None, int]:
    """(sliding window, how many layers use it): see `window_layer_types`."""
    window, types = window_layer_types(cfg, num_layers, used)
    return window, sum(t == "sliding" for t in types)


def _first(cfg: dict[str, Any], keys: tuple[str, ...], what: str) -> tuple[Any, str]:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key], key
    raise ValueError(f"config has no {what}: looked for {', '.join(keys)}")


def read_fields(hf: dict[str, Any]) -> PlanFields:
    """Read Llama/Mistral/Qwen (num_key_value_heads, head_dim), OPT and GPT-2 style configs."""
    cfg = hf.get("text_config") or hf  # multimodal wrappers keep the language model inside
    used: dict[str, str] = {}
    num_layers, used["num_layers"] = _first(cfg, ("num_hidden_layers", "n_layer", "num_layers"), "layer count")
    hidden, used["hidden_size"] = _first(cfg, ("hidden_size", "n_embd", "d_model"), "hidden size")
    num_heads, used["num_heads"] = _first(cfg, ("num_attention_heads", "n_head", "num_heads"), "attention head count")
    if cfg.get("num_key_value_heads") is not None:
        num_kv, used["num_kv_heads"] = cfg["num_key_value_heads"], "num_key_value_heads"
    elif cfg.get("multi_query"):
        num_kv, used["num_kv_heads"] = 1, "multi_query=true (one KV head)"
    else:
        num_kv, used["num_kv_heads"] = num_heads, f"no KV-head field: multi-head, KV heads = {used['num_heads']}"
    if cfg.get("head_dim") is not None:
        head_dim, used["head_dim"] = cfg["head_dim"], "head_dim"
    else:
        head_dim, used["head_dim"] = hidden // num_heads, f"{used['hidden_size']} / {used['num_heads']}"
    vocab, used["vocab_size"] = _first(cfg, ("vocab_size",), "vocab size")
    model_type = str(cfg.get("model_type", ""))
    gated = model_type not in ("gpt2", "opt", "gpt_neox", "gptj", "falcon", "bloom")
    for key in ("intermediate_size", "ffn_dim", "n_inner"):
        if cfg.get(key) is not None:
            inter, used["intermediate_size"] = cfg[key], key
            break
    else:
        inter, used["intermediate_size"] = 4 * hidden, f"4 x {used['hidden_size']} (no FFN size field)"
    tie = bool(cfg.get("tie_word_embeddings", model_type in ("gpt2", "opt")))
    window, num_window_layers = _window_layers(cfg, int(num_layers), used)
    experts = {}
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key):
            experts["num_experts"], used["num_experts"] = int(cfg[key]), key
            experts["experts_per_token"], used["experts_per_token"] = int(cfg["num_experts_per_tok"]), "num_experts_per_tok"
            size, used["expert_intermediate_size"] = _first(cfg, ("moe_intermediate_size", "intermediate_size"),
                                                            "expert feed-forward size")
            experts["expert_intermediate_size"] = int(size)
            if cfg.get("shared_expert_intermediate_size"):
                experts["shared_expert_intermediate_size"] = int(cfg["shared_expert_intermediate_size"])
                used["shared_expert_intermediate_size"] = "shared_expert_intermediate_size"
            break
    conv = {}
    if isinstance(cfg.get("layer_types"), list) and "conv" in cfg["layer_types"]:
        conv["num_conv_layers"], used["num_conv_layers"] = cfg["layer_types"].count("conv"), "layer_types (conv entries)"
        conv["conv_kernel"], used["conv_kernel"] = int(cfg.get("conv_L_cache", 3)), "conv_L_cache"
    return PlanFields(int(num_layers), int(hidden), int(num_heads), int(num_kv), int(head_dim), int(vocab),
                      int(inter), gated, tie, used, window, num_window_layers, **experts, **conv)


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes one token's K (or V) of one KV head takes in `kv_dtype` (int8: with its scales, as
    the engine holds it: config.KV_CACHE_DTYPES)."""
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(kv_dtype, kv_dtype)
    return config_kv_row_bytes(head_dim, name) if name in KV_CACHE_DTYPES else head_dim * DTYPE_BYTES[kv_dtype]


def conv_state_bytes(f: PlanFields, kv_dtype: str, block_size: int) -> tuple[int, int]:
    """(a request's short-convolution state proper: conv_kernel - 1 inputs of `hidden_size` per
    conv layer; what the engine holds for it: the conv groups' window blocks at most, each conv
    layer's input over whole [kv heads x head dim] K/V slots (ModelConfig.conv_slots))."""
    if not f.num_conv_layers:
        return 0, 0
    dtype = DTYPE_BYTES[kv_dtype]
    state = f.num_conv_layers * (f.conv_kernel - 1) * f.hidden_size * dtype
    slots = -(-f.hidden_size // (2 * f.num_kv_heads * f.head_dim))
    per_layer_block = slots * 2 * f.num_kv_heads * f.head_dim * dtype * block_size
    held = f.num_conv_layers * blocks_to_hold((f.conv_kernel,), f.conv_kernel, block_size, max_chunk=1) * per_layer_block
    return state, held


def estimate_num_params(f: PlanFields, experts: int | None = None) -> int:
    """Parameters from the shape: embeddings (+ head if untied) + per layer attention, MLP (a
    mixture of experts: router, `experts` of its experts, all when None, and a shared one), norms."""
    q = f.num_heads * f.head_dim
    kv = f.num_kv_heads * f.head_dim
    attention = f.hidden_size * (q + 2 * kv) + q * f.hidden_size
    width = 3 if f.gated_mlp else 2
    if f.num_experts:
        used = f.num_experts if experts is None else experts
        mlp = f.num_experts * f.hidden_size + width * f.hidden_size * (
            used * f.expert_intermediate_size + f.shared_expert_intermediate_size)
        mlp += f.hidden_size if f.shared_expert_intermediate_size else 0  # the shared expert's gate
    else:
        mlp = width * f.hidden_size * f.intermediate_size
    per_layer = attention + mlp + 2 * f.hidden_size
    embeddings = f.vocab_size * f.hidden_size * (1 if f.tie_word_embeddings else 2)
    return embeddings + f.num_layers * per_layer + f.hidden_size


def expected_active_experts(f: PlanFields, num_tokens: int) -> float:
    """Distinct experts one layer runs for `num_tokens` tokens, each routed to `experts_per_token`
    of `num_experts` uniformly: E * (1 - (1 - k / E) ** n). Real routers are skewed, so this is
    the most a step reads on average, not a measurement."""
    e, k = f.num_experts, f.experts_per_token
    return e * (1 - (1 - k / e) ** num_tokens)


def moe_weight_bytes(f: PlanFields, weight_bytes: int, num_tokens: int) -> int:
    """Weight bytes a step of `num_tokens` tokens reads: the dense part whole, the experts in the
    share `expected_active_experts` gives (bytes per parameter as in the whole model)."""
    total = estimate_num_params(f)
    read = estimate_num_params(f, experts=0) + (total - estimate_num_params(f, experts=0)) * (
        expected_active_experts(f, num_tokens) / f.num_experts)
    return int(weight_bytes * read / total)


@dataclass(frozen=True, slots=True)
class Plan:
    kv_dtype: str
    bytes_per_token: int
    block_size: int
    bytes_per_block: int
    device_memory: int
    memory_fraction: float
    weight_bytes: int
    weight_bytes_estimated: bool
    kv_memory: int
    num_blocks: int
    num_tokens: int
    typical_len: int
    max_len: int
    seqs_reserving_max: int
    seqs_paged: int
    waste_reserving_max: float  # share of reserved slots that hold no token, at the typical length
    waste_paged: float  # share of allocated slots left empty by the last, partial block
    paged_over_reserved: float
    fields: dict[str, str]
    # Sliding-window models: per context length, sequences that fit when window layers keep only
    # the blocks their window can still read, and when every layer keeps every block (window-blind)
    sliding_window: int | None = None
    num_window_layers: int = 0
    seqs_by_context: dict[int, tuple[int, int]] = field(default_factory=dict)  # context -> (aware, blind)
    # the engine's KV groups (ModelConfig.kv_groups: every group has gcd(global, window) layers),
    # each with its own block table: [(window or None, groups of that kind, layers per group)]
    kv_groups: list[tuple[int | None, int, int]] = field(default_factory=list)
    kv_dtype_source: str = ""  # why this KV dtype (e.g. what serve uses on this CPU)
    weight_source: str = ""  # where weight_bytes came from when not estimated
    # a mixture of experts: (experts, per token), and the weight bytes a step of n tokens reads
    # (moe_weight_bytes) for n in MOE_STEP_TOKENS: one token's is the "active" weight
    experts: tuple[int, int] | None = None
    weight_bytes_per_step: dict[int, int] = field(default_factory=dict)
    # short convolutions (LFM2): (conv layers, kernel, state bytes per request, bytes the pool holds for it)
    conv: tuple[int, int, int, int] | None = None
    memory_source: str = ""  # where kv_memory came from when given (serve's rule on this machine)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(
    f: PlanFields,
    device_memory: int,
    memory_fraction: float = 0.9,
    kv_dtype: str = "float16",
    weight_bytes: int | None = None,
    weight_dtype: str | None = None,
    block_size: int = 16,
    typical_len: int = 1024,
    max_len: int = 8192,
    kv_dtype_source: str = "",
    weight_source: str = "",
    kv_memory: int | None = None,
    memory_source: str = "",
) -> Plan:
    """kv_memory = device_memory x memory_fraction - weight_bytes unless given (a CPU's serve gives
    the KV cache a fixed budget, not what the weights leave); blocks = kv_memory // bytes_per_block."""
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"kv dtype must be one of {', '.join(DTYPE_BYTES)}, got {kv_dtype!r}")
    if not 0 < typical_len <= max_len:
        raise ValueError(f"need 0 < typical length ({typical_len}) <= max length ({max_len})")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    estimated = weight_bytes is None
    if weight_bytes is None:
        weight_bytes = estimate_num_params(f) * DTYPE_BYTES[weight_dtype or kv_dtype]
    # (short-convolution layers hold no K/V per token: their state is a fixed amount per request)
    bytes_per_token = 2 * (f.num_layers - f.num_conv_layers) * f.num_kv_heads * kv_row_bytes(f.head_dim, kv_dtype)
    bytes_per_block = bytes_per_token * block_size
    if kv_memory is None:
        kv_memory = int(device_memory * memory_fraction) - weight_bytes
    num_blocks = max(0, kv_memory // bytes_per_block)
    blocks_max = -(-max_len // block_size)
    blocks_typical = -(-typical_len // block_size)
    state, state_held = conv_state_bytes(f, kv_dtype, block_size)
    seqs_reserved = max(0, kv_memory) // (blocks_max * bytes_per_block + state_held)
    seqs_paged = max(0, kv_memory) // (blocks_typical * bytes_per_block + state_held)
    return Plan(
        kv_dtype=kv_dtype,
        bytes_per_token=bytes_per_token,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        device_memory=device_memory,
        memory_fraction=memory_fraction,
        weight_bytes=weight_bytes,
        weight_bytes_estimated=estimated,
        kv_memory=max(0, kv_memory),
        num_blocks=num_blocks,
        num_tokens=num_blocks * block_size,
        typical_len=typical_len,
        max_len=max_len,
        seqs_reserving_max=seqs_reserved,
        seqs_paged=seqs_paged,
        waste_reserving_max=1 - typical_len / (blocks_max * block_size),
        waste_paged=1 - typical_len / (blocks_typical * block_size),
        paged_over_reserved=seqs_paged / seqs_reserved if seqs_reserved else float("inf"),
        fields=dict(f.used),
        sliding_window=f.sliding_window,
        num_window_layers=f.num_window_layers,
        seqs_by_context={n: (max(0, kv_memory) // window_aware_bytes(f, n, block_size, kv_dtype),
                             max(0, kv_memory) // (-(-n // block_size) * bytes_per_block))
                         for n in HYBRID_CONTEXTS} if f.sliding_window else {},
        kv_groups=kv_groups(f),
        kv_dtype_source=kv_dtype_source,
        weight_source=weight_source,
        experts=(f.num_experts, f.experts_per_token) if f.num_experts else None,
        weight_bytes_per_step={n: moe_weight_bytes(f, weight_bytes, n) for n in MOE_STEP_TOKENS} if f.num_experts else {},
        conv=(f.num_conv_layers, f.conv_kernel, state, state_held) if f.num_conv_layers else None,
        memory_source=memory_source,
    )


MOE_STEP_TOKENS = (1, 4, 16, 64)


def kv_groups(f: PlanFields) -> list[tuple[int | None, int, int]]:
    num_global = f.num_layers - f.num_window_layers
    if not f.sliding_window or not f.num_window_layers or not num_global:
        return [(f.sliding_window if f.num_window_layers else None, 1, f.num_layers)]
    size = math.gcd(num_global, f.num_window_layers)
    return [(None, num_global // size, size), (f.sliding_window, f.num_window_layers // size, size)]


HYBRID_CONTEXTS = (4096, 8192, 32768)


def window_aware_bytes(f: PlanFields, num_tokens: int, block_size: int, kv_dtype: str) -> int:
    """KV bytes one sequence of `num_tokens` holds when its window layers keep only the blocks their
    window can still read (window / block_size + 1 at most: the window rarely starts on a block
    edge) and its global layers keep every block."""
    per_layer_block = 2 * f.num_kv_heads * kv_row_bytes(f.head_dim, kv_dtype) * block_size
    windows = (None,) * (f.num_layers - f.num_window_layers) + (f.sliding_window,) * f.num_window_layers
    # the engine's formula (config.blocks_to_hold), per layer here: a decoding sequence's blocks
    return blocks_to_hold(windows, num_tokens, block_size, max_chunk=1) * per_layer_block


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.2f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return str(num_bytes)


def format_plan(plan: Plan, model: str) -> str:
    rows = [
        ("model", model),
        ("KV dtype", plan.kv_dtype + (f" ({plan.kv_dtype_source})" if plan.kv_dtype_source else "")),
        ("KV bytes per token", f"{plan.bytes_per_token:,} ({_human(plan.bytes_per_token)})"),
        ("bytes per block", f"{plan.bytes_per_block:,} ({plan.block_size} tokens)"),
        ("machine memory", _human(plan.device_memory)) if plan.memory_source else
        ("device memory x fraction", f"{_human(plan.device_memory)} x {plan.memory_fraction}"),
        ("weights", f"{_human(plan.weight_bytes)}" + (" (estimated from the config)" if plan.weight_bytes_estimated
                                                       else f" ({plan.weight_source})" if plan.weight_source else "")),
        ("memory for the KV cache", _human(plan.kv_memory) + (f" ({plan.memory_source})" if plan.memory_source else "")),
        ("blocks / tokens that fit", f"{plan.num_blocks:,} / {plan.num_tokens:,}"),
        (f"sequences, each reserving {plan.max_len}", f"{plan.seqs_reserving_max:,} (waste {plan.waste_reserving_max:.1%} at {plan.typical_len} tokens)"),
        (f"sequences paged at {plan.typical_len}", f"{plan.seqs_paged:,} (waste {plan.waste_paged:.1%}: last block)"),
        ("paged / reserved", f"{plan.paged_over_reserved:.2f}x"),
    ]
    if plan.experts:
        experts, used = plan.experts
        one = plan.weight_bytes_per_step[1]
        rows.append(("experts", f"{experts} per layer, {used} per token: {_human(one)} of the weights read per token "
                                f"({one / plan.weight_bytes:.0%})"))
        rows.append(("weights read per step", ", ".join(
            f"{n} tokens {_human(b)}" for n, b in plan.weight_bytes_per_step.items() if n > 1)
            + " (tokens routed uniformly: a real router reads fewer)"))
    if plan.conv:
        layers, kernel, state, held = plan.conv
        rows.append(("short-convolution state", f"{_human(state)} per request ({layers} conv layers x the last "
                                                f"{kernel - 1} inputs), held as up to {_human(held)} of window blocks"))
    if plan.sliding_window:
        rows.append(("sliding window", f"{plan.sliding_window} tokens on {plan.num_window_layers} of the layers"))
        layers = plan.kv_groups[0][2]
        rows.append(("KV groups (a block table each)", " + ".join(
            f"{count} {'global' if window is None else f'sliding-window ({window} tokens)'}" for window, count, _ in plan.kv_groups)
            + f", {layers} layers each: {plan.bytes_per_token * layers // sum(c * n for _, c, n in plan.kv_groups):,} B per token per group"))
        for n, (aware, blind) in plan.seqs_by_context.items():
            rows.append((f"sequences of {n} tokens", f"{aware:,} keeping only window blocks, {blind:,} window-blind "
                                                        f"({aware / blind:.2f}x)" if blind else f"{aware:,} (window-blind: 0)"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("config fields used: " + "; ".join(f"{k} <- {v}" for k, v in plan.fields.items()))
    return "\n".join(lines)
