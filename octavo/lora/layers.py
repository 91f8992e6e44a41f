"""LoRALinear: a base projection plus, for each token, the product of its adapter's A and B.

Applied to a loaded model from outside the model file (`apply_lora`), as quantization is. Each
wrapped projection keeps `max_loras` slots of A and B; a fused projection (q|k|v, gate|up) keeps
one A stacked over its parts and one B that is block-diagonal over them, so a slot's shrink and
expand are one matmul each. The step's `meta.lora` groups tokens by slot (kernels/dispatch.py).
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.kernels import dispatch
from octavo.lora.adapter import LoRAAdapter

# our projection -> the PEFT targets fused in it, in output order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, layer_idx: int, name: str, part_sizes: list[int], in_features: int,
                 max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base, self.layer_idx, self.name, self.max_rank = base, layer_idx, name, max_rank
        self.part_sizes = part_sizes
        num_parts, out_features = len(part_sizes), sum(part_sizes)
        held = next(base.buffers(), next(base.parameters(), None))
        weight = getattr(base, "weight", None)  # dense: the activations' dtype; quantized: float32
        dtype = weight.dtype if weight is not None else torch.float32
        self.register_buffer("lora_a", torch.zeros(max_loras, num_parts * max_rank, in_features, device=held.device, dtype=dtype))
        self.register_buffer("lora_b", torch.zeros(max_loras, out_features, num_parts * max_rank, device=held.device, dtype=dtype))

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Load `adapter`'s parts for this projection into `slot` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        out_offset = 0
        for p, (target, size) in enumerate(zip(PARTS[self.name], self.part_sizes)):
            ab = adapter.weights.get((self.layer_idx, target))
            if ab is not None:
                a, b = ab
                r, cols = a.shape[0], slice(p * self.max_rank, p * self.max_rank + a.shape[0])
                self.lora_a[slot, p * self.max_rank : p * self.max_rank + r] = a
                self.lora_b[slot, out_offset : out_offset + size, cols] = b
            out_offset += size

    def forward(self, x: torch.Tensor, meta=None) -> torch.Tensor:
        y = self.base(x)  # a fresh tensor: the adapters' products are added to it in place
        if meta is not None and meta.lora is not None:
            dispatch.add_lora(y, x, self.lora_a, self.lora_b, meta.lora)
        return y


def apply_lora(model: nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int) -> list[LoRALinear]:
    """Wrap every layer's q|k|v, o, gate|up and down projections; returns the wrappers."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv_proj": ([q, kv, kv], h), "o_proj": ([h], q), "gate_up_proj": ([i, i], h), "down_proj": ([h], i)}
    wrapped = []
    for idx, layer in enumerate(model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                if hasattr(owner, name):
                    parts, in_f = shapes[name]
                    w = LoRALinear(getattr(owner, name), idx, name, parts, in_f, max_loras, max_rank)
                    setattr(owner, name, w)
                    wrapped.append(w)
    return wrapped
