"""The manager's side of the second tier: what an eviction offers it, and a preempted request's
blocks offered (swap) or let go (recompute) as the engine's measurement chose."""

import pytest

from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.tier import TierIndex
from tests.helpers import make_request

BS = 4


def fill(kv: KVCacheManager, rid: str, tokens: list[int]):
    request = make_request(rid, tokens)
    kv.allocate_slots(request, len(tokens))
    kv.cache_blocks(request, len(tokens))
    return request


@pytest.mark.parametrize("swap", [True, False])
def test_a_preempted_requests_blocks_go_to_the_tier_only_when_swapping(swap):
    kv = KVCacheManager(4, BS, tier=TierIndex(8))
    kv.swap_preempted = swap
    done = fill(kv, "done", list(range(8)))  # a finished request: its blocks stay cached
    kv.remove(done)
    victim = fill(kv, "victim", list(range(100, 108)))
    kv.free(victim, preempted=True)
    fill(kv, "new", list(range(200, 216)))  # takes all four blocks: every cached one is evicted
    stores, _ = kv.take_tier_work()
    offered = {t.block_id for t in stores}
    assert len(stores) == (4 if swap else 2)  # the finished request's two always; the victim's when swapping
    assert kv.check_invariants() == []
    assert not kv.pool.skip_offload and offered


def test_a_hit_on_a_recomputing_victims_block_makes_it_worth_keeping_again():
    kv = KVCacheManager(4, BS, tier=TierIndex(8))
    kv.swap_preempted = False
    victim = fill(kv, "victim", list(range(8)))
    kv.free(victim, preempted=True)
    sharer = make_request("sharer", list(range(8)) + [50])
    hit = kv.get_computed_blocks(sharer)
    assert hit.num_blocks == 2
    kv.allocate_slots(sharer, 1, hit)  # the victim's blocks are shared again
    kv.remove(sharer)
    fill(kv, "new", list(range(200, 216)))
    stores, _ = kv.take_tier_work()
    assert len(stores) == 2


def tier_holding(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute `tokens` in the pool, then push them out to the tier (writes committed)."""
    kv.remove(fill(kv, "old", tokens))
    kv.remove(fill(kv, "flood", list(range(900, 900 + BS * kv.num_blocks))))
    stores, _ = kv.take_tier_work()
    kv.finish_tier_stores([(t.slot, True) for t in stores])
    assert kv.get_computed_blocks(make_request("probe", tokens + [1])).num_blocks == 0


def test_a_running_request_loads_its_next_blocks_and_keeps_those_before_the_first_bad_one():
    """It computes on after its loads in the same step; a bad checksum takes back the entries
    from the bad block on, with the blocks that step's chunk was given."""
    kv = KVCacheManager(8, BS, tier=TierIndex(16))
    history = list(range(24))  # six blocks
    tier_holding(kv, history)
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))  # admitted with no pool hit
    assert kv.extend_from_tier(request, max_blocks=4) == (4, 4)  # at most max_blocks
    _, loads = kv.take_tier_work()
    assert len(loads) == 4 and kv.block_ids("r") == [t.block_id for t in loads]
    request.num_computed_tokens = 4 * BS  # counted computed: its chunk follows in the same step
    assert kv.allocate_slots(request, 2 * BS) is not None and len(kv.block_ids("r")) == 6
    assert kv.num_free_blocks == 2
    bad = loads[2].block_id
    arrived = kv.finish_run_loads({t.block_id: t.block_id != bad for t in loads})
    assert arrived == {"r": (0, 2, 4)}  # the third failed its checksum: the fourth is not kept either
    assert kv.block_ids("r") == [loads[0].block_id, loads[1].block_id]
    assert kv.num_free_blocks == 6  # the chunk's two blocks are back too
    assert kv.pool.lookup(kv.pool.blocks[loads[3].block_id].block_hash) is kv.pool.blocks[loads[3].block_id]
    assert kv.check_invariants() == []
    request.num_computed_tokens = 8
    assert kv.extend_from_tier(request, max_blocks=8) == (0, 0)  # block 3 left the tier (bad): compute it
    assert kv.stats.num_tier_hits_tokens == 2 * BS


def test_a_running_request_shares_pool_blocks_ahead_at_once_and_waits_for_room_for_tier_ones():
    kv = KVCacheManager(6, BS, tier=TierIndex(16))
    history = list(range(16))
    tier_holding(kv, history)
    sharer = fill(kv, "sharer", history[:8])  # blocks 0 and 1 back in the pool
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))
    assert kv.block_ids("r") == kv.block_ids("sharer")
    request.num_computed_tokens = 8
    hog = fill(kv, "hog", list(range(500, 516)))  # the four other blocks
    assert kv.extend_from_tier(request, max_blocks=8) is None  # block 2 is in the tier, no room
    kv.remove(hog)
    assert kv.extend_from_tier(request, max_blocks=8) == (2, 2)
    kv.remove(sharer)
    assert kv.check_invariants() == []


def test_a_running_request_takes_pool_and_tier_blocks_in_one_go_and_is_told_when_more_are_cached():
    kv = KVCacheManager(8, BS, tier=TierIndex(16))
    history = list(range(24))  # six blocks
    tier_holding(kv, history)
    sharer = fill(kv, "sharer", history[:8])  # blocks 0 and 1 back in the pool
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0)
    assert kv.extend_from_tier(request, max_blocks=4) == (4, 2)  # two shared, two loading
    _, loads = kv.take_tier_work()
    assert kv.block_ids("r")[:2] == kv.block_ids("sharer") and kv.block_ids("r")[2:] == [t.block_id for t in loads]
    request.num_computed_tokens = 4 * BS
    assert kv.next_block_cached(request)  # block 4 is in the tier: take it next step, not compute it
    assert kv.finish_run_loads({t.block_id: True for t in loads}) == {"r": (0, 4, 4)}
    assert kv.extend_from_tier(request, max_blocks=4) == (2, 2)
    request.num_computed_tokens = 6 * BS
    assert not kv.next_block_cached(request)  # the last token's block is always computed
    kv.remove(sharer)
    assert kv.check_invariants() == []


def test_a_request_freed_while_its_loads_are_in_flight_leaves_their_blocks_to_the_manager_until_they_end():
    kv = KVCacheManager(8, BS, tier=TierIndex(16))
    history = list(range(16))
    tier_holding(kv, history)
    request = make_request("r", history + [77])
    kv.allocate_slots(request, 0, kv.get_computed_blocks(request))
    assert kv.extend_from_tier(request, max_blocks=8) == (4, 4)
    _, loads = kv.take_tier_work()
    kv.free(request, preempted=True)  # preempted in the same step: the runner still writes those blocks
    assert sorted(kv.blocks_held_for_loads()) == sorted(t.block_id for t in loads)
    assert kv.num_free_blocks == 4 and kv.check_invariants() == []
    assert kv.finish_run_loads({t.block_id: True for t in loads}) == {}
    assert kv.num_free_blocks == 8 and kv.check_invariants() == []
    again = make_request("again", history + [77])
    assert kv.get_computed_blocks(again).num_blocks == 4  # what arrived stays cached in the pool
