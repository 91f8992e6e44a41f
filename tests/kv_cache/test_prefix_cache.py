"""Chained block hashes: stable across processes, chained, salted on the first block only."""

import subprocess
import sys

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
