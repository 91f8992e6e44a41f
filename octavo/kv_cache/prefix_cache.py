"""Chained block hashes for prefix caching: sha256 over (parent hash, block tokens, extra keys).

Only full blocks are hashed. The first block's parent is a fixed constant, so the same tokens hash
the same in every process (no PYTHONHASHSEED dependence). Extra keys hold the per-request
cache salt (first block only: because hashes chain, that isolates the whole chain), a LoRA id
slot, so adapters never share KV with the base model, and the count of a block's rows the int8
mode's prompt tiles computed (their KV differs in bits from the int8 rows').
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

# Fixed seed of every chain; a constant so hashes are reproducible across processes and restarts.
NONE_HASH: bytes = hashlib.sha256(b"octavo-prefix-cache-v1").digest()

_PICKLE_PROTOCOL = 5


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """sha256 of the pickled (parent hash, block token ids, extra keys); parent None means NONE_HASH."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    payload = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=_PICKLE_PROTOCOL)
    return hashlib.sha256(payload).digest()


def block_extra_keys(
    block_idx: int, cache_salt: str | None, lora_id: str | None = None, tiled_rows: int = 0,
) -> tuple | None:
    """Extra keys of block `block_idx` of a request: the salt on block 0 only, the LoRA id on all,
    and how many of its positions the int8 mode's prompt tiles computed (`tiled_rows`, 0 to the
    block's size; kernels/row_paths.py): those rows' KV differs in bits from what the int8 rows
    write, so a block is shared only between requests that computed it the same way. 0 adds no
    key, so hashes without the tiles are what they always were."""
    keys: list[tuple[str, str | int]] = []
    if lora_id is not None:
        keys.append(("lora", lora_id))
    if cache_salt is not None and block_idx == 0:
        keys.append(("cache_salt", cache_salt))
    if tiled_rows:
        keys.append(("prompt_tiles", tiled_rows))
    return tuple(keys) if keys else None


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_id: str | None = None,
    tiled_tokens: int = 0,
) -> None:
    """Append to `block_hashes` the hashes of every full block of `token_ids` not yet hashed.
    `tiled_tokens`: how many leading positions the prompt tiles compute (row_paths.tiled_prompt_tokens).

    Mutates `block_hashes` in place; a partial last block is left for when it fills.
    """
    num_full_blocks = len(token_ids) // block_size
    for block_idx in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        start = block_idx * block_size
        tiled_rows = min(max(tiled_tokens - start, 0), block_size)
        block_hashes.append(
            hash_block_tokens(
                parent,
                token_ids[start : start + block_size],
                block_extra_keys(block_idx, cache_salt, lora_id, tiled_rows),
            )
        )


class InFlightHashes:
    """Full blocks scheduled this step whose KV is not computed yet: per request its hashes, and
    how many requests compute each hash. A waiting request whose next block is among them waits
    one step and then hits it, rather than computing the same KV twice."""

    def __init__(self) -> None:
        self._by_request: dict[str, list[bytes]] = {}
        self._count: dict[bytes, int] = {}

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._count

    def __bool__(self) -> bool:
        return bool(self._count)

    def num_marked(self, rid: str) -> int:
        return len(self._by_request.get(rid, ()))

    def mark(self, rid: str, hashes: list[bytes]) -> None:
        self._by_request.setdefault(rid, []).extend(hashes)
        for h in hashes:
            self._count[h] = self._count.get(h, 0) + 1

    def clear(self, rid: str) -> None:
        """The request's blocks were computed (or will never be)."""
        for h in self._by_request.pop(rid, ()):
            left = self._count[h] - 1
            if left:
                self._count[h] = left
            else:
                del self._count[h]
