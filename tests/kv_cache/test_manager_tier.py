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
