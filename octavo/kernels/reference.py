"""Plain torch kernels: the CPU path of every op the models call, and the oracle for Triton versions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.kernels import kv_format
from octavo.kernels.metadata import AttentionMetadata, gather_contexts
from octavo.quantization import QuantFormat, dequantize


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. x: [num_tokens, in]; weight: [out, in] -> [num_tokens, out]."""
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back, then scaled (the order Llama-family models use)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the norm after it."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """In place on qkv [n, (num_heads + 2 * num_kv_heads) * head_dim]: with `qk_norm` (q weight,
    k weight, eps) each q and k head RMSNorm-ed first (Qwen3, Gemma 3); RoPE on the q and k heads
    (on their first cos.shape[-1] values: all of them, or the rotary part of a partial-rotary
    model), then this step's k and v written to the cache at `slot_mapping`."""
    n, head_dim, rot = qkv.shape[0], kv_format.head_dim_of(k_cache), cos.shape[-1]
    heads = qkv.view(n, num_heads + 2 * num_kv_heads, head_dim)
    rotated = num_heads + num_kv_heads
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        heads[:, :num_heads] = rms_norm(heads[:, :num_heads], q_weight, eps)
        heads[:, num_heads:rotated] = rms_norm(heads[:, num_heads:rotated], k_weight, eps)
    heads[:, :rotated, :rot] = apply_rotary(heads[:, :rotated, :rot], cos, sin)
    write_kv(k_cache, v_cache, heads[:, num_heads:rotated], heads[:, rotated:], slot_mapping)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: gelu(gate, tanh approximation) * up (GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_oai_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[num_tokens, 2 * inter] -> [num_tokens, inter]: gpt-oss's clamped SwiGLU, gate clamped above
    at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def short_conv(
    bx: torch.Tensor, cache: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    query_lens: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LFM2's causal depthwise convolution over the paged cache. `bx` [n, H]: this step's inputs
    (B * x), written at `slot_mapping` into `cache` (the layer's tensors, [num_blocks, block_size,
    kv_heads, head_dim] each, a token's H values split across them, zero-padded); then per token
    at position p of its sequence, out = sum_k weight[:, k] * bx[p - (L - 1) + k] (+ bias) over
    k < L = weight.shape[1], the earlier positions read back from the cache through the
    sequence's `block_tables` row (none before position 0), the token's own from `bx`."""
    n, hidden = bx.shape
    kernel = weight.shape[1]
    block_size = cache[0].shape[1]
    flat = [t.view(-1, t.shape[2] * t.shape[3]) for t in cache]  # [slots, width] each
    width = flat[0].shape[1]
    padded = F.pad(bx, (0, len(flat) * width - hidden))
    for j, t in enumerate(flat):
        t[slot_mapping] = padded[:, j * width : (j + 1) * width].to(t.dtype)
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=bx.device), query_lens.long(), output_size=n)
    out = bx * weight[:, kernel - 1]
    for back in range(1, kernel):
        p = positions - back
        at = p.clamp(min=0)
        slots = block_tables[seq, at // block_size].long() * block_size + at % block_size
        earlier = torch.cat([t[slots] for t in flat], dim=1)[:, :hidden].to(bx.dtype)
        out = out + weight[:, kernel - 1 - back] * torch.where((p >= 0)[:, None], earlier, 0.0)
    return out if bias is None else out + bias


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values, in the caches' dtype (kv_format: int8 rows quantized with
    their scales). Caches: [num_blocks, block_size, num_kv_heads, row]; k, v: [num_tokens,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens]."""
    num_kv_heads, row = k_cache.shape[-2:]
    kv_dtype = kv_format.kv_dtype_of(k_cache)
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, kv_format.quantize_rows(k, kv_dtype))
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, kv_format.quantize_rows(v, kv_dtype))


def _values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows [..., row] -> their values [..., head_dim] in the queries' dtype."""
    return rows if rows.dtype == dtype else kv_format.dequantize_rows(rows).to(dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its request's cached keys (this step's included);
    with a `window`, the query at position p sees keys p - window + 1 .. p only (sliding-window
    layers; keys before that are never read, and their blocks may be gone). `softcap` (Gemma 2):
    every score s becomes softcap * tanh(s / softcap) before the softmax. `sinks` [num_heads]
    (gpt-oss): one more logit per head in the softmax's denominator, with no value.

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    Decode-like requests are batched together (one gather, two batched matmuls); each multi-token
    span attends on its own, to its cached prefix and causally within itself. Uses the step's
    `meta.gathered` slots when the runner built them, else expands the block tables here.
    """
    gathered = meta.gathered if meta.gathered is not None else gather_contexts(meta, k_cache.shape[1])
    num_kv_heads, row = k_cache.shape[-2:]
    head_dim = kv_format.head_dim_of(k_cache)
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, row)  # rows in the cache's dtype: _values reads them
    v_flat = v_cache.view(-1, num_kv_heads, row)
    out = torch.empty_like(q)

    nd = meta.num_decode_tokens
    if nd:
        max_len = gathered.decode_slots.shape[1]
        visible = gathered.decode_mask  # [nd, L]
        decode_slots = gathered.decode_slots
        if window is not None:  # the decode query sits at position context_len - 1
            first = meta.context_lens[:nd, None].long() - 1 - window  # keys <= first are outside
            visible = visible & (torch.arange(max_len, device=q.device)[None, :] > first)
            # keys outside the window are read from the last key's slot instead: never a gone block
            last = decode_slots.gather(1, meta.context_lens[:nd, None].long() - 1)  # [nd, 1]
            decode_slots = torch.where(visible, decode_slots, last)
        slots = decode_slots.reshape(-1)
        workspace = gathered.decode_workspace
        if (workspace is not None and workspace[0].numel() >= slots.numel() * num_kv_heads * head_dim
                and k_cache.dtype == q.dtype):
            size = slots.numel() * num_kv_heads * head_dim
            k_buf = workspace[0][:size].view(-1, num_kv_heads, head_dim)
            v_buf = workspace[1][:size].view(-1, num_kv_heads, head_dim)
            keys = torch.index_select(k_flat, 0, slots, out=k_buf).view(nd, max_len, num_kv_heads, head_dim)
            values = torch.index_select(v_flat, 0, slots, out=v_buf).view(nd, max_len, num_kv_heads, head_dim)
        else:
            keys = _values(k_flat[decode_slots], q.dtype)  # [nd, L, kvh, d]
            values = _values(v_flat[decode_slots], q.dtype)  # [nd, L, kvh, d]
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # [nd, kvh, g, d]
        hidden_mask = ~visible[:, None, :]  # [nd, 1, L]
        for h in range(num_kv_heads):
            # Strided per-head views feed the batched GEMMs directly (no transposed copies).
            scores = torch.bmm(qd[:, h], keys[:, :, h, :].transpose(1, 2)) * scale  # [nd, g, L]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill_(hidden_mask, float("-inf"))
            head_sinks = None if sinks is None else sinks[h * group : (h + 1) * group]
            probs = _softmax(scores, head_sinks)
            out[:nd, h * group : (h + 1) * group] = torch.bmm(probs, values[:, :, h, :])  # [nd, g, d]

    for span in gathered.prefills:
        if softcap is None and sinks is None:
            o = _span_attention(q, k_flat, v_flat, span, scale, window)
        else:
            o = _span_attention_explicit(q, k_flat, v_flat, span, scale, window, softcap, sinks)
        out[span.q_start : span.q_start + span.q_len] = o
    return out


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of [..., heads, keys] scores; with `sinks` [heads], each head's
    sink logit joins the denominator (its probability is dropped: it has no value)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype)[:, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def _span_attention_explicit(q, k_flat, v_flat, span, scale: float, window: int | None, softcap: float | None,
                             sinks: torch.Tensor | None) -> torch.Tensor:
    """`_span_attention` with the scores written out (soft-capping and sinks are not in SDPA)."""
    past = span.context_len - span.q_len
    lo = 0 if window is None else max(0, past + 1 - window)
    num_heads, kv_heads = q.shape[1], k_flat.shape[1]
    qs = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)  # [H, n, d]
    keys = _values(k_flat[span.context_slots[lo:]], q.dtype).transpose(0, 1).repeat_interleave(
        num_heads // kv_heads, 0)  # [H, c, d]
    values = _values(v_flat[span.context_slots[lo:]], q.dtype).transpose(0, 1).repeat_interleave(
        num_heads // kv_heads, 0)
    scores = torch.matmul(qs, keys.transpose(1, 2)) * scale  # [H, n, c]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(span.q_len, device=q.device)[:, None] + past
    cols = torch.arange(lo, span.context_len, device=q.device)[None, :]
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    scores = scores.masked_fill(~visible, float("-inf")).transpose(0, 1)  # [n, H, c]
    return torch.matmul(_softmax(scores, sinks).transpose(0, 1), values).transpose(0, 1)  # [n, H, d]


def _span_attention(q, k_flat, v_flat, span, scale: float, window: int | None) -> torch.Tensor:
    """One multi-token span: its queries over keys [lo, context_len), where lo is the first key
    its first query may see (0 without a window). -> [q_len, H, d]"""
    past = span.context_len - span.q_len
    lo = 0 if window is None else max(0, past + 1 - window)
    qs = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)  # [H, n, d]
    keys = _values(k_flat[span.context_slots[lo:]], q.dtype).transpose(0, 1)  # [kvh, ctx - lo, d]
    values = _values(v_flat[span.context_slots[lo:]], q.dtype).transpose(0, 1)  # [kvh, ctx - lo, d]
    if span.q_len == span.context_len and window is None:
        mask, causal = None, True
    else:
        rows = torch.arange(span.q_len, device=q.device)[:, None] + past
        cols = torch.arange(lo, span.context_len, device=q.device)[None, :]
        mask, causal = cols <= rows, False  # [n, ctx - lo]
        if window is not None:
            mask &= cols > rows - window
    o = F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] > keys.shape[0]
    )  # [H, n, d]
    return o.transpose(0, 1)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block)."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=kv_caches[0][0].device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=kv_caches[0][0].device)
    done: set[int] = set()  # layers of different KV groups share tensors: copy each once
    for k_cache, v_cache in kv_caches:
        if k_cache.data_ptr() in done:
            continue
        done.add(k_cache.data_ptr())
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def quant_linear(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, in_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T + bias with W in GGML blocks (octavo.quantization): rebuild W, then a plain linear.
    x: [num_tokens, in_features]; qweight: [out, row_bytes] uint8 -> [num_tokens, out]."""
    return F.linear(x, dequantize(qweight, fmt, in_features).to(x.dtype), bias)


ACT_CHUNK = 32  # activations quantized to int8 per run of this many values (every format's chunk)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [M, K] -> (xq int8 [M, K], dx float32 [M, K / 32]): per run of 32, dx = max|x| / 127
    and xq = round(x / dx) (ties to even; a run of zeros: dx 0, xq 0), as the int8 kernels do."""
    m, k = x.shape
    xb = x.float().reshape(m, k // ACT_CHUNK, ACT_CHUNK)
    dx = xb.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return xq.reshape(m, k), dx


def quant_linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, in_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T + bias as the int8-activation kernels compute it (up to the order of float sums): the
    whole weight, scaled quants and a format's mins alike, meets x rebuilt from its int8 (dx * xq)."""
    xq, dx = quantize_activations(x)
    x_hat = (xq.float().reshape(*dx.shape, ACT_CHUNK) * dx[..., None]).reshape(x.shape)
    out = x_hat @ dequantize(qweight, fmt, in_features).T
    return out if bias is None else out + bias


def quant_linear_bf16(
    x: torch.Tensor, qweight: torch.Tensor, fmt: QuantFormat, in_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T + bias as the int8 mode's prompt-row tiles compute it (up to the order of float sums):
    x and the rebuilt W rounded to bfloat16 (to nearest even), their products summed in float32."""
    w = dequantize(qweight, fmt, in_features).to(torch.bfloat16).float()
    out = x.to(torch.bfloat16).float() @ w.T
    return out if bias is None else out + bias


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping) -> None:
    """y[rows] += (x[rows] @ A[slot].T) @ B[slot].T for each (slot, rows) of `mapping.groups`,
    in place: one shrink and one expand per adapter of the step (the Punica/S-LoRA grouping), not
    one forward per adapter. x: [n, in]; y: [n, out]; lora_a: [slots, R, in]; lora_b: [slots, out, R]."""
    for slot, rows in mapping.groups:
        xs = x.index_select(0, rows)  # [rows, in]
        y.index_add_(0, rows, (xs @ lora_a[slot].T) @ lora_b[slot].T)


def moe_route(
    router_logits: torch.Tensor, top_k: int, normalize: bool, routing: str = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """"softmax_topk" (Qwen2/3-MoE): softmax over every expert in float32, the k largest kept,
    renormalised to sum 1 when `normalize`; "topk_softmax" (gpt-oss): the k largest logits, then a
    softmax over those k. [n, E] logits -> (weights [n, k] float32, expert ids [n, k] int64)."""
    if routing == "topk_softmax":
        logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(logits, dim=-1), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, meta) -> torch.Tensor:
    """sum over a token's k experts of weight * expert(x): the pairs grouped by expert, each chosen
    expert run once on its rows (gathered), its rows scaled and added in expert order. `experts`:
    modules called as expert(rows, meta); `meta.prompt_rows` (int8 prompt tiles) narrowed to each
    expert's rows. x [n, hidden], weights / ids [n, k] -> [n, hidden]."""
    import dataclasses

    order, counts = group_by_expert(ids, len(experts))
    tokens = order // ids.shape[1]  # the token of each routed pair, expert by expert
    pair_weights = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start : start + count]
            expert_meta = meta if meta.prompt_rows is None else dataclasses.replace(
                meta, prompt_rows=meta.prompt_rows.select(rows))  # its rows, not the step's
            y = experts[expert](x[rows], expert_meta) * pair_weights[start : start + count]
            out.index_add_(0, rows, y)
            start += count
    return out


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs of a routing sorted by expert: (positions into the flattened
    [n * k] routing, expert by expert, tokens in order within one; how many each expert got)."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()
