"""Chained block hashes for prefix caching: sha256 over (parent hash, block tokens, extra keys).

Two encodings of that triple before the sha256 (CacheConfig.prefix_caching_hash_algo):
  * sha256: a pickle (the default; Python-only);
  * sha256_cbor: canonical CBOR (RFC 8949 4.2.1: shortest integer and length heads, definite
    lengths), as vLLM's option of that name: any language can recompute a block's hash from the
    tokens a KV event carries (docs/API.md gives the recipe).

Only full blocks are hashed. The first block's parent is a fixed constant, so the same tokens hash
the same in every process. Under sha256_cbor it is sha256(cbor(seed)) with seed the
PYTHONHASHSEED string when that is set (vLLM's rule, so both engines agree given one seed and no
extra keys), else "octavo-prefix-cache-v1". Extra keys hold the per-request
cache salt (first block only: because hashes chain, that isolates the whole chain), a LoRA id
slot, so adapters never share KV with the base model, and the count of a block's rows the int8
mode's prompt tiles computed (their KV differs in bits from the int8 rows').
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence

# Fixed seed of every sha256 chain; a constant so hashes are reproducible across processes and restarts.
NONE_HASH: bytes = hashlib.sha256(b"octavo-prefix-cache-v1").digest()
_SEED = "octavo-prefix-cache-v1"

_PICKLE_PROTOCOL = 5


def cbor_canonical(value: object) -> bytes:
    """Canonical CBOR of None, bools, ints in [-2^64, 2^64), bytes, str, and lists / tuples of
    them (both arrays): what block hashes are made of. TypeError for anything else."""
    out = bytearray()
    _cbor_into(out, value)
    return bytes(out)


def _cbor_head(out: bytearray, major: int, n: int) -> None:
    """A major type with its argument in the shortest form."""
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out.append(major << 5 | 25)
        out += struct.pack(">H", n)
    elif n < 1 << 32:
        out.append(major << 5 | 26)
        out += struct.pack(">I", n)
    elif n < 1 << 64:
        out.append(major << 5 | 27)
        out += struct.pack(">Q", n)
    else:
        raise TypeError(f"integer {n} does not fit CBOR's 64-bit head")


def _cbor_into(out: bytearray, value: object) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        if value >= 0:
            _cbor_head(out, 0, value)
        else:
            _cbor_head(out, 1, -1 - value)
    elif isinstance(value, bytes):
        _cbor_head(out, 2, len(value))
        out += value
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        _cbor_head(out, 3, len(raw))
        out += raw
    elif isinstance(value, (list, tuple)):
        _cbor_head(out, 4, len(value))
        for item in value:
            _cbor_into(out, item)
    else:
        raise TypeError(f"no canonical CBOR here for {type(value).__name__}")


def root_hash(algo: str = "sha256") -> bytes:
    """The parent of every chain's first block under `algo` (see the module docstring)."""
    if algo == "sha256":
        return NONE_HASH
    if algo == "sha256_cbor":
        return hashlib.sha256(cbor_canonical(os.environ.get("PYTHONHASHSEED") or _SEED)).digest()
    raise ValueError(f"unknown prefix-caching hash algorithm {algo!r} (sha256 or sha256_cbor)")


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None,
    algo: str = "sha256", root: bytes | None = None,
) -> bytes:
    """sha256 of the encoded (parent hash, block token ids, extra keys); parent None means the
    chain's root (`root`, else root_hash(algo))."""
    parent = (root or root_hash(algo)) if parent_hash is None else parent_hash
    triple = (parent, tuple(token_ids), extra_keys)
    if algo == "sha256":
        payload = pickle.dumps(triple, protocol=_PICKLE_PROTOCOL)
    elif algo == "sha256_cbor":
        payload = cbor_canonical(triple)
    else:
        raise ValueError(f"unknown prefix-caching hash algorithm {algo!r} (sha256 or sha256_cbor)")
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
    algo: str = "sha256",
    root: bytes | None = None,
    describe: Callable[[bytes, bytes | None, Sequence[int], tuple | None], None] | None = None,
) -> None:
    """Append to `block_hashes` the hashes of every full block of `token_ids` not yet hashed.
    `tiled_tokens`: how many leading positions the prompt tiles compute (row_paths.tiled_prompt_tokens);
    `algo` / `root`: as hash_block_tokens; `describe(hash, parent, tokens, extra keys)` is told
    each new block (parent None: the chain's first).

    Mutates `block_hashes` in place; a partial last block is left for when it fills.
    """
    num_full_blocks = len(token_ids) // block_size
    for block_idx in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else None
        start = block_idx * block_size
        tiled_rows = min(max(tiled_tokens - start, 0), block_size)
        tokens = token_ids[start : start + block_size]
        extra = block_extra_keys(block_idx, cache_salt, lora_id, tiled_rows)
        block_hashes.append(hash_block_tokens(parent, tokens, extra, algo, root))
        if describe is not None:
            describe(block_hashes[-1], parent, tokens, extra)


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
