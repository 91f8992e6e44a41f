"""Which kernel path computes a token's row in the int8 mode: a pure rule (no torch), read by the
model runner (which rows it sends to the AMX-BF16 tiles) and by the KV cache (whose block hashes
carry the path, so that a prefix hit never hands a request KV that the other path computed).

A request whose prompt has PROMPT_TILES_MIN_TOKENS tokens or more computes its prompt positions
through the tiles (`cpu.quant_linear_bf16_i8`, where the CPU runs them): measured 1.3-2x the int8
kernel's speed from 64 rows on (docs/BENCHMARKS.md); every other row (short prompts, decode
tokens, a preempted request's recomputed answer) runs the int8 kernel. The choice depends on the
token's own request (prompt length, position), never on the batch, and each path gives a row the
same bits alone or in a batch: batch invariance holds. The two paths give different bits, so KV
written by one is not the KV the other would write: `kv_cache/prefix_cache.block_extra_keys`
keys a block by how many of its positions the tiles computed.
"""

from __future__ import annotations

PROMPT_TILES_MIN_TOKENS = 64


def tiled_prompt_tokens(num_prompt_tokens: int, tiles: bool) -> int:
    """How many leading positions of a request the tiles compute: its whole prompt when `tiles`
    run here and the prompt has PROMPT_TILES_MIN_TOKENS tokens or more, none otherwise."""
    return num_prompt_tokens if tiles and num_prompt_tokens >= PROMPT_TILES_MIN_TOKENS else 0
