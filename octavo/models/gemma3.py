"""Gemma 3 text decoder over a paged KV cache: interleaved sliding-window and global layers. Gemma 2
is the same decoder with no q/k norm, one RoPE base, alternating layers and soft-capped attention
scores and final logits (the config's fields; the attention kernels and CausalLM apply them).

What differs from the Llama file: four norms per layer (before and after attention and the
feed-forward), per-head q/k RMSNorm, GeGLU with tanh GELU, the embedding scaled by sqrt(hidden),
the query scale from `query_pre_attn_scalar`, and local layers with their own window and RoPE base.
Gemma's norms scale by (1 + w): the loader adds the 1 (NORM_WEIGHT_OFFSET), so RMSNorm is shared.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.kernels.metadata import AttentionMetadata
from octavo.models.layers import MLP, Attention, CausalLM, KVCache, RMSNorm, RotaryEmbedding


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_sliding = cfg.layer_window(layer_idx) is not None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's last branch output, the residual stream before it), as in the Llama file:
        the stream is x + residual, the add fused into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x, backend=meta.backend), x
        else:
            h, residual = self.input_layernorm(x, residual, meta.backend)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta), backend=meta.backend)
        h, residual = self.pre_feedforward_layernorm(h, residual, meta.backend)
        return self.post_feedforward_layernorm(self.mlp(h, meta), backend=meta.backend), residual


class Gemma3ForCausalLM(CausalLM):
    NORM_WEIGHT_OFFSET = 1.0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)
        self.local_rotary = RotaryEmbedding(cfg.local_rope or cfg.rope, cfg.head_dim, cfg.max_position)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        # transformers rounds sqrt(hidden) to the activation dtype before the product
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        tables = {False: self.rotary(positions), True: self.local_rotary(positions)}
        tables = {k: (cos.to(x.dtype), sin.to(x.dtype)) for k, (cos, sin) in tables.items()}
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            cos, sin = tables[layer.is_sliding]
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual, meta.backend)[0]
