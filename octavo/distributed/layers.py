"""Sharding a loaded Llama for tensor parallelism, from outside the model file (as gpt-fast's tp.py
does): column-parallel q|k|v and gate|up, row-parallel o and down (all-reduce after), a
vocabulary-parallel embedding and LM head (logits gathered). Each rank keeps its share of the
query and KV heads, so each rank's KV cache holds only its heads.

Dense and quantized layers alike: a quantized layer (QuantLinear, still in GGUF layout: the loader
is asked not to pack it) keeps whole rows of blocks for its output shares, and whole blocks of 32
inputs for its input shares; a share of inputs that is not a multiple of 32 is refused by name."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from octavo.config import ModelConfig
from octavo.models.layers import CausalLM, Linear, QuantEmbedding, QuantLinear, QuantLinearParts, soft_cap
from octavo.quantization import BLOCK


def check_divisible(cfg: ModelConfig, world: int, quantized: bool = False) -> None:
    """ValueError naming what does not split over `world` ranks. `quantized`: the row-parallel
    layers' input shares must also be whole blocks of 32 (o_proj: heads x head_dim; down_proj)."""
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size {world} does not divide the model's {name} ({value}); "
                             f"choose a size that divides {cfg.num_heads} query heads and {cfg.num_kv_heads} KV heads")
    if quantized:
        shares = (("o_proj", cfg.num_heads // world * cfg.head_dim), ("down_proj", cfg.intermediate_size // world))
        for name, share in shares:
            if share % BLOCK:
                raise ValueError(f"tensor_parallel_size {world} gives each rank {share} inputs of {name}, not whole "
                                 f"quantized blocks of {BLOCK}: choose another size, or --quantization none")


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


def _quantized(layer: nn.Module, name: str) -> QuantLinear | None:
    """The layer if it is quantized (and still in GGUF layout: blocks can be sliced), else None."""
    if not isinstance(layer, QuantLinear):
        return None
    if layer.layout != "gguf":
        raise ValueError(f"{name}: quantized blocks already packed for the kernels; load with prepare_quantized=False")
    return layer


def output_shard(layer: nn.Module, parts: list[tuple[int, int]], name: str) -> nn.Module:
    """Column parallel: the layer's output rows in `parts`, dense or quantized (whole block rows); a
    fused layer whose parts are in different formats is sharded dense."""
    if isinstance(layer, QuantLinearParts):
        layer = layer.as_dense()
    q = _quantized(layer, name)
    if q is not None:
        return QuantLinear(_rows(q.qweight, parts), q.fmt, q.in_features, _rows(q.bias, parts), prepare=False)
    return _linear(_rows(layer.weight, parts), _rows(layer.bias, parts))


def input_shard(layer: nn.Module, start: int, end: int, name: str) -> nn.Module:
    """Row parallel: the layer's inputs [start, end), no bias (added once, after the all-reduce).
    Quantized: whole blocks of 32 inputs, so both ends must be multiples of 32."""
    q = _quantized(layer, name)
    if q is None:
        return _linear(layer.weight[:, start:end], None)
    block = q.fmt.block_size
    if start % block or end % block:
        raise ValueError(f"{name}: its inputs [{start}, {end}) of {q.in_features} do not fall on quantized "
                         f"{q.fmt.name} blocks of {block}; use a tensor_parallel_size whose shares are "
                         "multiples of 32, or --quantization none")
    bpb = q.fmt.block_bytes
    blocks = q.qweight[:, start // block * bpb : end // block * bpb].contiguous()
    return QuantLinear(blocks, q.fmt, end - start, None, prepare=False)


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
    """Rows [start, start + rows) of the embedding (dense, or a QuantEmbedding of those rows); a
    token outside them contributes zeros, and the ranks' lookups are summed (all-reduce)."""

    def __init__(self, rows: nn.Module, num_rows: int, start: int) -> None:
        super().__init__()
        self.rows, self.num_rows, self.start = rows, num_rows, start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_rows)
        out = self.rows(local.clamp(0, self.num_rows - 1))  # [n, dim]
        out = out * inside[:, None].to(out.dtype)
        dist.all_reduce(out)
        return out


def _vocab_shards(model: CausalLM, start: int, end: int) -> tuple[nn.Module, nn.Module]:
    """(this rank's embedding rows, its LM head rows [start, end)), dense or quantized."""
    emb = model.embed_tokens
    head = emb if model.lm_head is None else model.lm_head
    if isinstance(emb, QuantEmbedding):
        q = _quantized(emb, "embed_tokens")
        rows = QuantEmbedding(q.qweight[start:end].clone(), q.fmt, q.embedding_dim, q.dtype, prepare=False)
    else:
        rows = nn.Embedding.from_pretrained(emb.weight[start:end].clone(), freeze=True)
    q_head = _quantized(head, "lm_head")
    if q_head is not None:
        head_rows = QuantLinear(q_head.qweight[start:end].clone(), q_head.fmt, q_head.in_features, None, prepare=False)
    else:
        head_rows = _linear(head.weight[start:end].clone(), None)
    return rows, head_rows


def shard_model(model: CausalLM, rank: int, world: int) -> CausalLM:
    """Replace `model`'s layers by this rank's shards, in place; returns it. Dense weights, or
    quantized ones still in GGUF layout (then call loader.prepare_quantized_layers after)."""
    cfg = model.config
    check_divisible(cfg, world)
    d = cfg.head_dim
    qh, kh, ih = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.intermediate_size // world
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [(rank * qh * d, (rank + 1) * qh * d),
               (q_size + rank * kh * d, q_size + (rank + 1) * kh * d),
               (q_size + kv_size + rank * kh * d, q_size + kv_size + (rank + 1) * kh * d)]
        attn.qkv_proj = output_shard(attn.qkv_proj, qkv, f"layers.{i}.qkv_proj")
        o = attn.o_proj
        attn.o_proj = RowParallelLinear(input_shard(o, rank * qh * d, (rank + 1) * qh * d, f"layers.{i}.o_proj"), o.bias)
        attn.num_heads, attn.num_kv_heads = qh, kh
        attn.q_size, attn.kv_size = qh * d, kh * d
        gate_up = [(rank * ih, (rank + 1) * ih), (cfg.intermediate_size + rank * ih, cfg.intermediate_size + (rank + 1) * ih)]
        mlp.gate_up_proj = output_shard(mlp.gate_up_proj, gate_up, f"layers.{i}.gate_up_proj")
        mlp.down_proj = RowParallelLinear(input_shard(mlp.down_proj, rank * ih, (rank + 1) * ih, f"layers.{i}.down_proj"),
                                          None)
    vocab_rows = -(-cfg.vocab_size // world)
    start = rank * vocab_rows
    end = min(cfg.vocab_size, start + vocab_rows)
    emb_rows, head_rows = _vocab_shards(model, start, end)
    model.embed_tokens = VocabParallelEmbedding(emb_rows, end - start, start)
    model.lm_head = head_rows
    vocab = cfg.vocab_size

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        """Every rank's share of the vocabulary, gathered: [rows, vocab] float32 on every rank."""
        local = model.lm_head(hidden).float()  # [rows, vocab / world]
        if local.shape[1] < vocab_rows:  # the last rank's share may be short: pad to gather
            local = F.pad(local, (0, vocab_rows - local.shape[1]), value=float("-inf"))
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        return soft_cap(torch.cat(parts, dim=1)[:, :vocab], cfg.final_logit_softcap)

    model.compute_logits = compute_logits  # the sampler sees whole-vocabulary logits
    return model
