"""Llama-family decoder (Llama 1-3, Mistral, Qwen2 q/k/v bias, Qwen3 q/k norm; Qwen2/3-MoE with a
mixture of experts as the feed-forward, models/moe.py) over a paged KV cache.

The model sees a flat list of tokens with their positions and an AttentionMetadata; it knows
nothing about requests, batching or scheduling. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.kernels.metadata import AttentionMetadata
from octavo.models.layers import MLP, Attention, CausalLM, KVCache, Linear, RMSNorm, RotaryEmbedding
from octavo.models.moe import SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.moe is not None else MLP(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the residual add happens inside the
        next norm (fused), so the stream is x + residual, as in the unfused form."""
        if residual is None:
            h, residual = self.input_layernorm(x, backend=meta.backend), x
        else:
            h, residual = self.input_layernorm(x, residual, meta.backend)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual, meta.backend)
        return self.mlp(h, meta), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_width, cfg.max_position)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual, meta.backend)[0]
