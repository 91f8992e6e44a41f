"""The sparse mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, gpt-oss): a router picks k experts per
token, each expert is a gated MLP (dense or quantized blocks, like any other), and the outputs are
summed with the router's weights.

Tokens are grouped by expert before any matmul, so a step reads each expert it uses once, whatever
the number of its tokens, and never an expert no token chose: a step's weight bytes grow with the
active experts, not the total (docs/BENCHMARKS.md measures it).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.kernels import dispatch
from octavo.kernels.metadata import AttentionMetadata
from octavo.models.layers import MLP, Linear


class SparseMoE(nn.Module):
    """Router `gate` [experts, hidden], `experts` (one MLP each), and where the family has one
    (Qwen2-MoE) a shared expert every token runs, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.num_experts, self.top_k, self.normalize, self.routing = (
            moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.routing)
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(MLP(cfg, moe.intermediate_size, moe.expert_bias) for _ in range(moe.num_experts))
        self.shared_expert = MLP(cfg, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if moe.shared_intermediate_size else None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]."""
        weights, ids = dispatch.moe_route(self.gate(x, meta), self.top_k, self.normalize, self.routing)  # [n, k] each
        order, counts = dispatch.group_by_expert(ids, self.num_experts)
        tokens = order // self.top_k  # the token of each routed pair, expert by expert
        pair_weights = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                expert_meta = meta if meta.prompt_rows is None else dataclasses.replace(
                    meta, prompt_rows=meta.prompt_rows.select(rows))  # its rows, not the step's
                y = self.experts[expert](x[rows], expert_meta) * pair_weights[start : start + count]
                out.index_add_(0, rows, y)
                start += count
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x, meta)) * self.shared_expert(x, meta)
        return out
