"""The second tier without a scheduler: what an eviction offers it, a preempted request's blocks
offered (swap) or let go (recompute), and a running request taking its next blocks from the pool
and the tier (KVCacheManager.extend_cached + TierConnector), in every KV group alike."""

import pytest

from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.tier import TierIndex
from tests.helpers import make_request

BS = 4
GEMMA_LIKE = (None, 8, 8, 8, 8, 8)  # Gemma 3's layout: one global group, five sliding (windows of 2 blocks)


def fill(kv: KVCacheManager, rid: str, tokens: list[int]):
    request = make_request(rid, tokens)
    kv.allocate_slots(request, len(tokens))
    kv.cache_blocks(request, len(tokens))
    return request


def extend(kv: KVCacheManager, request, max_blocks: int) -> tuple[int, int] | None:
    """What the scheduler does for a running request: take its next entries from the cache and
    start their loads. (entries taken, loads started), or None when there is no room."""
    start = request.num_computed_tokens // BS
    result = kv.extend_cached(request, max_blocks, kv.connector.can_load)
    if result is None:
        return None
    num, loads = result
    if loads:
        kv.connector.start_loads(request.request_id, start, num, loads)
    return num, len(loads)


def finish(kv: KVCacheManager, request, loaded: dict[int, bool]) -> tuple[int, int, int]:
    """Apply the runner's report as the scheduler does: (first entry, entries kept, planned)."""
    (outcome,) = kv.connector.finish_loads(loaded).values()
    kv.note_extended(request, outcome.start, outcome.num_kept, outcome.num_loaded)
    if outcome.num_kept < outcome.num_planned:
        request.num_computed_tokens = kv.roll_back(request, outcome.start + outcome.num_kept) * BS
    return outcome.start, outcome.num_kept, outcome.num_planned


@pytest.mark.parametrize("swap", [True, False])
def test_a_preempted_requests_blocks_go_to_the_tier_only_when_swapping(swap):
    kv = KVCacheManager(4, BS, tier=TierIndex(8))
    kv.connector.swap_preempted = swap
    done = fill(kv, "done", list(range(8)))  # a finished request: its blocks stay cached
    kv.remove(done)
    victim = fill(kv, "victim", list(range(100, 108)))
    kv.free(victim, preempted=True)
    fill(kv, "new", list(range(200, 216)))  # takes all four blocks: every cached one is evicted
    stores, _ = kv.connector.take_work()
    offered = {t.block_id for t in stores}
    assert len(stores) == (4 if swap else 2)  # the finished request's two always; the victim's when swapping
    assert kv.view().check_invariants() == []
    assert not kv.pool.skip_offload and offered


def test_a_hit_on_a_recomputing_victims_block_makes_it_worth_keeping_again():
    kv = KVCacheManager(4, BS, tier=TierIndex(8))
    kv.connector.swap_preempted = False
    victim = fill(kv, "victim", list(range(8)))
    kv.free(victim, preempted=True)
    sharer = make_request("sharer", list(range(8)) + [50])
    hit = kv.get_computed_blocks(sharer)
    assert hit.num_blocks == 2
    kv.allocate_slots(sharer, 1, hit)  # the victim's blocks are shared again
    kv.remove(sharer)
    fill(kv, "new", list(range(200, 216)))
    stores, _ = kv.connector.take_work()
    assert len(stores) == 2


def tier_holding(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute `tokens` in the pool, then push them out to the tier (writes committed)."""
    kv.remove(fill(kv, "old", tokens))
    kv.remove(fill(kv, "flood", list(range(900, 900 + BS * kv.num_blocks // kv.num_groups))))
    stores, _ = kv.connector.take_work()
    kv.connector.finish_stores([(t.slot, True) for t in stores])
    assert kv.get_computed_blocks(make_request("probe", tokens + [1])).num_blocks == 0


def test_a_running_request_loads_its_next_blocks_and_keeps_those_before_the_first_bad_one():
    """It computes on after its loads in the same step; a bad checksum takes back the entries
    from the bad block on, with the blocks that step's chunk was given."""
    kv = KVCacheManager(8, BS, tier=TierIndex(16))
    history = list(range(24))  # six blocks
    tier_holding(kv, history)
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))  # admitted with no pool hit
    assert extend(kv, request, max_blocks=4) == (4, 4)  # at most max_blocks
    _, loads = kv.connector.take_work()
    assert len(loads) == 4 and kv.block_tables("r")[0] == [t.block_id for t in loads]
    assert {t.request_id for t in loads} == {"r"}  # the runner knows whose step a load belongs to
    request.num_computed_tokens = 4 * BS  # counted computed: its chunk follows in the same step
    assert kv.allocate_slots(request, 2 * BS) is not None and len(kv.block_tables("r")[0]) == 6
    assert kv.num_free_blocks == 2
    bad = loads[2].block_id
    assert finish(kv, request, {t.block_id: t.block_id != bad for t in loads}) == (0, 2, 4)  # the fourth is void too
    assert kv.block_tables("r")[0] == [loads[0].block_id, loads[1].block_id] and request.num_computed_tokens == 8
    assert kv.num_free_blocks == 6  # the chunk's two blocks are back too
    assert kv.pool.lookup(kv.pool.blocks[loads[3].block_id].block_hash) is kv.pool.blocks[loads[3].block_id]
    assert kv.view().check_invariants() == []
    assert extend(kv, request, max_blocks=8) == (0, 0)  # block 3 left the tier (bad): compute it
    assert kv.stats.num_tier_hits_tokens == 2 * BS


def test_a_running_request_shares_pool_blocks_ahead_at_once_and_waits_for_room_for_tier_ones():
    kv = KVCacheManager(6, BS, tier=TierIndex(16))
    history = list(range(16))
    tier_holding(kv, history)
    sharer = fill(kv, "sharer", history[:8])  # blocks 0 and 1 back in the pool
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))
    assert kv.block_tables("r")[0] == kv.block_tables("sharer")[0]
    request.num_computed_tokens = 8
    hog = fill(kv, "hog", list(range(500, 516)))  # the four other blocks
    assert extend(kv, request, max_blocks=8) is None  # block 2 is in the tier, no room
    kv.remove(hog)
    assert extend(kv, request, max_blocks=8) == (2, 2)
    kv.remove(sharer)
    assert kv.view().check_invariants() == []


def test_a_running_request_takes_pool_and_tier_blocks_in_one_go_and_is_told_when_more_are_cached():
    kv = KVCacheManager(8, BS, tier=TierIndex(16))
    history = list(range(24))  # six blocks
    tier_holding(kv, history)
    sharer = fill(kv, "sharer", history[:8])  # blocks 0 and 1 back in the pool
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0)
    assert extend(kv, request, max_blocks=4) == (4, 2)  # two shared, two loading
    _, loads = kv.connector.take_work()
    assert kv.block_tables("r")[0][:2] == kv.block_tables("sharer")[0] and kv.block_tables("r")[0][2:] == [t.block_id for t in loads]
    request.num_computed_tokens = 4 * BS
    assert kv.num_cached_ahead(request, 1, kv.connector.can_supply) == 1  # block 4 is in the tier: take it next step
    assert finish(kv, request, {t.block_id: True for t in loads}) == (0, 4, 4)
    assert extend(kv, request, max_blocks=4) == (2, 2)
    request.num_computed_tokens = 6 * BS
    assert kv.num_cached_ahead(request, 1, kv.connector.can_supply) == 0  # the last token's block is always computed
    kv.remove(sharer)
    assert kv.view().check_invariants() == []


def test_a_request_freed_while_its_loads_are_in_flight_leaves_their_blocks_to_the_connector_until_they_end():
    kv = KVCacheManager(8, BS, tier=TierIndex(16))
    history = list(range(16))
    tier_holding(kv, history)
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))
    assert extend(kv, request, max_blocks=8) == (4, 4)
    _, loads = kv.connector.take_work()
    kv.free(request, preempted=True)  # preempted in the same step: the runner still writes those blocks
    assert sorted(kv.view().held_by_others()) == sorted(t.block_id for t in loads)
    assert kv.num_free_blocks == 4 and kv.view().check_invariants() == []
    kv.connector.finish_loads({t.block_id: True for t in loads})
    assert kv.num_free_blocks == 8 and kv.view().check_invariants() == []
    again = make_request("again", history + [77])
    assert kv.get_computed_blocks(again).num_blocks == 4  # what arrived stays cached in the pool


def test_sliding_window_groups_load_ahead_only_the_blocks_their_window_reads():
    """Gemma 3's layout: taking entries [0, 6) ahead, the global group loads all six, each window
    group only the two its window reads from block 6 on (the others stay None: never read)."""
    kv = KVCacheManager(16 * len(GEMMA_LIKE), BS, tier=TierIndex(256), group_windows=GEMMA_LIKE)
    history = list(range(28))  # seven blocks
    tier_holding(kv, history)
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))
    assert extend(kv, request, max_blocks=6) == (6, 6 + 5 * 2)
    _, loads = kv.connector.take_work()
    entries = kv.view().table_entries("r")
    assert all(b is not None for b in entries[0]) and all(t[:4] == [None] * 4 and None not in t[4:] for t in entries[1:])
    request.num_computed_tokens = 6 * BS
    assert kv.allocate_slots(request, 5) is not None  # the rest of the prompt, computed after the loads
    bad = next(t.block_id for t in loads if t.key[0] == 3 and kv.view().block_position("r", t.block_id) == 5)
    # a window group's entry 5 fails: entry 4 of every window group was read from the tier, but
    # a query at block 5 reads entries 3 and 4, and entry 3 was never loaded: back to entry 0
    assert finish(kv, request, {t.block_id: t.block_id != bad for t in loads}) == (0, 5, 6)
    assert request.num_computed_tokens == 0 and kv.block_tables("r") == [[]] * len(GEMMA_LIKE)
    assert kv.view().check_invariants() == []
    # the good blocks stayed cached in the pool: only each window's entry 3 loads now (its entry 5
    # left the tier with the bad block, so group 3 stops the run at 5 entries)
    assert extend(kv, request, max_blocks=6) == (5, 5)
    kv.connector.finish_loads({t.block_id: True for t in kv.connector.take_work()[1]})
    assert kv.view().check_invariants() == []
