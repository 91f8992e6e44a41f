"""LFM2 (Liquid AI): a decoder whose layers are either attention (GQA, per-head q/k RMSNorm) or a
gated short convolution, each followed by a SwiGLU feed-forward, over the paged KV cache.

A short-convolution layer: in_proj gives B, C and x; y = C * conv(B * x) goes through out_proj,
where conv mixes each channel over the last `conv_kernel` positions. The convolution's state
(the last positions' B * x) lives in the layer's KV group slots ("conv" groups, kv_cache/groups.py
ShortConvState), so chunking, preemption, forks and prefix caching treat it as they treat K/V.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.config import ModelConfig
from octavo.kernels import dispatch
from octavo.kernels.metadata import AttentionMetadata
from octavo.models.layers import MLP, Attention, CausalLM, KVCache, Linear, RMSNorm, RotaryEmbedding


class ShortConv(nn.Module):
    """in_proj -> B, C, x; out_proj(C * conv(B * x)), conv depthwise and causal over `conv_kernel`
    positions (`weight` [hidden, conv_kernel], the checkpoint's Conv1d weight squeezed)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.in_proj = Linear(h, 3 * h, bias=False)
        self.out_proj = Linear(h, h, bias=False)
        self.weight = nn.Parameter(torch.zeros(h, cfg.conv_kernel), requires_grad=False)
        self.kv_group = next(g for g, group in enumerate(cfg.kv_groups()) if layer_idx in group.layers)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        b, c, h = self.in_proj(x, meta).chunk(3, dim=-1)
        if meta.group_metas is not None:
            meta = meta.group_metas[self.kv_group]
        conv = dispatch.short_conv(b * h, kv_cache, meta.slot_mapping, meta.block_tables, meta.query_lens, positions,
                                   self.weight)
        return self.out_proj(c * conv, meta)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # LFM2's operator_norm
        if cfg.is_conv(layer_idx):
            self.conv, self.self_attn = ShortConv(cfg, layer_idx), None
        else:
            self.conv, self.self_attn = None, Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # its ffn_norm
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, cos, sin, kv_cache: KVCache, meta: AttentionMetadata):
        """(this layer's output, the residual stream before it), as llama.DecoderLayer."""
        if residual is None:
            h, residual = self.input_layernorm(x, backend=meta.backend), x
        else:
            h, residual = self.input_layernorm(x, residual, meta.backend)
        if self.conv is not None:
            h = self.conv(h, positions, kv_cache, meta)
        else:
            h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual, meta.backend)
        return self.mlp(h, meta), residual


class Lfm2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the checkpoint's embedding_norm (applied last)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_width, cfg.max_position)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, cos, sin, kv_cache, meta)
        return self.norm(x, residual, meta.backend)[0]
