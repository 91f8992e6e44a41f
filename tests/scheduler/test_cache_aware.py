"""Cache-aware admission (reused tokens, aging, the wait bound) and the cheapest-victim rule."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.config import SchedulerConfig
from octavo.kv_cache.costs import num_reusable_tokens, preemption_cost, reusable_tokens_counter
from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.tier import TierIndex
from octavo.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.policies import choose_victim
from octavo.request import FinishReason, RequestStatus
from octavo.limits import RequestRefused
from octavo.scheduler import Scheduler
from tests.helpers import make_request

BS = 4
PREFIX = list(range(500, 512))  # 3 full blocks


def make_scheduler(num_blocks=16, budget=64, max_seqs=8, tier=None, **config):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=128, **config)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, tier=tier))


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, ModelRunnerOutput(tokens={sid: [7] for e in out.scheduled for sid in e.sample_ids},
                                    tier_stored=[(t.slot, True) for t in out.tier_stores],
                                    tier_loaded={t.block_id: True for t in out.tier_loads}))
    return out


def run_until_done(s: Scheduler, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        step(s)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {sorted(s.requests)}")


def warm(s: Scheduler, prefix=PREFIX) -> None:
    """Compute `prefix` once (a request that ends), so its blocks sit cached in the pool."""
    s.add_request(make_request("warmup", prefix + [1], max_tokens=1))
    run_until_done(s)


def first_admitted(policy: str, **config) -> str:
    s = make_scheduler(max_seqs=1, policy=policy, **config)
    warm(s)
    s.add_request(make_request("cold", 13, arrival=1.0))
    s.add_request(make_request("warm", PREFIX + [2], arrival=2.0, priority=config.pop("warm_priority", 0)))
    (entry,) = s.schedule().scheduled
    return entry.request_id


def test_cache_aware_admits_the_request_that_reuses_the_cache_first():
    assert first_admitted("fcfs") == "cold"
    assert first_admitted("cache-aware") == "warm"


def test_priority_still_wins_under_cache_aware():
    s = make_scheduler(max_seqs=1, policy="cache-aware")
    warm(s)
    s.add_request(make_request("cold", 13, arrival=1.0, priority=0))
    s.add_request(make_request("warm", PREFIX + [2], arrival=2.0, priority=1))
    (entry,) = s.schedule().scheduled
    assert entry.request_id == "cold"


def test_reusable_tokens_count_the_pool_and_the_second_tier():
    s = make_scheduler(num_blocks=8, tier=TierIndex(16))
    kv = s.kv_cache
    warm(s)
    probe = make_request("probe", PREFIX + [3])
    assert num_reusable_tokens(kv, probe) == 12
    assert num_reusable_tokens(kv, make_request("other", 13)) == 0
    # push the prefix out of the pool (unique prompts fill it): the tier holds it, still reusable
    for i in range(4):
        s.add_request(make_request(f"flood{i}", 15, max_tokens=1))
        run_until_done(s)
    assert kv.get_computed_blocks(probe).num_tokens(BS) < 12  # no longer all in the pool
    assert num_reusable_tokens(kv, probe) == 12


def hostile_flood(max_wait_steps: int, aging: int, num_steps: int = 80) -> tuple[int, int] | None:
    """A cold request, then a warm one (hitting the cached prefix) every step, one running at a
    time: (steps the cold request waited before admission, steps it was passed over), or None
    when it was never admitted."""
    s = make_scheduler(max_seqs=1, policy="cache-aware", max_wait_steps=max_wait_steps, aging_tokens_per_step=aging)
    warm(s)
    cold = make_request("cold", 13, max_tokens=2, arrival=0.0)
    s.add_request(cold)
    for i in range(num_steps):
        s.add_request(make_request(f"w{i}", PREFIX + [100 + i], max_tokens=2, arrival=1.0 + i))
        step(s)
        if cold.status is not RequestStatus.WAITING:
            return cold.admit_step - cold.queued_step, cold.num_passed_over
    return None


def test_no_request_is_passed_over_past_the_bound_under_a_hostile_order():
    # without aging the warm flood always outranks the cold request: only the bound admits it,
    # as soon as the running request leaves (2 output tokens: a new admission every 2-3 steps)
    assert hostile_flood(max_wait_steps=10**6, aging=0) is None
    for bound in (1, 5, 20):
        waited, passed_over = hostile_flood(max_wait_steps=bound, aging=0)
        assert passed_over == bound and waited <= 3 * bound + 3, (bound, waited, passed_over)


def test_aging_lets_a_cold_request_rise_before_the_bound():
    waited, passed_over = hostile_flood(max_wait_steps=10**6, aging=1)
    assert waited < 80 and passed_over < 80


def test_requests_that_arrived_together_are_never_passed_over():
    s = make_scheduler(max_seqs=1, policy="cache-aware", max_wait_steps=1, aging_tokens_per_step=0)
    warm(s)
    cold = make_request("cold", 13, max_tokens=2, arrival=5.0)
    s.add_request(cold)
    for i in range(6):
        s.add_request(make_request(f"w{i}", PREFIX + [100 + i], max_tokens=2, arrival=5.0))
    run_until_done(s)
    assert cold.num_passed_over == 0


def three_running(victim: str) -> tuple[Scheduler, SchedulerOutput]:
    """c and a share a cached 2-block prefix (a alone holds one block), b holds 3 blocks of its
    own; the pool is full and every request needs a block on the next step."""
    s = make_scheduler(num_blocks=7, policy="fcfs", preemption_victim=victim, admission_headroom_steps=0)
    shared = PREFIX[:8]
    for rid, prompt in (("c", shared + [1, 2, 3]), ("a", shared + [4, 5, 6]), ("b", 11)):
        s.add_request(make_request(rid, prompt, max_tokens=4))
    for _ in range(3):
        out = step(s)
        if out.preempted_request_ids:
            return s, out
    raise AssertionError("no preemption: the scenario no longer fills the pool")


def test_cheapest_victim_loses_fewer_tokens_than_the_newest():
    s_new, out_new = three_running("newest")
    s_cheap, out_cheap = three_running("cheapest")
    assert out_new.preempted_request_ids == ["b"]  # the newest: 3 blocks of its own
    assert out_cheap.preempted_request_ids == ["a"]  # its shared blocks stay held by c
    run_until_done(s_new)
    run_until_done(s_cheap)
    assert s_cheap.preemption.num_recomputed_tokens < s_new.preemption.num_recomputed_tokens


def test_preemption_cost_counts_only_blocks_the_request_alone_holds():
    s = make_scheduler(num_blocks=16)
    shared = PREFIX[:8]
    c, a = make_request("c", shared + [1, 2, 3], max_tokens=4), make_request("a", shared + [4, 5, 6], max_tokens=4)
    s.add_request(c)
    step(s)  # c computes the shared blocks
    s.add_request(a)
    step(s)  # a hits them; c has 12 tokens computed, a 11
    kv = s.kv_cache
    assert (c.num_computed_tokens, a.num_computed_tokens) == (12, 11)
    assert preemption_cost(kv, c) == (4, 1)  # its third block; blocks 0-1 stay held by a
    assert preemption_cost(kv, a) == (3, 1)
    s.finish_requests(["a"], FinishReason.ABORT)
    assert preemption_cost(kv, c) == (12, 3)  # alone now: all of it is lost


def test_with_a_tier_a_block_already_stored_costs_nothing():
    s = make_scheduler(num_blocks=8, tier=TierIndex(16))
    kv = s.kv_cache
    warm(s)
    for i in range(4):  # the prefix leaves the pool for the tier
        s.add_request(make_request(f"flood{i}", 15, max_tokens=1))
        run_until_done(s)
    r = make_request("r", PREFIX + [1, 2, 3], max_tokens=8)
    s.add_request(r)
    while r.num_computed_tokens < 15:
        step(s)
    cost, num_freed = preemption_cost(kv, r)
    assert num_freed == 4
    assert cost == 3  # the partial block's 3 tokens; the 3 full blocks are in the tier already


def victim(s: Scheduler):
    return choose_victim(s.config, s.kv_cache, s.running, s._num_steps)


def test_a_request_that_just_resumed_is_not_the_victim():
    s = make_scheduler(num_blocks=64, preemption_victim="cheapest", admission_headroom_steps=0)
    for rid, n in (("old", 10), ("resumed", 3), ("other", 9)):
        s.add_request(make_request(rid, n, max_tokens=60))
    step(s)
    resumed = s.requests["resumed"]
    assert victim(s) is resumed  # the cheapest: fewest tokens of its own
    resumed.num_preemptions, resumed.admit_step = 1, s._num_steps
    assert victim(s) is s.requests["other"]
    for _ in range(s.config.resume_protect_steps):
        step(s)
    assert victim(s) is resumed  # protection over
    assert s.requests["old"] is not victim(s)


def test_re_preemptions_and_resumes_are_counted():
    s = make_scheduler(num_blocks=4, budget=64, preemption_victim="newest")
    for rid in "ab":
        s.add_request(make_request(rid, 7, max_tokens=9))
    run_until_done(s)
    stats = s.stats()
    assert stats.preemption.num_preemptions >= 1 and stats.preemption.num_resumed >= 1
    assert stats.preemption.num_repreemptions == stats.preemption.num_preemptions - 1  # only b is ever preempted


@settings(max_examples=60, deadline=None)
@given(chains=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=12),
       cached=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6)), max_size=6), tier=st.booleans())
def test_the_counter_for_many_requests_equals_one_walk_each(chains, cached, tier):
    """Requests of 3 roots, diverging after 0-6 shared blocks; the pool (or the tier) holds some
    of the roots' prefixes: the counter's shortcut gives what a walk of each request gives."""
    kv = KVCacheManager(64, BS, tier=TierIndex(64) if tier else None)
    root = {r: [1000 * (r + 1) + i for i in range(40)] for r in range(3)}
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128), kv)
    for i, (r, num_blocks) in enumerate(cached):
        s.add_request(make_request(f"c{i}", root[r][: num_blocks * BS] + [7], max_tokens=1))
        run_until_done(s)
    requests = [make_request(f"q{i}", root[r][: shared * BS] + [5000 + i] * (extra * BS))
                for i, (r, shared, extra) in enumerate(chains)]
    count = reusable_tokens_counter(kv)
    got = [count(q) for q in requests]
    available = kv.is_cached if tier else kv.is_in_pool
    want = [next((i for i, h in enumerate(hashes) if not available((0, h))), len(hashes)) * BS
            for hashes in (kv.block_hashes(q)[: kv.num_lookup_blocks(q)] for q in requests)]
    assert got == want


def test_admission_keeps_room_for_the_running_requests_to_grow():
    # a decodes towards 4 + 20 tokens (6 blocks); the pool has 7: b (2 blocks) fits now, but
    # only by taking blocks a grows into within its next 20 tokens
    for headroom, admitted in ((0, True), (20, False), (4, True)):
        s = make_scheduler(num_blocks=7, admission_headroom_steps=headroom)
        a = make_request("a", 4, max_tokens=20)
        s.add_request(a)
        step(s)
        s.add_request(make_request("b", 6, max_tokens=2))
        step(s)
        assert (s.requests["b"].status is RequestStatus.RUNNING) is admitted, headroom


def pinned_scheduler(share_blocks: int = 4) -> Scheduler:
    s = make_scheduler(num_blocks=12)
    s.kv_cache.pins.max_blocks = share_blocks
    pin = make_request("pin", PREFIX + [9], max_tokens=1)  # 3 full blocks
    pin.pin = True
    s.add_request(pin)
    run_until_done(s)
    return s


def test_a_pinned_prefix_hits_fully_after_a_flood_ten_times_the_pool():
    s = pinned_scheduler()
    kv = s.kv_cache
    assert kv.pins.num_blocks == 3 and kv.num_free_blocks == 12 - 3
    for i in range(40):  # 40 unique prompts of 3 blocks + 1: 10x the pool's 12 blocks
        s.add_request(make_request(f"flood{i}", 13, max_tokens=2))
    run_until_done(s, max_steps=2000)
    probe = make_request("probe", PREFIX + [4, 5])
    assert kv.get_computed_blocks(probe).num_tokens(BS) == 12  # the whole prefix, from the pool
    assert kv.reset_prefix_cache() >= 0 and kv.get_computed_blocks(probe).num_tokens(BS) == 12  # a reset keeps it
    assert kv.view().check_invariants() == []
    assert kv.pins.unpin_all() == 3 and kv.num_free_blocks == 12


def test_without_pinning_the_flood_evicts_the_prefix():
    s = make_scheduler(num_blocks=12)
    warm(s)
    for i in range(40):
        s.add_request(make_request(f"flood{i}", 13, max_tokens=2))
    run_until_done(s, max_steps=2000)
    assert s.kv_cache.get_computed_blocks(make_request("probe", PREFIX + [4, 5])).num_tokens(BS) == 0


def test_pinning_past_the_share_is_refused_and_pinning_twice_holds_no_more():
    s = pinned_scheduler(share_blocks=4)
    again = make_request("again", PREFIX + [8], max_tokens=1)
    again.pin = True
    s.add_request(again)  # the same 3 blocks: nothing new to hold
    run_until_done(s)
    assert s.kv_cache.pins.num_blocks == 3
    other = make_request("other", list(range(700, 708)) + [1], max_tokens=1)  # 2 new blocks: 5 > 4
    other.pin = True
    with pytest.raises(RequestRefused, match="pinned share of the pool"):
        s.add_request(other)
    assert "other" not in s.requests


def test_pinned_blocks_are_not_for_a_request_unless_its_prompt_starts_with_them():
    s = pinned_scheduler()  # 3 of 12 blocks pinned
    s.add_request(make_request("starts-with-it", PREFIX + list(range(30)), max_tokens=1))  # 11 blocks, 3 of them pinned
    with pytest.raises(RequestRefused, match="12 blocks, 3 of them pinned"):
        s.add_request(make_request("unrelated", 42, max_tokens=1))  # 11 blocks of its own: 9 are left
    run_until_done(s)
