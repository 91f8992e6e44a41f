"""Mixture-of-experts routing and grouping (kernels/reference.py) and the SparseMoE layer against a
plain per-token loop: every token's k experts run on it alone and are summed with its weights."""

from __future__ import annotations

import pytest
import torch

from octavo.config import MoEConfig, ModelConfig, RopeConfig
from octavo.kernels import reference
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
