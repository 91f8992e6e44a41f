"""Mixture-of-experts routing and grouping (kernels/reference.py) and the SparseMoE layer against a
plain per-token loop: every token's k experts run on it alone and are summed with its weights."""

from __future__ import annotations

import pytest
import torch

from octavo.config import MoEConfig, ModelConfig, RopeConfig
from octavo.kernels import cpu, reference
from octavo.models.moe import SparseMoE


def test_routing_is_softmax_then_top_k_renormalised_or_not():
    torch.manual_seed(0)
    logits = torch.randn(9, 8)
    for normalize in (True, False):
        weights, ids = reference.moe_route(logits, 3, normalize)
        for t in range(9):
            probs = torch.softmax(logits[t].double(), dim=0)
            top = sorted(range(8), key=lambda e: -probs[e])[:3]
            assert ids[t].tolist() == top
            expect = probs[top] / (probs[top].sum() if normalize else 1)
            torch.testing.assert_close(weights[t].double(), expect, atol=1e-6, rtol=0)


def test_grouping_sorts_pairs_by_expert_keeping_token_order():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1], [3, 0]])
    order, counts = reference.group_by_expert(ids, num_experts=5)
    assert counts == [3, 1, 2, 2, 0]
    pairs = [(int(p) // 2, int(ids.reshape(-1)[p])) for p in order]  # (token, expert)
    assert pairs == [(0, 0), (1, 0), (3, 0), (2, 1), (0, 2), (2, 2), (1, 3), (3, 3)]


@pytest.mark.parametrize("shared", [0, 24])
def test_sparse_moe_equals_a_loop_over_tokens(shared):
    torch.manual_seed(1)
    moe = MoEConfig(num_experts=6, top_k=2, intermediate_size=16, norm_topk_prob=not shared,
                    shared_intermediate_size=shared)
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=10, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                      max_position=64, moe=moe)
    layer = SparseMoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(7, 32)

    def mlp(m, v):
        gate, up = (v @ m.gate_up_proj.weight.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ m.down_proj.weight.T

    expect = torch.zeros_like(x)
    for t in range(7):
        weights, ids = reference.moe_route(x[t : t + 1] @ layer.gate.weight.T, 2, moe.norm_topk_prob)
        for w, e in zip(weights[0], ids[0]):
            expect[t] += w * mlp(layer.experts[int(e)], x[t])
        if shared:
            expect[t] += torch.sigmoid(x[t] @ layer.shared_expert_gate.weight.T)[0] * mlp(layer.shared_expert, x[t])
    meta = type("Meta", (), {"backend": "reference", "prompt_rows": None})()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, meta), expect, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU kernels are not built on this machine")
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("n", [1, 3, 40])
def test_the_experts_in_one_cpp_call_give_the_loops_bits(activations, n):
    """kernels/cpu/moe.cpp against `reference.moe_experts` over the same packed experts (Q4_K
    gate|up, Q6_K down, as in a Q4_K_M file): equal bit for bit, at one token, a few, and more
    tokens than experts (every expert with several rows, some with none at n = 1)."""
    from octavo.kernels import dispatch
    from octavo.models.layers import QuantLinear
    from octavo.quantization import K_FORMATS
    from tests.kernels.test_k_quants import random_blocks

    hidden, inter, experts, k = 256, 512, 8, 3
    moe = MoEConfig(num_experts=experts, top_k=k, intermediate_size=inter, norm_topk_prob=True)
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=10, hidden_size=hidden, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(),
                      max_position=64, moe=moe)
    layer = SparseMoE(cfg)
    torch.nn.init.normal_(layer.gate.weight, std=0.3)
    q4k, q6k = K_FORMATS["Q4_K"], K_FORMATS["Q6_K"]
    for e, mlp in enumerate(layer.experts):
        mlp.gate_up_proj = QuantLinear(torch.from_numpy(random_blocks(q4k, 2 * inter, hidden, seed=e)), q4k, hidden, None,
                                       prepare=False)
        mlp.down_proj = QuantLinear(torch.from_numpy(random_blocks(q6k, hidden, inter, seed=100 + e)), q6k, inter, None,
                                    prepare=False)
        mlp.gate_up_proj.prepare(activations)
        mlp.down_proj.prepare(activations)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)) * 0.05
    meta = type("Meta", (), {"backend": "reference", "prompt_rows": None})()
    with torch.no_grad():
        kernel = layer._kernel(x, meta)
        assert kernel is not None
        weights, ids = dispatch.moe_route(layer.gate(x, meta), k, True, "softmax_topk")
        got = kernel.forward(x, ids, weights)
        expect = reference.moe_experts(x, weights, ids, layer.experts, meta)
        assert torch.equal(got, expect)
        assert torch.equal(layer(x, meta), expect)
        assert expect.abs().sum() > 0
        # an expert changed changes the tokens routed to it: the comparison is not vacuous
        chosen = int(ids[0, 0])
        layer.experts[chosen].down_proj.qweight.view(torch.uint8)[..., 7] ^= 0x10
        layer.__dict__.pop("_made")
        assert not torch.equal(layer._kernel(x, meta).forward(x, ids, weights)[0], expect[0])
