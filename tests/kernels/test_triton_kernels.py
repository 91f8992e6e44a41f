"""Every Triton kernel against its torch reference (kernels/reference.py) on a grid of shapes: odd
lengths, chunks that start mid-block, block boundaries, mixed decode + chunk batches, GQA 1/3/8,
cache block sizes 8/16/32, head dims 64/128 (and one off a power of two). On the CPU these run in
the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU), with
shapes kept small; on a GPU the same tests run compiled."""

from __future__ import annotations

import pytest
import torch

from octavo.kernels import reference
from octavo.kernels import triton as octavo_triton
from tests.kernels.paged_steps import build_step

pytestmark = pytest.mark.skipif(
    not (octavo_triton.can_run_on("cuda") or octavo_triton.can_run_on("cpu")), reason="triton cannot run here"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# The interpreter rounds float32 -> bf16 toward zero where GPUs (and torch) round to nearest even,
# so a bf16 result there may differ from the reference's by one step per rounding (two at most).
BF16_ULP = dict(atol=1e-2, rtol=2**-6)


def kernels():
    from octavo.kernels.triton import kv_write, paged_attention, rms_norm, silu_and_mul

    return paged_attention, kv_write, rms_norm, silu_and_mul


def to(step, dtype):
    q, k_cache, v_cache, meta, _ = step
    for name in ("slot_mapping", "block_tables", "query_starts", "query_lens", "context_lens"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), meta


MIXED = [
    [(0, 1), (0, 13), (5, 3)],  # a first token, a short prompt, a chunk mid-block
    [(16, 1), (7, 9), (31, 1), (0, 17)],  # block boundaries, two decodes, odd chunks
    [(100, 1), (3, 40), (40, 70)],  # chunks longer than one query tile, a long decode context
]


@pytest.mark.parametrize("lengths", MIXED)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, d", [(2, 2, 64), (6, 2, 64), (8, 1, 128)])
def test_paged_attention_matches_reference(lengths, block_size, heads, kv_heads, d):
    attention = kernels()[0]
    q, k_cache, v_cache, meta = to(build_step(block_size, heads, kv_heads, d, lengths), torch.float32)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    out = attention.paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("d", [12, 64])
def test_paged_attention_bf16_and_odd_head_dim(d):
    attention = kernels()[0]
    q, k_cache, v_cache, meta = to(build_step(16, 9, 3, d, MIXED[1]), torch.bfloat16)
    expected = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, d**-0.5)
    out = attention.paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, **TOL[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [1, 4, 8])
@pytest.mark.parametrize("block_size, heads, kv_heads", [(8, 3, 1), (16, 8, 8), (32, 16, 2)])
def test_split_kv_decode_matches_reference(num_splits, block_size, heads, kv_heads):
    attention = kernels()[0]
    # decode-only: contexts shorter than one split, at a block boundary, and long
    q, k_cache, v_cache, meta = to(build_step(block_size, heads, kv_heads, 64, [(0, 1), (31, 1), (200, 1)]), torch.float32)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    out = attention.paged_attention_split_kv(q, k_cache, v_cache, meta, 0.125, num_splits)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("window", [1, 20, 64])
@pytest.mark.parametrize("block_size, heads, kv_heads, d", [(8, 4, 1, 64), (16, 6, 2, 256)])
def test_sliding_window_matches_dense(window, block_size, heads, kv_heads, d):
    """Both kernels with a window equal dense sliding-window attention; blocks before each window
    hold NaN (build_step), so a kernel that loaded them would fail."""
    attention = kernels()[0]
    step = build_step(block_size, heads, kv_heads, d, [(0, 1), (70, 1), (3, 40), (50, 30)], window=window)
    expected = step[4].to(DEVICE)
    q, k_cache, v_cache, meta = to(step, torch.float32)
    out = attention.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    q, k_cache, v_cache, meta, expected = build_step(block_size, heads, kv_heads, d, [(0, 1), (31, 1), (200, 1)], window=window)
    q, k_cache, v_cache, meta = to((q, k_cache, v_cache, meta, None), torch.float32)
    out = attention.paged_attention_split_kv(q, k_cache, v_cache, meta, d**-0.5, 4, window)
    torch.testing.assert_close(out, expected.to(DEVICE), **TOL[torch.float32])


@pytest.mark.parametrize("softcap, with_sinks", [(1.5, False), (None, True), (2.0, True)])
@pytest.mark.parametrize("window", [None, 20])
def test_soft_capping_and_sinks_match_dense(softcap, with_sinks, window):
    """Gemma 2's soft-capped scores and gpt-oss's sinks in both kernels (the unified one's sink
    after its last tile, split-KV's in the merge) equal the dense form."""
    attention = kernels()[0]
    heads, kv_heads, d = 6, 2, 64
    sinks = torch.randn(heads) * 2 if with_sinks else None
    dev_sinks = None if sinks is None else sinks.to(DEVICE)
    step = build_step(16, heads, kv_heads, d, [(0, 1), (70, 1), (3, 40), (50, 30)], window=window, softcap=softcap,
                      sinks=sinks)
    expected = step[4].to(DEVICE)
    q, k_cache, v_cache, meta = to(step, torch.float32)
    out = attention.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window, softcap, dev_sinks)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    step = build_step(16, heads, kv_heads, d, [(0, 1), (31, 1), (200, 1)], window=window, softcap=softcap, sinks=sinks)
    expected = step[4].to(DEVICE)
    q, k_cache, v_cache, meta = to(step, torch.float32)
    out = attention.paged_attention_split_kv(q, k_cache, v_cache, meta, d**-0.5, 4, window, softcap, dev_sinks)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_split_kv_refuses_prefill_rows_and_bad_splits():
    attention = kernels()[0]
    q, k_cache, v_cache, meta = to(build_step(16, 4, 2, 64, MIXED[0]), torch.float32)
    with pytest.raises(ValueError, match="decode-only"):
        attention.paged_attention_split_kv(q, k_cache, v_cache, meta, 0.125, 2)
    with pytest.raises(ValueError, match="power of two"):
        attention.paged_attention_split_kv(q, k_cache, v_cache, meta, 0.125, 3)


def test_padding_rows_are_skipped():
    """CUDA-graph padding: a request with context 0 and slot -1 writes nothing and reads nothing."""
    attention, kv_write = kernels()[:2]
    q, k_cache, v_cache, meta = to(build_step(16, 4, 2, 64, [(20, 1), (5, 1)]), torch.float32)
    meta.context_lens[1] = 0
    out = attention.paged_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], reference.paged_attention(q, k_cache, v_cache, meta, 0.125)[0], **TOL[torch.float32])
    before = k_cache.clone()
    kv_write.write_kv(k_cache, v_cache, torch.ones(2, 2, 64, device=DEVICE), torch.ones(2, 2, 64, device=DEVICE),
                      torch.tensor([-1, 3], device=DEVICE))
    changed = (k_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [0] and torch.equal(k_cache[0, 3], torch.ones(2, 64, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, kv_heads, d", [(8, 1, 64), (16, 3, 64), (32, 8, 128)])
def test_write_kv_matches_reference(dtype, block_size, kv_heads, d):
    kv_write = kernels()[1]
    torch.manual_seed(0)
    shape = (6, block_size, kv_heads, d)
    caches = [torch.randn(shape, device=DEVICE).to(dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    n = 2 * block_size + 3
    k, v = (torch.randn(n, kv_heads, d, device=DEVICE).to(dtype) for _ in range(2))
    slots = torch.randperm(6 * block_size, device=DEVICE)[:n]
    kv_write.write_kv(*caches, k, v, slots)
    reference.write_kv(*ref, k, v, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d, rot", [(4, 4, 64, 64), (9, 3, 64, 64), (8, 1, 128, 128), (4, 2, 128, 96)])
def test_rotary_write_kv_matches_reference(dtype, heads, kv_heads, d, rot):
    """(rot < d: partial rotary, Phi-4-mini's 96 of 128: a non-power-of-two number of pairs)"""
    kv_write = kernels()[1]
    torch.manual_seed(1)
    n, bs = 13, 16
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, device=DEVICE).to(dtype)
    angles = torch.rand(n, rot // 2, device=DEVICE) * 50
    cos, sin = (torch.cat((f, f), -1).to(dtype) for f in (angles.cos(), angles.sin()))
    caches = [torch.zeros(4, bs, kv_heads, d, device=DEVICE, dtype=dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    slots = torch.randperm(4 * bs, device=DEVICE)[:n]
    ref_qkv = qkv.clone()
    reference.rotary_write_kv(ref_qkv, cos, sin, *ref_caches, slots, heads, kv_heads)
    kv_write.rotary_write_kv(qkv, cos, sin, *caches, slots, heads, kv_heads)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else BF16_ULP
    torch.testing.assert_close(qkv, ref_qkv, **tol)
    torch.testing.assert_close(caches[0], ref_caches[0], **tol)
    assert torch.equal(caches[1], ref_caches[1])


def test_qk_norm_rotary_write_kv_on_the_triton_path_matches_reference():
    """Qwen3 / Gemma 3: the dispatch's Triton path (the per-head norms as Triton RMSNorm into qkv,
    then the fused RoPE + KV write) against the reference's norm + RoPE + write."""
    from octavo.kernels import dispatch

    torch.manual_seed(3)
    n, heads, kv_heads, d, bs = 5, 4, 1, 64, 16
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, device=DEVICE) * 3
    angles = torch.rand(n, d // 2, device=DEVICE) * 50
    cos, sin = (torch.cat((f, f), -1) for f in (angles.cos(), angles.sin()))
    qk_norm = (torch.randn(d, device=DEVICE) + 1, torch.randn(d, device=DEVICE) + 1, 1e-6)
    caches = [torch.zeros(2, bs, kv_heads, d, device=DEVICE) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    slots = torch.randperm(2 * bs, device=DEVICE)[:n]
    ref_qkv = qkv.clone()
    reference.rotary_write_kv(ref_qkv, cos, sin, *ref_caches, slots, heads, kv_heads, qk_norm)
    dispatch.rotary_write_kv(qkv, cos, sin, *caches, slots, heads, kv_heads, "triton", qk_norm)
    torch.testing.assert_close(qkv, ref_qkv, **TOL[torch.float32])
    torch.testing.assert_close(caches[0], ref_caches[0], **TOL[torch.float32])
    assert torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 64), (7, 576), (33, 4096)])
def test_rms_norms_match_reference(dtype, rows, dim):
    rms = kernels()[2]
    torch.manual_seed(2)
    x, residual = (torch.randn(rows, dim, device=DEVICE).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2**-6)
    torch.testing.assert_close(rms.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tol)
    normed, total = rms.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_total = reference.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, ref_total, **(dict(atol=0, rtol=0) if dtype == torch.float32 else BF16_ULP))
    torch.testing.assert_close(normed, ref_normed, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 96), (5, 1536), (9, 3000)])
def test_silu_and_mul_matches_reference(dtype, rows, inter):
    silu = kernels()[3]
    torch.manual_seed(3)
    gate_up = (3 * torch.randn(rows, 2 * inter, device=DEVICE)).to(dtype)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else BF16_ULP
    torch.testing.assert_close(silu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tol)
    # GeGLU (Gemma): tanh through exp, within float32 rounding of torch's tanh
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else BF16_ULP
    torch.testing.assert_close(silu.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up), **tol)
