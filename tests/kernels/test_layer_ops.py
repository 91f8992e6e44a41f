"""The fused per-layer C++ ops (add + RMSNorm, RoPE + KV write) equal their torch references."""

from __future__ import annotations

import pytest
import torch

from octavo.kernels import cpu, reference

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")


@pytest.mark.parametrize("n,dim", [(1, 64), (5, 576), (130, 96)])
def test_rms_norm_and_fused_residual_add(n, dim):
    x, residual, w = torch.randn(n, dim), torch.randn(n, dim), torch.randn(dim)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    expect_h, expect_r = reference.add_rms_norm(x, residual, w, 1e-5)
    h, r = cpu.add_rms_norm(x.clone(), residual.clone(), w, 1e-5)
    torch.testing.assert_close(r, expect_r, atol=0, rtol=0)  # the add is exact
    torch.testing.assert_close(h, expect_h, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,heads,kv_heads,d,rot", [(1, 9, 3, 64, 64), (7, 4, 4, 32, 32), (33, 8, 2, 128, 128),
                                                    (5, 4, 2, 128, 96), (3, 2, 1, 64, 16)])
def test_rotary_and_kv_write_in_place(n, heads, kv_heads, d, rot):
    """(rot < d: a partial-rotary model, Phi-4-mini's 96 of 128: the rest of each head passes through)"""
    torch.manual_seed(n)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d)
    angles = torch.rand(n, rot // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.randperm(10 * 4)[:n]
    caches = [(torch.zeros(10, 4, kv_heads, d), torch.zeros(10, 4, kv_heads, d)) for _ in range(2)]
    expect = qkv.clone()
    reference.rotary_write_kv(expect, cos, sin, *caches[0], slots, heads, kv_heads)
    got = qkv.clone()
    cpu.rotary_write_kv(got, cos, sin, *caches[1], slots, heads, kv_heads)
    torch.testing.assert_close(got, expect, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[1][1], caches[0][1])  # values are copied, not rotated
    # and the reference is the unfused sequence the model used before (on the rotary part)
    q = qkv.view(n, -1, d)[:, :heads]
    torch.testing.assert_close(expect.view(n, -1, d)[:, :heads, :rot], reference.apply_rotary(q[..., :rot], cos, sin))
    assert torch.equal(expect.view(n, -1, d)[:, :heads, rot:], q[..., rot:])


@pytest.mark.parametrize("n,heads,kv_heads,d", [(1, 4, 1, 256), (6, 16, 8, 128), (40, 4, 2, 64)])
def test_per_head_qk_norm_rotary_and_kv_write_in_place(n, heads, kv_heads, d):
    """Qwen3's and Gemma 3's q/k RMSNorm fused in front of RoPE: the C++ op equals the reference,
    and the reference equals the unfused sequence (norm each head, then RoPE, then the write)."""
    torch.manual_seed(n + d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d) * 3
    angles = torch.rand(n, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    qk_norm = (torch.randn(d) + 1, torch.randn(d) + 1, 1e-6)
    slots = torch.randperm(10 * 4)[:n]
    caches = [(torch.zeros(10, 4, kv_heads, d), torch.zeros(10, 4, kv_heads, d)) for _ in range(2)]
    expect = qkv.clone()
    reference.rotary_write_kv(expect, cos, sin, *caches[0], slots, heads, kv_heads, qk_norm)
    got = qkv.clone()
    cpu.rotary_write_kv(got, cos, sin, *caches[1], slots, heads, kv_heads, qk_norm)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=2e-5, rtol=1e-5)
    assert torch.equal(caches[1][1], caches[0][1])  # values are neither normed nor rotated
    q, k, v = qkv.view(n, -1, d).split([heads, kv_heads, kv_heads], dim=1)
    unfused_q = reference.apply_rotary(reference.rms_norm(q, qk_norm[0], 1e-6), cos, sin)
    unfused_k = reference.apply_rotary(reference.rms_norm(k, qk_norm[1], 1e-6), cos, sin)
    torch.testing.assert_close(expect.view(n, -1, d)[:, :heads], unfused_q, atol=0, rtol=0)
    torch.testing.assert_close(caches[0][0].view(-1, kv_heads, d)[slots], unfused_k, atol=0, rtol=0)
    assert not torch.allclose(got, qkv)  # something happened


def test_rotary_refuses_a_slot_outside_the_cache():
    qkv = torch.randn(1, 3 * 16)
    cos = sin = torch.ones(1, 16)
    k, v = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.rotary_write_kv(qkv, cos, sin, k, v, torch.tensor([8]), 1, 1)


@pytest.mark.parametrize("n,inter", [(1, 1536), (3, 40), (70, 96)])
def test_silu_and_mul(n, inter):
    gate_up = torch.randn(n, 2 * inter) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])  # the exp's clamps and zero
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=1e-5, rtol=1e-5)
