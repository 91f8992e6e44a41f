"""The decoder's building blocks shared by every model file: linear layers (dense and quantized),
the quantized embedding, RMSNorm, rotary embeddings and paged attention with its projections."""

from __future__ import annotations

import math

import torch
from torch import nn

from octavo.config import ModelConfig, RopeConfig
from octavo.kernels import dispatch
from octavo.kernels.metadata import AttentionMetadata
from octavo.quantization import QuantFormat

KVCache = tuple[torch.Tensor, torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear whose product goes through the kernel dispatch (oneDNN on float32 CPUs)."""

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """x @ W.T + b. `meta` (the step's metadata) is for wrappers that need it (LoRA)."""
        return dispatch.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantized: given as GGUF-layout blocks (octavo.quantization),
    held in the layout the kernel dispatch chose (`layout`)."""

    def __init__(self, qweight: torch.Tensor | DeferredBlocks, fmt: QuantFormat, in_features: int,
                 bias: torch.Tensor | None, prepare: bool = True) -> None:
        """`qweight`: GGUF-layout blocks [out_features, row_bytes], or DeferredBlocks that
        `make_blocks()` (and so `prepare()`) makes. With prepare False they stay in that layout (a
        loader that shards them first calls `prepare()` after)."""
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, qweight.shape[0]
        self.layout = "gguf"
        if isinstance(qweight, DeferredBlocks):
            self.register_buffer("qweight", torch.empty(0, dtype=torch.uint8))
            self.__dict__["_deferred"] = qweight
        else:
            self.register_buffer("qweight", qweight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if prepare:
            self.prepare()

    def prepare(self, activations: str = "float32") -> None:
        """Put the blocks in the layout the kernels for `activations` (float32 or int8) read
        (dispatch.prepare_quant_weight: deferred parts packed where they lie, never stacked);
        idempotent."""
        if self.layout == "gguf":
            deferred = self.__dict__.pop("_deferred", None)
            blocks = self.qweight if deferred is None else deferred.parts
            self.qweight, self.layout = dispatch.prepare_quant_weight(blocks, self.fmt, activations)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        return dispatch.quant_linear(x, self.qweight, self.layout, self.fmt, self.in_features, self.out_features, self.bias,
                                     None if meta is None else meta.prompt_rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"

    def make_blocks(self) -> None:
        """Stack deferred parts into GGUF-layout blocks now (a load that keeps that layout, to be
        sharded): no layer leaves the loader with them."""
        deferred = self.__dict__.pop("_deferred", None)
        if deferred is not None:
            self.qweight = torch.cat(deferred.parts)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "qweight":  # blocks given: deferred ones are never made
            self.__dict__.pop("_deferred", None)
        super().__setattr__(name, value)


class DeferredBlocks:
    """The parts of a fused projection as the file holds them, stacked by rows only where a layer
    keeps the GGUF layout (QuantLinear.make_blocks: a load to be sharded); the kernels pack them
    where they lie (QuantLinear.prepare). A start that maps the layers already prepared
    (loader.prepare_through_cache) replaces them untouched: stacking the 1B shape's q|k|v and
    gate|up parts was 0.7 s of each start. Until then the layer's `qweight` is an empty placeholder."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts, self.shape = parts, (sum(p.shape[0] for p in parts),)


class QuantLinearParts(nn.Module):
    """A fused projection whose parts the file keeps in different block formats (Llama 3 Q4_K_M
    files: q and k in Q4_K, v in Q6_K on some layers): each part its own QuantLinear, their
    outputs concatenated, the fused bias added after. Every part stays at its file size (the
    alternative, one dense float32 layer, reads 4 bytes a weight)."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = bias

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        out = torch.cat([part(x, meta) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def as_dense(self) -> Linear:
        """The same projection as one dense float32 layer (blocks still in GGUF layout)."""
        from octavo.quantization import dequantize

        weight = torch.cat([dequantize(p.qweight, p.fmt, p.in_features) for p in self.parts])
        dense = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense


class QuantEmbedding(QuantLinear):
    """Token embedding kept quantized: looked-up rows are rebuilt in the activation dtype. As the
    layer of a tied LM head it is also a QuantLinear [vocab, dim]."""

    def __init__(self, qweight: torch.Tensor, fmt: QuantFormat, dim: int, dtype: torch.dtype, prepare: bool = True) -> None:
        super().__init__(qweight, fmt, dim, None, prepare)
        self.embedding_dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return dispatch.quant_embedding(
            ids, self.qweight, self.layout, self.fmt, self.embedding_dim, self.out_features, self.dtype
        )  # [n, dim]

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, backend: str = "reference"):
        """rms_norm(x); with a residual, (rms_norm(x + residual), x + residual) (may reuse x's and
        residual's storage). `backend`: the step's kernel family (kernels/dispatch.py)."""
        if residual is None:
            return dispatch.rms_norm(x, self.weight, self.eps, backend)
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps, backend)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama 3 or linear scaling applied, then divided by
    the model's per-pair frequency factors where it has them."""
    inv_freq = _scaled_inv_freq(rope, head_dim)
    if rope.freq_factors is None:
        return inv_freq
    if len(rope.freq_factors) != head_dim // 2:
        raise ValueError(f"{len(rope.freq_factors)} rope frequency factors for a head of {head_dim} "
                         f"(one per rotary pair: {head_dim // 2})")
    return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)


def _scaled_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    base_pow = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if rope.scaling_type == "longrope":  # each pair's frequency divided by its factor (one rounding, as transformers)
        factors = torch.tensor(rope.long_factor if rope.long else rope.short_factor, dtype=torch.float32)
        if factors.numel() != base_pow.numel():
            raise ValueError(f"LongRoPE has {factors.numel()} factors for {base_pow.numel()} rotary pairs")
        return 1.0 / (factors * base_pow)
    inv_freq = 1.0 / base_pow
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.scaling_type == "yarn":
        # YaRN (arXiv 2309.00071): pairs that turn fewer than beta_slow times over the original
        # context are interpolated (divided by factor), more than beta_fast extrapolated (kept),
        # a linear ramp between; the pair bounds rounded outwards (llama.cpp always, transformers
        # unless the config says `truncate: false`, as gpt-oss's does)
        def pair(rotations: float) -> float:
            return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
        low, high = pair(rope.beta_fast), pair(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
        return inv_freq / rope.factor * (1 - keep) + inv_freq * keep
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables of one RoPE configuration for positions [0, max_position), kept at half width
    (the two halves of rotate-half RoPE are equal): Gemma's 32k positions x 256 dims cost 32 MB
    per table this way instead of 64."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_position = rope, head_dim, max_position
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if torch.get_default_device().type != "meta":  # a meta model's tables come with its device
            self.reset_tables()  # (`loader._empty_model`; meta ops import torch._dynamo: seconds)

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables on `device` (a model built on the meta device has none)."""
        inv_freq = rope_inv_freq(self.rope, self.head_dim)
        t = torch.arange(self.max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        scale = self.rope.attention_factor if self.rope.scaling_type in ("yarn", "longrope") else 1.0  # both scale
        self.cos, self.sin = (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions], self.sin[positions]  # [num_tokens, head_dim / 2]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [num_tokens, head_dim] each


class Attention(nn.Module):
    """q/k/v projection, optional per-head q/k RMSNorm, RoPE, the KV write and paged attention over
    the layer's window (None: every earlier token), then the output projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim**-0.5
        self.window = cfg.layer_window(layer_idx)
        self.softcap = cfg.attn_logit_softcap
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attn_sinks else None
        self.kv_group = next(g for g, group in enumerate(cfg.kv_groups()) if layer_idx in group.layers)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x, meta)  # [n, q_size + 2 * kv_size]
        if meta.group_metas is not None:  # this layer's KV group: its own slots and block tables
            meta = meta.group_metas[self.kv_group]
        k_cache, v_cache = kv_cache
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        # one fused op: (per-head q/k RMSNorm,) RoPE on q and k in place, k and v into the cache
        dispatch.rotary_write_kv(
            qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads, meta.backend, qk_norm
        )
        q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, self.softcap,
                                       self.sinks)  # [n, H, d]
        return self.o_proj(out.reshape(n, self.q_size), meta)


class MLP(nn.Module):
    """The gated feed-forward: down(act(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool = False) -> None:
        """`intermediate_size`: this MLP's own (an expert's); None: the model's. `bias`: both
        projections carry one (gpt-oss's experts)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias)
        self.act, self.alpha, self.limit = cfg.hidden_act, cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = dispatch.act_and_mul(self.gate_up_proj(x, meta), self.act, meta.backend, self.alpha, self.limit)
        return self.down_proj(h, meta)


class CausalLM(nn.Module):
    """What every model file's top module shares: the LM head (its own, or the tied embedding, dense
    or quantized). NORM_WEIGHT_OFFSET is added to every checkpoint norm weight at load (Gemma
    stores w for a (1 + w) scale; our RMSNorm multiplies by the loaded weight)."""

    NORM_WEIGHT_OFFSET = 0.0
    embed_tokens: nn.Module
    lm_head: nn.Module | None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> float32 logits [num_rows, vocab] (soft-capped where the model
        caps them: Gemma 2)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif isinstance(self.embed_tokens, QuantEmbedding):  # tied, quantized
            logits = self.embed_tokens.as_linear(hidden).float()
        else:
            logits = dispatch.linear(hidden, self.embed_tokens.weight).float()
        return soft_cap(logits, getattr(getattr(self, "config", None), "final_logit_softcap", None))


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's final logits); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
