"""KVCacheManager on tiny pools (4-token blocks): tables, prefix hits, copy-on-write, freeing."""

from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request
from tests.helpers import make_request

BS = 4


def admit(kv: KVCacheManager, req: Request):
    """What the scheduler does on admission, without the scheduler: hit, allocate the rest, and
    (once the forward has run) cache the blocks it filled."""
    computed = kv.get_computed_blocks(req)
    num_hit = computed.num_tokens(BS)
    alloc = kv.allocate_slots(req, req.num_tokens - num_hit, computed)
    if alloc is not None:
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req, req.num_tokens)
    return alloc, num_hit


def test_blocks_are_shareable_only_once_computed():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12, kv.get_computed_blocks(a)) is not None
    b = make_request("b", list(range(12)))
    assert kv.get_computed_blocks(b).num_blocks == 0  # allocated, not yet written: no hit
    kv.cache_blocks(a, 8)  # the forward wrote the first two blocks
    assert kv.get_computed_blocks(b).num_blocks == 2
    kv.free(a)  # e.g. preempted: the unwritten third block never became shareable
    assert kv.get_computed_blocks(b).num_blocks == 2 and kv.view().check_invariants() == []


def test_blocks_allocated_one_at_a_time_as_sequence_grows():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    req = make_request("a", 6)
    alloc, hit = admit(kv, req)
    assert hit == 0 and alloc.block_tables[0] == [0, 1] and alloc.copies == []
    for tok, expected in [(1, [0, 1]), (2, [0, 1]), (3, [0, 1, 2])]:
        req.all_token_ids.append(tok)
        alloc = kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert alloc.block_tables[0] == expected
    assert kv.num_free_blocks == 3


def test_prefix_hit_shares_full_blocks_and_never_covers_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(12)))  # 3 full blocks
    admit(kv, a)
    b = make_request("b", list(range(12)))  # identical prompt
    alloc, hit = admit(kv, b)
    # the last token must be computed, so only 2 of the 3 full blocks are hit
    assert hit == 8
    assert alloc.block_tables[0][:2] == kv.block_tables("a")[0][:2]
    assert alloc.block_tables[0][2] not in kv.block_tables("a")[0]
    shared = kv.pool.blocks[kv.block_tables("a")[0][0]]
    assert shared.ref_cnt == 2
    assert kv.stats.num_hits_tokens == 8 and kv.stats.num_queries_tokens == 24


def test_salt_isolates_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_request("a", list(range(12)), salt="t1"))
    _, hit_other = admit(kv, make_request("b", list(range(12)), salt="t2"))
    _, hit_none = admit(kv, make_request("c", list(range(12))))
    _, hit_same = admit(kv, make_request("d", list(range(12)), salt="t1"))
    assert (hit_other, hit_none, hit_same) == (0, 0, 8)


def test_freed_request_leaves_cached_blocks_for_later_hits_lru_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(10)))  # blocks 0,1 full; 2 partial
    admit(kv, a)
    kv.remove(a)
    # partial block 2 (no hash) goes to the front; then the chain tail (1) before its head (0)
    assert kv.pool.free_queue.block_ids() == [2, 3, 1, 0]
    b = make_request("b", list(range(9)))
    _, hit = admit(kv, b)
    assert hit == 8 and kv.block_tables("b")[0] == [0, 1, 2]


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    admit(kv, make_request("a", 8))
    big = make_request("b", list(range(500, 509)))
    alloc, _ = admit(kv, big)
    assert alloc is None
    assert kv.num_free_blocks == 1 and kv.block_tables("b") == []


def test_hit_on_free_cached_blocks_counts_them_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.remove(a)  # blocks 0,1 cached and free; block 2 free
    b = make_request("b", list(range(9)) + [50, 51, 52, 53])  # hits 2 blocks, needs 2 more
    alloc, _ = admit(kv, b)
    assert alloc is None  # 2 hits that are free + 2 new > 3 free
    assert kv.num_free_blocks == 3


def test_fork_shares_blocks_and_copy_on_write_of_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", list(range(6)), n=2)  # block 0 full, block 1 partial (2 tokens)
    admit(kv, parent)
    child = make_request("p", list(range(6)))
    child.request_id = "p#1"
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    b0, b1 = kv.block_tables("p#0")[0]
    assert kv.block_tables("p#1")[0] == [b0, b1]
    assert kv.pool.blocks[b0].ref_cnt == 2 and kv.pool.blocks[b1].ref_cnt == 2
    # parent writes its first output token into the shared partial block: it gets a private copy
    parent.all_token_ids.append(7)
    alloc = kv.allocate_slots(parent, 1)
    new_b1 = alloc.block_tables[0][1]
    assert alloc.copies == [(b1, new_b1)] and new_b1 != b1
    assert alloc.block_tables[0][0] == b0  # the full shared block is never duplicated
    assert kv.pool.blocks[b1].ref_cnt == 1
    # the child is now the only holder of the old partial block: it writes in place, no copy
    child.all_token_ids.append(8)
    alloc_c = kv.allocate_slots(child, 1)
    assert alloc_c.copies == [] and alloc_c.block_tables[0] == [b0, b1]
    assert kv.pool.blocks[b0].ref_cnt == 2


def test_remove_returns_every_block():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    reqs = [make_request(str(i), 5) for i in range(2)]
    for r in reqs:
        admit(kv, r)
    for r in reqs:
        kv.remove(r)
    assert kv.num_free_blocks == 5
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_with_prompt_tiles_a_prefix_is_shared_only_between_rows_of_the_same_path():
    """The int8 mode's prompt tiles (kernels/row_paths.py) compute a long prompt's positions, int8
    rows the rest: a long prompt does not take a short prompt's blocks, nor a conversation's next
    turn the blocks of the previous answer, but both share the blocks both computed as prompt."""
    from octavo.kernels.row_paths import PROMPT_TILES_MIN_TOKENS as T

    def hits(prompt_tiles: bool) -> tuple[int, int]:
        kv = KVCacheManager(num_blocks=200, block_size=BS, prompt_tiles=prompt_tiles)
        short = list(range(T - 4))  # a short prompt: int8 rows
        admit(kv, make_request("short", short))
        _, long_hit = admit(kv, make_request("long", short + list(range(5000, 5000 + T))))
        turn1 = list(range(7000, 7000 + T + 2))  # a long prompt: tiles (T + 2 tokens) ...
        first = make_request("turn1", turn1)
        admit(kv, first)
        answer = list(range(9000, 9000 + 3 * BS))  # ... then its answer: int8 rows, cached as it grows
        for tok in answer:
            first.all_token_ids.append(tok)
            kv.allocate_slots(first, 1)
            first.num_computed_tokens += 1
            kv.cache_blocks(first, first.num_tokens)
        _, turn2_hit = admit(kv, make_request("turn2", turn1 + answer + [1, 2, 3]))
        return long_hit, turn2_hit

    assert hits(False) == ((T - 4) // BS * BS, T + 2 + 3 * BS - 2)  # every full block shared (tokens only)
    # with tiles: nothing of the short prompt; of turn 1, the full blocks of its prompt only (the
    # block where prompt and answer meet was computed partly by the int8 rows)
    assert hits(True) == (0, (T + 2) // BS * BS)
