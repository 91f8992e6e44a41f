"""Chained block hashes: stable across processes, chained, salted on the first block only."""

import subprocess
import sys

import pytest

from octavo.kv_cache.prefix_cache import (
    NONE_HASH,
    block_extra_keys,
    extend_block_hashes,
    hash_block_tokens,
)


def test_hash_is_chained_on_parent():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]) == h1
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])


def test_only_full_blocks_are_hashed_and_extension_is_incremental():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), block_size=4)
    assert len(hashes) == 2
    first = list(hashes)
    extend_block_hashes(hashes, list(range(12)), block_size=4)
    assert hashes[:2] == first and len(hashes) == 3
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_salt_changes_whole_chain_but_only_keys_first_block():
    plain: list[bytes] = []
    salted: list[bytes] = []
    extend_block_hashes(plain, list(range(8)), 4)
    extend_block_hashes(salted, list(range(8)), 4, cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert block_extra_keys(0, "s") == (("cache_salt", "s"),)
    assert block_extra_keys(1, "s") is None
    assert block_extra_keys(1, "s", lora_id="ad") == (("lora", "ad"),)


def test_hashes_are_identical_in_another_process():
    code = (
        "from octavo.kv_cache.prefix_cache import extend_block_hashes\n"
        "h=[]; extend_block_hashes(h, list(range(40)), 16, cache_salt='x')\n"
        "print(','.join(x.hex() for x in h))"
    )
    # A different PYTHONHASHSEED must not matter: hashes use sha256, not hash().
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=None,
    ).stdout.strip()
    here: list[bytes] = []
    extend_block_hashes(here, list(range(40)), 16, cache_salt="x")
    assert out == ",".join(x.hex() for x in here)


def test_blocks_the_prompt_tiles_computed_are_keyed_by_how_many_rows():
    """kernels/row_paths.py: a block's hash says how many of its positions the int8 mode's prompt
    tiles computed, so KV of one path never serves the other; no tiles, no key (hashes unchanged)."""
    from octavo.kernels.row_paths import PROMPT_TILES_MIN_TOKENS as T
    from octavo.kernels.row_paths import tiled_prompt_tokens

    assert tiled_prompt_tokens(T, True) == T and tiled_prompt_tokens(T - 1, True) == 0
    assert tiled_prompt_tokens(10 * T, False) == 0
    plain: list[bytes] = []
    extend_block_hashes(plain, list(range(48)), 16)
    zero: list[bytes] = []
    extend_block_hashes(zero, list(range(48)), 16, tiled_tokens=0)
    assert zero == plain
    tiled: list[bytes] = []
    extend_block_hashes(tiled, list(range(48)), 16, tiled_tokens=40)  # blocks: 16, 16, 8 tiled rows
    assert all(a != b for a, b in zip(plain, tiled))
    assert tiled[0] == hash_block_tokens(None, range(16), (("prompt_tiles", 16),))
    assert tiled[2] == hash_block_tokens(tiled[1], range(32, 48), (("prompt_tiles", 8),))
    longer: list[bytes] = []
    extend_block_hashes(longer, list(range(48)), 16, tiled_tokens=48)
    assert longer[:2] == tiled[:2] and longer[2] != tiled[2]  # the boundary block differs
    assert block_extra_keys(0, "s", "ad", 3) == (("lora", "ad"), ("cache_salt", "s"), ("prompt_tiles", 3))


def test_canonical_cbor_equals_cbor2_and_the_cbor_chain_is_reproducible_outside():
    """sha256_cbor: every value block hashes are made of encodes as cbor2's canonical form, and a
    chain computed with cbor2 from the documented recipe (docs/API.md) equals Octavo's."""
    import hashlib
    import os

    import cbor2

    from octavo.kv_cache.prefix_cache import cbor_canonical

    values = [None, True, False, 0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25, -257,
              -2**64, b"", b"x" * 300, "", "é" * 40, [], (1, (2, b"a", None), "s"), tuple(range(40)),
              (("lora", "ad"), ("cache_salt", "s"), ("prompt_tiles", 3))]
    for v in values:
        assert cbor_canonical(v) == cbor2.dumps(v, canonical=True), v
    with pytest.raises(TypeError):
        cbor_canonical(1.5)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(40)), 16, cache_salt="t", algo="sha256_cbor")
    seed = os.environ.get("PYTHONHASHSEED") or "octavo-prefix-cache-v1"
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    for i, h in enumerate(hashes):
        extra = (("cache_salt", "t"),) if i == 0 else None
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(range(16 * i, 16 * i + 16)), extra), canonical=True)).digest()
        assert h == parent
    plain: list[bytes] = []
    extend_block_hashes(plain, list(range(40)), 16, cache_salt="t")
    assert plain != hashes and len(plain) == 2  # the two algorithms never share a key
