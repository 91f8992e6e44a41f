"""The sparse mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, gpt-oss): a router picks k experts per
token, each expert is a gated MLP (dense or quantized blocks, like any other), and the outputs are
summed with the router's weights.

Tokens are grouped by expert before any matmul, so a step reads each expert it uses once, whatever
the number of its tokens, and never an expert no token chose: a step's weight bytes grow with the
active experts, not the total (docs/BENCHMARKS.md measures it). With the CPU kernels, a layer's
quantized experts run as one C++ call (kernels/cpu/moe.cpp), the reference's loop's bits without
its ~60 torch calls a layer.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.kernels import dispatch, reference
from octavo.kernels.metadata import AttentionMetadata
from octavo.models.layers import MLP, Linear, QuantLinear


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
        kernel = self._kernel(x, meta)
        if kernel is not None:
            out = kernel.forward(x.contiguous(), ids.contiguous(), weights.contiguous())
        else:
            out = reference.moe_experts(x, weights, ids, self.experts, meta)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x, meta)) * self.shared_expert(x, meta)
        return out

    def _kernel(self, x: torch.Tensor, meta: AttentionMetadata):
        """The experts as one C++ call (dispatch.moe_experts_kernel), made once from the prepared
        weights (again if they were replaced), where it gives the reference's bits: float32 rows on
        the CPU, no int8 prompt tiles, plain gated SiLU experts without biases or adapters."""
        if meta.prompt_rows is not None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
            return None
        first = getattr(self.experts[0].gate_up_proj, "qweight", None)
        made = self.__dict__.get("_made")
        if made is None or made[0] is not first:
            made = (first, *self._make_kernel())
            self.__dict__["_made"] = made
        _, kernel, int8 = made
        if kernel is None or (not int8 and x.shape[0] >= dispatch.REBUILD_MIN_ROWS):
            return None
        return kernel

    def _make_kernel(self) -> tuple[object | None, bool]:
        projections: tuple[list, list] = ([], [])
        for expert in self.experts:
            if expert.act != "silu":
                return None, False
            for part, linear in zip(projections, (expert.gate_up_proj, expert.down_proj)):
                if type(linear) is not QuantLinear or linear.bias is not None:
                    return None, False
                part.append((linear.qweight, linear.layout, linear.fmt))
        inter = self.experts[0].down_proj.in_features
        kernel = dispatch.moe_experts_kernel(*projections, self.experts[0].down_proj.out_features, inter)
        return kernel, projections[0][0][1] == "packed_i8"
