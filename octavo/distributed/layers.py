"""Sharding a loaded Llama for tensor parallelism, from outside the model file (as gpt-fast's tp.py
does): column-parallel q|k|v and gate|up, row-parallel o and down (all-reduce after), a
vocabulary-parallel embedding and LM head (logits gathered). Each rank keeps its share of the
query and KV heads, so each rank's KV cache holds only its heads."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.models.llama import Linear, LlamaForCausalLM


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """ValueError naming what does not split over `world` ranks."""
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {name} ({value}); "
                             f"choose a size that divides {cfg.num_heads} query heads and {cfg.num_kv_heads} KV heads")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The model as one rank sees it: its share of the heads (what its KV cache is sized by)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def _rows(t: torch.Tensor | None, parts: list[tuple[int, int]]) -> torch.Tensor | None:
    return None if t is None else torch.cat([t[a:b] for a, b in parts])


class RowParallelLinear(nn.Module):
    """x[:, this rank's inputs] @ W_shard.T, summed over ranks (all-reduce), then the bias once."""

    def __init__(self, shard: Linear, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.shard = shard
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, meta=None) -> torch.Tensor:
        y = self.shard(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; a token outside them contributes zeros, and
    the ranks' lookups are summed (all-reduce)."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        dist.all_reduce(out)
        return out


def shard_model(model: LlamaForCausalLM, rank: int, world: int) -> LlamaForCausalLM:
    """Replace `model`'s layers by this rank's shards, in place; returns it. Dense weights only."""
    cfg = model.config
    check_divisible(cfg, world)
    d = cfg.head_dim
    qh, kh, ih = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.intermediate_size // world
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [(rank * qh * d, (rank + 1) * qh * d),
               (q_size + rank * kh * d, q_size + (rank + 1) * kh * d),
               (q_size + kv_size + rank * kh * d, q_size + kv_size + (rank + 1) * kh * d)]
        attn.qkv_proj = _linear(_rows(attn.qkv_proj.weight, qkv), _rows(attn.qkv_proj.bias, qkv))
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(_linear(o.weight[:, rank * qh * d : (rank + 1) * qh * d], None), o.bias)
        attn.num_heads, attn.num_kv_heads = qh, kh
        attn.q_size, attn.kv_size = qh * d, kh * d
        gate_up = [(rank * ih, (rank + 1) * ih), (cfg.intermediate_size + rank * ih, cfg.intermediate_size + (rank + 1) * ih)]
        mlp.gate_up_proj = _linear(_rows(mlp.gate_up_proj.weight, gate_up), None)
        down = mlp.down_proj
        mlp.down_proj = RowParallelLinear(_linear(down.weight[:, rank * ih : (rank + 1) * ih], None), None)
    vocab_rows = -(-cfg.vocab_size // world)
    start = rank * vocab_rows
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    head_shard = head[start : start + vocab_rows]
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight[start : start + vocab_rows].clone(), start)
    model.lm_head = _linear(head_shard.clone(), None)
    vocab = cfg.vocab_size

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        """Every rank's share of the vocabulary, gathered: [rows, vocab] float32 on every rank."""
        local = model.lm_head(hidden).float()  # [rows, vocab / world]
        if local.shape[1] < vocab_rows:  # the last rank's share may be short: pad to gather
            local = F.pad(local, (0, vocab_rows - local.shape[1]), value=float("-inf"))
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, :vocab]

    model.compute_logits = compute_logits  # the sampler sees whole-vocabulary logits
    return model
