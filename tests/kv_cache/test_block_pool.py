"""Block pool: exact ids handed out, reference counts, and the free queue's eviction order."""

import pytest

from octavo.kv_cache.block_pool import BlockPool


def test_allocate_pops_front_in_id_order_and_sets_refcount():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 2
    assert pool.free_queue.block_ids() == [3, 4]


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_hashed_blocks_go_to_tail_unhashed_to_front():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"h-a")
    pool.cache_block(b, b"h-b")
    # freed in reverse table order: c (no hash) first, then b, then a
    pool.free([c, b, a])
    # block 3 was never used; c has no hash so it goes to the front; b then a are appended (LRU tail)
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    assert pool.lookup(b"h-a") is a


def test_eviction_drops_hash_from_map():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h-a")
    pool.free([b, a])
    assert pool.free_queue.block_ids() == [1, 0]
    (x,) = pool.allocate(1)
    assert x.block_id == 1 and pool.lookup(b"h-a") is a
    (y,) = pool.allocate(1)
    assert y is a and y.block_hash is None and pool.lookup(b"h-a") is None


def test_touch_free_cached_block_removes_it_from_queue():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    pool.free([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    assert 0 not in pool.free_queue.block_ids()
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2


def test_double_free_is_an_error():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])


def test_duplicate_content_keeps_first_block_in_map_and_frees_second_to_front():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.lookup(b"same") is a
    pool.free([b])
    assert b.block_hash is None
    assert pool.free_queue.block_ids() == [1, 2]


def test_reset_prefix_cache_forgets_hashes():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"h") is None and a.block_hash is None
