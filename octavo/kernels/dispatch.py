"""The one place that picks a kernel implementation: torch reference or C++ on the CPU, Triton on GPUs.

The step's kernel family (`AttentionMetadata.backend`: "reference", "cpu" or "triton") is passed
to every op; "triton" runs the Triton kernels (octavo.kernels.triton), the others the C++ CPU op
where one applies (float32 on the CPU) and the torch reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from octavo.kernels import cpu, reference, row_paths
from octavo.kernels import triton as triton_kernels
from octavo.kernels.metadata import BACKENDS, AttentionMetadata, PromptRows
from octavo.quantization import QuantFormat, dequantize

copy_blocks = reference.copy_blocks
add_lora = reference.add_lora  # grouped shrink/expand in torch everywhere (matmuls dominate it)
# MoE routing and grouping: a few small ops on [tokens, experts] beside the experts' matmuls
moe_route = reference.moe_route
short_conv = reference.short_conv  # (torch ops on every backend: a few gathers per conv layer)


def _cpu_f32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and _cpu_kernels()


def silu_and_mul(gate_up: torch.Tensor, backend: str = "reference") -> torch.Tensor:
    """silu(gate) * up (reference.silu_and_mul): the fused C++ op for float32 rows on the CPU."""
    if backend == "triton":
        from octavo.kernels.triton import silu_and_mul as triton_silu

        return triton_silu.silu_and_mul(gate_up)
    if _cpu_f32(gate_up):
        return cpu.silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "reference") -> torch.Tensor:
    """RMSNorm (reference.rms_norm): the fused C++ op for float32 rows on the CPU."""
    if backend == "triton":
        from octavo.kernels.triton import rms_norm as triton_rms

        return triton_rms.rms_norm(x, weight, eps)
    if _cpu_f32(x) and weight.dtype == torch.float32:
        return cpu.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "reference"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). The C++ op works in place on x and residual (both
    fresh activations the caller owns); the reference and Triton allocate."""
    if backend == "triton":
        from octavo.kernels.triton import rms_norm as triton_rms

        return triton_rms.add_rms_norm(x, residual, weight, eps)
    if _cpu_f32(x) and x.is_contiguous() and residual.is_contiguous() and weight.dtype == torch.float32:
        return cpu.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    backend: str = "reference",
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """(Per-head q/k RMSNorm with `qk_norm`,) RoPE on qkv's q and k heads in place, then k and v
    into the cache (reference.rotary_write_kv)."""
    if _cpu_f32(qkv) and qkv.is_contiguous() and k_cache.dtype in CPU_KV_DTYPES and backend != "triton":
        return cpu.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, qk_norm)
    if backend == "triton":
        from octavo.kernels.triton import kv_write

        if qk_norm is not None:  # the norms as their own kernels, into qkv's q and k heads
            n, head_dim = qkv.shape[0], k_cache.shape[-1]
            heads = qkv.view(n, -1, head_dim)
            for first, count, weight in ((0, num_heads, qk_norm[0]), (num_heads, num_kv_heads, qk_norm[1])):
                part = heads[:, first : first + count]
                part.copy_(rms_norm(part.reshape(-1, head_dim), weight, qk_norm[2], backend).view_as(part))
        return kv_write.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    return reference.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, qk_norm)


@functools.cache
def _onednn_linear() -> bool:
    return cpu.has_onednn_linear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: oneDNN for float32 on the CPU where torch has it, else torch's own."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and _onednn_linear():
        return cpu.linear(x, weight, bias)
    return reference.linear(x, weight, bias)


@functools.cache
def _cpu_kernels() -> bool:
    return cpu.load() is not None


# From this many rows on, a quantized layer rebuilds its float32 weight and runs a float32 GEMM,
# which reaches the FMA peak where the factored kernel reaches ~2/3; measured on a 2-core Xeon
# (AVX-512): 3072x576 at 128 rows 2.04 ms vs 2.26, at 1,024 rows 12.0 vs 20.0. Not for layers
# whose float32 copy would be large (the rebuild's page faults: a 49,152x576 head, 40 ms).
REBUILD_MIN_ROWS = 128
REBUILD_MAX_WEIGHTS = 4 << 20


def prepare_quant_weight(qweight: torch.Tensor | list[torch.Tensor], fmt: QuantFormat,
                         activations: str = "float32") -> tuple[torch.Tensor, str]:
    """GGUF-layout blocks (or a fused layer's parts, stacked by rows) -> (the tensor the kernels
    will read, its layout). `activations` float32: "packed" for the C++ kernels (a CPU tensor,
    kernels built), else "gguf" as given (the reference reads it). int8: "packed_i8" for the
    int8-activation kernels, else "gguf_i8" (the reference's `quant_linear_int8`, same numbers)."""
    if activations not in ("float32", "int8"):
        raise ValueError(f"activations must be float32 or int8, got {activations!r}")
    kernels = (qweight[0] if isinstance(qweight, list) else qweight).device.type == "cpu" and _cpu_kernels()
    if isinstance(qweight, list) and not kernels:
        qweight = torch.cat(qweight)  # (the kernels read parts in place; the reference reads one tensor)
    if activations == "int8":
        if kernels:
            cpu.amx_enabled()  # probed once per process (a child's self-test), before the first step
        return (cpu.pack_i8(qweight, fmt), "packed_i8") if kernels else (qweight, "gguf_i8")
    return (cpu.pack(qweight, fmt), "packed") if kernels else (qweight, "gguf")


def moe_experts_kernel(gate_up: list[tuple[torch.Tensor, str, QuantFormat]],
                       down: list[tuple[torch.Tensor, str, QuantFormat]], hidden: int, inter: int):
    """The C++ experts (cpu.moe_experts) for a layer whose experts' gate|up and down weights are
    each (prepared weight, layout, format), all in one of the kernels' layouts and one format per
    projection; None otherwise (the caller runs `reference.moe_experts` over the modules). Its
    results are the reference's bit for bit on the rows it takes: any, in the int8 layout; fewer
    than REBUILD_MIN_ROWS tokens in the float32 one (from there `quant_linear` rebuilds W for a
    GEMM, which the C++ call does not)."""
    layouts = {layout for _, layout, _ in gate_up + down}
    if len(layouts) != 1 or not layouts <= {"packed", "packed_i8"}:
        return None
    formats = [{fmt for _, _, fmt in part} for part in (gate_up, down)]
    if any(len(f) != 1 for f in formats):
        return None
    return cpu.moe_experts([w for w, _, _ in gate_up], [w for w, _, _ in down], formats[0].pop(), formats[1].pop(),
                           hidden, inter, int8=layouts == {"packed_i8"})


def packed_layout_key() -> str | None:
    """What `prepare_quant_weight`'s layouts depend on here (the CPU kernels' build: sources, flags,
    torch, CPU), for files of prepared weights; None where no kernels run (layouts "gguf*")."""
    return cpu.build_dir().name if _cpu_kernels() else None


def prompt_tiles_enabled(model: torch.nn.Module) -> bool:
    """Whether this model's int8 layers take prompt rows through AMX-BF16 tiles here (which rows:
    kernels/row_paths.py)."""
    if not any(getattr(m, "layout", None) == "packed_i8" for m in model.modules()):
        return False
    return cpu.amx_bf16_enabled()


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    layout: str,
    fmt: QuantFormat,
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    prompt_rows: PromptRows | None = None,
) -> torch.Tensor:
    """x @ W.T + bias, W quantized (from `prepare_quant_weight`). Packed: the C++ kernel (or, from
    REBUILD_MIN_ROWS rows, W rebuilt in float32 and one GEMM), in float32 whatever x's dtype, the
    result cast back. GGUF layout (no kernels): W rebuilt in x's dtype, then a plain linear.
    `prompt_rows` (int8 layout): the rows that go through the AMX-BF16 tiles instead."""
    if layout == "packed" and x.dim() == 2:
        xf = x if x.dtype == torch.float32 else x.float()  # the kernels compute in float32
        bf = None if bias is None else bias.float()
        if x.shape[0] >= REBUILD_MIN_ROWS and in_features * out_features <= REBUILD_MAX_WEIGHTS:
            w_t = cpu.dequantize_transposed(qweight, fmt, in_features, out_features)  # [in, out]
            out = torch.mm(xf, w_t) if bf is None else torch.addmm(bf, xf, w_t)
        else:
            out = cpu.quant_linear(xf, qweight, fmt, out_features, bf)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if layout == "packed_i8":
        plain = x.dim() == 2 and x.dtype == torch.float32  # (a decode step's every call: no reshapes, no casts)
        xf = x if plain else x.reshape(-1, in_features).float()
        bf = None if bias is None else bias.float()
        if plain and prompt_rows is None:
            return cpu.quant_linear_i8(xf, qweight, fmt, out_features, bf)
        if prompt_rows is None or x.dim() != 2:
            out = cpu.quant_linear_i8(xf, qweight, fmt, out_features, bf)
        elif prompt_rows.other is None:  # every row
            out = cpu.quant_linear_bf16_i8(xf, qweight, fmt, out_features, bf)
        else:
            out = torch.empty((xf.shape[0], out_features), dtype=torch.float32)
            out[prompt_rows.rows] = cpu.quant_linear_bf16_i8(xf[prompt_rows.rows], qweight, fmt, out_features, bf)
            out[prompt_rows.other] = cpu.quant_linear_i8(xf[prompt_rows.other], qweight, fmt, out_features, bf)
        return out.reshape(*x.shape[:-1], out_features).to(x.dtype)
    if layout == "gguf_i8":
        xf = x.reshape(-1, in_features).float()
        out = reference.quant_linear_int8(xf, qweight, fmt, in_features, None if bias is None else bias.float())
        return out.reshape(*x.shape[:-1], out_features).to(x.dtype)
    if layout == "packed":
        rows = torch.arange(out_features)
        return reference.linear(x, cpu.dequantize_rows(qweight, fmt, rows, in_features, out_features).to(x.dtype), bias)
    return reference.quant_linear(x, qweight, fmt, in_features, bias)


def quant_embedding(
    ids: torch.Tensor, qweight: torch.Tensor, layout: str, fmt: QuantFormat, dim: int, num_rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of a quantized weight, rebuilt exactly, in `dtype`: [len(ids), dim]."""
    if layout == "packed":
        return cpu.dequantize_rows(qweight, fmt, ids, dim, num_rows).to(dtype)
    if layout == "packed_i8":
        return cpu.dequantize_rows_i8(qweight, fmt, ids, dim, num_rows).to(dtype)
    return dequantize(qweight[ids], fmt, dim).to(dtype)


def quant_kernel_name(dtype: torch.dtype, device: torch.device, activations: str = "float32") -> str:
    """What `quant_linear` runs for activations of this dtype on this device (for the start-up line)."""
    kernels = device.type == "cpu" and _cpu_kernels()
    if activations == "int8":
        if not kernels:
            return "int8 activations, reference (rebuild + matmul)"
        amx = " + AMX-INT8 tiles (16+ rows)" if cpu.amx_enabled() else ""
        if cpu.amx_bf16_enabled():
            amx += f"; prompts of {row_paths.PROMPT_TILES_MIN_TOKENS}+ tokens: AMX-BF16 tiles"
        return f"int8 activations, octavo-cpu/{cpu.quant_isa()} {'VNNI' if cpu.quant_vnni() else 'vpmaddubsw'}{amx}"
    if dtype == torch.float32 and kernels:
        return f"octavo-cpu/{cpu.quant_isa()}"
    return "reference (rebuild + matmul)"


# KV-cache dtypes the C++ kernels read and write (kernels/cpu/kv_store.h)
CPU_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def select_attention_backend(requested: str, device: torch.device, kv_dtype: torch.dtype,
                             dtype: torch.dtype = torch.float32) -> str:
    """The step's kernel family for activations in `dtype` and a KV cache in `kv_dtype`. "auto":
    Triton on CUDA (the torch reference if triton is missing), on the CPU the C++ kernel where it
    applies and builds (float32 activations; any KV dtype of CPU_KV_DTYPES), else the reference. "cpu",
    "triton" and "reference" force one (ValueError where it can't run here; "triton" runs on the CPU
    only in Triton's interpreter, TRITON_INTERPRET=1, for tests). The first call on a CPU machine
    may compile the CPU kernel (~1 min, cached)."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"attention backend must be one of auto, {', '.join(BACKENDS)}; got {requested!r}")
    if requested == "reference":
        return "reference"
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        if triton_kernels.can_run_on(device.type):
            return "triton"
        if requested == "auto":
            return "reference"
        raise ValueError(
            f"the triton backend cannot run on {device.type} here: it needs triton installed and a CUDA "
            "device (or TRITON_INTERPRET=1 set before start, on the CPU: slow, for tests)"
        )
    applies = device.type == "cpu" and dtype == torch.float32 and kv_dtype in CPU_KV_DTYPES
    if requested == "cpu":
        if not applies:
            raise ValueError(f"the cpu attention backend needs float32 activations on the CPU, not {dtype} on {device}")
        if cpu.load() is None:
            raise ValueError("the cpu attention backend could not be built here (see the log); use 'reference'")
        return "cpu"
    return "cpu" if applies and cpu.load() is not None else "reference"


# Split-KV (flash-decoding) pays when a decode step has too few (request, KV head) pairs to fill
# the GPU and long contexts to walk: each pair's keys are cut into slices of >= SPLIT_MIN_KEYS.
SPLIT_MIN_CONTEXT = 1024
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 16


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many slices to cut each decode request's keys into (1: the unified kernel)."""
    pairs = num_seqs * num_kv_heads
    if max_context_len < SPLIT_MIN_CONTEXT or pairs >= num_sms:
        return 1
    splits = 1
    while splits < MAX_SPLITS and pairs * splits < num_sms and max_context_len // (2 * splits) >= SPLIT_MIN_KEYS:
        splits *= 2
    return splits


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the paged cache (within `window` keys, for sliding-window layers;
    scores soft-capped, Gemma 2; a sink logit per head, gpt-oss) by the kernel the step's metadata names."""
    if meta.backend == "triton":
        from octavo.kernels.triton import paged_attention as triton_attention

        if meta.allow_split_kv and meta.num_decode_tokens == q.shape[0] and q.is_cuda:
            max_context = meta.max_context_len if meta.max_context_len is not None else int(meta.context_lens.max())
            if window is not None:
                max_context = min(max_context, window)
            splits = num_kv_splits(q.shape[0], k_cache.shape[2], max_context, _num_sms(q.device.index or 0))
            if splits > 1:
                return triton_attention.paged_attention_split_kv(q, k_cache, v_cache, meta, scale, splits, window,
                                                                 softcap, sinks)
        return triton_attention.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    if meta.backend == "cpu":
        return cpu.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    return reference.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)


def act_and_mul(gate_up: torch.Tensor, act: str, backend: str = "reference", alpha: float = 1.702,
                limit: float = 7.0) -> torch.Tensor:
    """act(gate) * up for the gated MLP: "silu" (silu_and_mul), "gelu_tanh" (GeGLU) or
    "swiglu_oai" (gpt-oss's clamped form, `alpha` and `limit` its constants; torch ops on every
    backend: a few elementwise ops on a MoE layer's few rows)."""
    if act == "silu":
        return silu_and_mul(gate_up, backend)
    if act == "swiglu_oai":
        return reference.swiglu_oai_and_mul(gate_up, alpha, limit)
    if backend == "triton":
        from octavo.kernels.triton import silu_and_mul as triton_act

        return triton_act.gelu_tanh_and_mul(gate_up)
    return reference.gelu_tanh_and_mul(gate_up)
