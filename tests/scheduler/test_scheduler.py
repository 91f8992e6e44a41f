"""Scheduler on tiny pools: token budget, chunking, preemption, refusal, abort and forks."""

import pytest

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.request import FinishReason, RequestStatus
from octavo.limits import RequestRefused
from octavo.scheduler import Scheduler
from tests.helpers import make_request

BS = 4


def make_scheduler(num_blocks=16, budget=64, max_seqs=8, max_len=128, policy="fcfs", chunked=True, caching=True):
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len,
        policy=policy, enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_prefix_caching=caching))


def fake_run(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput(tokens={sid: [token] for e in out.scheduled for sid in e.sample_ids})


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, fake_run(out, token))
    return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {e.request_id: e.num_tokens for e in out.scheduled}


def test_running_first_then_waiting_within_budget_and_chunking():
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 9))
    out = s.schedule()
    assert plan(out) == {"a": 6, "b": 4}  # b is chunked to the 4 tokens left
    assert [e.sample_ids for e in out.scheduled] == [["a"], []]  # b's chunk does not sample
    s.update(out, fake_run(out))
    out = s.schedule()
    assert plan(out) == {"a": 1, "b": 5}  # a decodes, b finishes its prompt
    assert out.scheduled[1].start_pos == 4


def test_no_chunking_admits_only_whole_prompts():
    s = make_scheduler(num_blocks=64, budget=128, chunked=False)
    s.add_request(make_request("a", 100))
    s.add_request(make_request("b", 40))
    assert plan(s.schedule()) == {"a": 100}


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_seqs=2)
    for r in "abc":
        s.add_request(make_request(r, 3))
    assert set(plan(s.schedule())) == {"a", "b"}


def test_finishes_at_max_tokens_and_frees_blocks():
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=2))
    step(s)
    assert s.requests["a"].num_output_tokens == 1
    step(s)
    assert "a" not in s.requests and s.kv_cache.num_free_blocks == 16
    out = s.schedule()
    assert out.finished_request_ids == ["a"]


def test_eos_stops_unless_ignored_and_respects_min_tokens():
    s = make_scheduler()
    r = make_request("a", 3, max_tokens=5)
    r.sampling_params = type(r.sampling_params)(temperature=0, max_tokens=5, min_tokens=2)
    r.eos_token_ids = (7,)
    s.add_request(r)
    step(s, token=7)
    assert r.status is RequestStatus.RUNNING  # min_tokens=2 not reached
    step(s, token=7)
    assert r.finish_reason is FinishReason.STOP


def test_preempts_most_recent_and_oldest_progresses():
    # 4 blocks of 4 tokens. Two requests of 7 prompt tokens, each wants to grow to 16.
    s = make_scheduler(num_blocks=4, budget=64)
    a = make_request("a", 7, max_tokens=9)
    b = make_request("b", 7, max_tokens=9)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both admitted: 2 blocks each
    assert s.kv_cache.num_free_blocks == 0
    step(s)  # position 7 still fits in the second block
    out = step(s)  # position 8 needs a third block each -> b, the newest, is preempted for a
    assert out.preempted_request_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b and s.preemption.num_preemptions == 1
    while a.status is not RequestStatus.FINISHED:
        step(s)
    assert a.num_output_tokens == 9
    while b.status is not RequestStatus.FINISHED:
        step(s)
    assert b.num_output_tokens == 9 and b.num_preemptions >= 1
    assert s.kv_cache.num_free_blocks == 4


def test_preempted_request_resumes_from_its_cached_prefix():
    s = make_scheduler(num_blocks=4, budget=64)
    a = make_request("a", list(range(7)), max_tokens=5)
    b = make_request("b", list(range(50, 57)), max_tokens=9)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    step(s)  # b preempted; its full block 0 stays cached
    assert b.status is RequestStatus.PREEMPTED
    while a.status is not RequestStatus.FINISHED:
        step(s)
    out = s.schedule()
    (entry,) = out.scheduled
    assert entry.request_id == "b" and entry.start_pos == 4  # block 0 hit from its own prefix
    # b had computed 8 tokens (its prompt and one output); 4 came back as a hit, 4 are computed again
    assert s.stats().preemption.num_recomputed_tokens == 4


def test_tokens_recomputed_after_a_preemption_are_counted_once_each_time():
    s = make_scheduler(num_blocks=4, budget=64, caching=False)
    a = make_request("a", 7, max_tokens=9)
    b = make_request("b", 7, max_tokens=9)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        step(s)  # b preempted after computing 8 tokens; nothing cached
    assert b.status is RequestStatus.PREEMPTED and s.stats().preemption.num_recomputed_tokens == 0
    while b.status is not RequestStatus.FINISHED:
        step(s)
    assert b.num_preemptions == 1 and s.stats().preemption.num_recomputed_tokens == 8


def test_priority_policy_preempts_lowest_priority():
    s = make_scheduler(num_blocks=4, policy="priority")
    lo = make_request("lo", 7, max_tokens=9, priority=5, arrival=0.0)
    hi = make_request("hi", 7, max_tokens=9, priority=0, arrival=1.0)
    s.add_request(lo)
    s.add_request(hi)
    out = s.schedule()
    assert [e.request_id for e in out.scheduled] == ["hi", "lo"]
    s.update(out, fake_run(out))
    step(s)
    out = step(s)
    assert out.preempted_request_ids == ["lo"]


def test_refuses_request_that_can_never_fit():
    s = make_scheduler(num_blocks=4, max_len=64)
    with pytest.raises(RequestRefused, match="max_model_len"):
        s.add_request(make_request("long", 64))
    with pytest.raises(RequestRefused, match=r"max_tokens \(10\).*exceeds max_model_len \(64\)"):
        s.add_request(make_request("x", 60, max_tokens=10))
    with pytest.raises(RequestRefused, match="whole KV cache has 4 blocks"):
        s.add_request(make_request("big", 10, max_tokens=10))
    assert not s.has_unfinished_requests()


def test_abort_frees_blocks_at_once_running_or_waiting():
    s = make_scheduler(num_blocks=8, max_seqs=1)
    s.add_request(make_request("a", 9))
    s.add_request(make_request("b", 5))
    step(s)
    assert s.kv_cache.num_free_blocks == 5
    s.finish_requests(["a", "b"], FinishReason.ABORT)
    assert s.kv_cache.num_free_blocks == 8 and not s.has_unfinished_requests()


def test_n_greater_than_one_forks_after_prompt_sharing_blocks():
    s = make_scheduler(num_blocks=8)
    s.add_request(make_request("p", 6, max_tokens=3, n=3))
    out = s.schedule()
    assert out.scheduled[0].sample_ids == ["p#0", "p#1", "p#2"]
    changed = s.update(out, ModelRunnerOutput(tokens={"p#0": [1], "p#1": [2], "p#2": [3]}))
    assert [r.request_id for r in changed] == ["p#0", "p#1", "p#2"]
    assert [r.output_token_ids for r in changed] == [[1], [2], [3]]
    tables = [s.kv_cache.block_tables(r.request_id)[0] for r in changed]
    assert tables[0] == tables[1] == tables[2]
    assert s.kv_cache.pool.blocks[tables[0][0]].ref_cnt == 3
    out = s.schedule()
    # the shared partial block is copied for the first two writers; the last writes in place
    assert len(out.copies) == 2
    assert s.kv_cache.pool.blocks[tables[0][0]].ref_cnt == 3  # the full block stays shared


def test_blocks_become_shareable_only_after_the_step_that_computes_them():
    # Before the fix, full blocks were hashed when allocated; a request preempted later in the same
    # schedule() left hashes on blocks whose KV was never written, and a later hit read garbage.
    s = make_scheduler(num_blocks=16, budget=8)
    a = make_request("a", list(range(100, 112)), max_tokens=4)
    s.add_request(a)
    out = s.schedule()  # chunk of 8 tokens: blocks 0 and 1 full, not yet computed
    assert plan(out) == {"a": 8}
    assert s.kv_cache.pool.cached == {}
    twin = make_request("twin", list(range(100, 112)), max_tokens=4)
    assert s.kv_cache.get_computed_blocks(twin).num_blocks == 0
    s.update(out, fake_run(out))  # the forward ran: now both blocks may be shared
    assert s.kv_cache.get_computed_blocks(twin).num_blocks == 2



def test_n_counts_against_max_num_seqs_and_is_refused_past_it():
    s = make_scheduler(num_blocks=32, max_seqs=4)
    with pytest.raises(RequestRefused, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        s.add_request(make_request("big", 3, n=5))
    s.add_request(make_request("p", 3, n=3))
    s.add_request(make_request("q", 3, n=2))  # 3 + 2 > 4: waits until p's sequences end
    step(s)
    assert len(s.running) == 3 and len(s.waiting) == 1
    for _ in range(20):
        assert len(s.running) <= 4
        if not s.has_unfinished_requests():
            break
        step(s)
    assert not s.has_unfinished_requests()


def test_aborting_waiting_requests_is_lazy_but_exact():
    for policy in ("fcfs", "priority"):
        s = make_scheduler(num_blocks=64, max_seqs=1, policy=policy)
        for i in range(300):
            s.add_request(make_request(f"r{i}", 3, arrival=float(i)))
        step(s)  # r0 runs; 299 wait
        s.finish_requests([f"r{i}" for i in range(1, 300) if i % 3], FinishReason.ABORT)
        live = [f"r{i}" for i in range(3, 300, 3)]
        assert len(s.waiting) == len(live) and [r.request_id for r in s.waiting] == live
        assert len(s.waiting._dead) <= len(live) + 64  # compacted, memory stays O(live)
        s.finish_requests(["r0"], FinishReason.ABORT)
        assert [e.request_id for e in s.schedule().scheduled] == ["r3"]
        assert sorted(s.sequences_of("r3")) == ["r3"] and s.sequences_of("r1") == []


def tier_run(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A runner whose tier writes and reads all succeed."""
    return ModelRunnerOutput(tokens={sid: [token] for e in out.scheduled for sid in e.sample_ids},
                             tier_stored=[(t.slot, True) for t in out.tier_stores],
                             tier_loaded={t.block_id: True for t in out.tier_loads},
                             tier_read_seconds=0.001 * bool(out.tier_loads))


def scheduler_with_history_in_the_tier(history: list[int], windows: tuple = (None,)) -> Scheduler:
    """A pool of 16 blocks per KV group whose tier holds `history`'s blocks (pushed out of the
    pool by another prompt), every write committed."""
    from octavo.kv_cache.tier import TierIndex
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)
    s = Scheduler(cfg, KVCacheManager(16 * len(windows), BS, tier=TierIndex(64), group_windows=windows))
    for i, prompt in enumerate([history, list(range(2000, 2060))]):  # the second pushes the first out
        s.add_request(make_request(f"fill{i}", prompt, max_tokens=1))
        while s.has_unfinished_requests():
            s.update(out := s.schedule(), tier_run(out))
    s.update(out := s.schedule(), tier_run(out))  # commits the last writes
    return s


@pytest.mark.parametrize("windows", [(None,), (None, 8, 8, 8, 8, 8)], ids=["one-group", "gemma-layout"])
def test_a_history_in_the_tier_loads_and_its_new_tokens_compute_in_the_same_step(windows):
    """The loads are read before the forward, which computes the request's new tokens after them:
    a returning conversation pays no step for its history. Sliding-window groups (Gemma 3's
    layout) load ahead alike, only the blocks their windows read."""
    history = list(range(1000, 1032))  # eight blocks
    s = scheduler_with_history_in_the_tier(history, windows)
    turn = make_request("turn", history + list(range(5, 13)), max_tokens=2)
    s.add_request(turn)
    out = s.schedule()
    loaded_entries = {t.key[1] for t in out.tier_loads}
    assert len(loaded_entries) >= 7 and plan(out) == {"turn": 8}  # (the fill left its first block)
    assert {t.block_id for t in out.tier_loads} <= {b for table in out.scheduled[0].block_tables for b in table}
    assert len(out.tier_loads) == len(loaded_entries) + 2 * (len(windows) - 1)  # each window: its last 2 blocks
    s.update(out, tier_run(out))
    assert turn.output_token_ids == [7] and turn.num_cached_tokens == 32 and turn.tier_load_wait > 0
    while s.has_unfinished_requests():
        s.update(out := s.schedule(), tier_run(out))
    assert s.stats().prefix.num_tier_hits_tokens == BS * len(loaded_entries) and s.kv_cache.view().check_invariants() == []
    assert s.kv_cache.num_free_blocks == 16 * len(windows)


def test_a_bad_load_voids_the_chunk_computed_after_it_and_the_request_computes_from_the_bad_block():
    history = list(range(1000, 1032))  # eight blocks
    s = scheduler_with_history_in_the_tier(history)
    turn = make_request("turn", history + list(range(5, 13)), max_tokens=2)
    s.add_request(turn)
    out = s.schedule()
    assert plan(out) == {"turn": 8}
    bad = out.tier_loads[-3].block_id
    idx = out.scheduled[0].block_tables[0].index(bad)
    result = tier_run(out)
    result.tier_loaded[bad] = False
    del result.tokens["turn"]  # the runner leaves out a request whose load failed, and says so
    result.left_out = ["turn"]
    s.update(out, result)
    assert turn.num_computed_tokens == idx * BS and not turn.output_token_ids  # rolled back to the bad block
    out = s.schedule()
    assert plan(out) == {"turn": 40 - idx * BS} and not out.tier_loads  # the bad block left the tier: computed
    assert out.scheduled[0].start_pos == idx * BS
    s.update(out, tier_run(out))
    assert turn.output_token_ids == [7] and turn.num_cached_tokens == idx * BS
    while s.has_unfinished_requests():
        s.update(out := s.schedule(), tier_run(out))
    assert s.kv_cache.view().check_invariants() == [] and s.kv_cache.num_free_blocks == 16


def test_a_history_in_the_tier_too_big_to_load_at_once_starts_beside_running_requests_and_loads_as_it_runs():
    """Its loads and first chunk do not fit beside a running request: rather than waiting for that
    request to end, it is admitted with what fits and loads the rest while running (as a
    recomputed prompt grows chunk by chunk), computing only its new tokens."""
    history = list(range(1000, 1040))  # ten blocks
    s = scheduler_with_history_in_the_tier(history)
    runner = make_request("runner", list(range(3000, 3017)), max_tokens=30)
    s.add_request(runner)
    s.update(out := s.schedule(), tier_run(out))
    turn = make_request("turn", history + [5], max_tokens=1)
    s.add_request(turn)
    computed = 0
    while turn.status is not RequestStatus.FINISHED:
        out = s.schedule()
        assert runner.request_id in plan(out)  # the running request is never held up
        computed += plan(out).get("turn", 0)
        s.update(out, tier_run(out))
    assert runner.status is RequestStatus.RUNNING  # it did not wait for the runner to end
    assert computed == 1 and turn.num_cached_tokens == 40  # its history came from the tier
    assert turn.tier_load_wait > 0
    assert s.stats().prefix.num_tier_hits_tokens == 40 and s.kv_cache.view().check_invariants() == []


def test_a_long_prompt_that_fits_a_window_pool_in_smaller_chunks_is_admitted_and_chunked_so():
    """Gemma-like groups (one global, five sliding of 8 tokens): computed in chunks of the step's
    64 tokens, a 60-token prompt holds 96 blocks of 4 (each window group takes a chunk's blocks
    beside its window's); in chunks of 13 it holds 16 + 5 x 5 = 41, so a pool of 50 admits it and
    every step computes at most 13 of its tokens. One that fits in no chunk size is refused."""
    windows = (None, 8, 8, 8, 8, 8)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, admission_headroom_steps=0)
    s = Scheduler(cfg, KVCacheManager(50, BS, group_windows=windows))
    s.add_request(make_request("long", 60, max_tokens=4))
    assert s.requests["long"].max_chunk_tokens == 13
    chunks = []
    for _ in range(20):
        out = step(s)
        chunks += [e.num_tokens for e in out.scheduled]
        assert s.kv_cache.num_free_blocks >= 0
        if not s.has_unfinished_requests():
            break
    assert max(chunks) == 13 and sum(chunks) == 60 + 3  # the prompt in chunks, then 3 decodes
    with pytest.raises(RequestRefused, match="184 tokens = 61 KV blocks of 4"):  # 46 global + 5 x 3 even in chunks of 1
        s.add_request(make_request("longer", 180, max_tokens=4))


# ---- embedding requests -----------------------------------------------------------------------------


def embedding_request(rid, num_tokens, pooling="last"):
    import dataclasses

    from octavo.sampling.params import PoolingParams

    r = make_request(rid, num_tokens, max_tokens=1)
    r.sampling_params = dataclasses.replace(r.sampling_params, pooling=PoolingParams(pooling))
    return r


def pooled_run(out: SchedulerOutput) -> ModelRunnerOutput:
    """The runner's pooled chunks, as if position p's final state were [p, 1]."""
    from octavo.outputs import PooledChunk

    result = fake_run(out)
    for e in out.scheduled:
        pooling = e.sampling_params.pooling
        if pooling is not None:
            positions = range(e.start_pos, e.start_pos + e.num_tokens)
            if pooling.pooling_type == "mean":
                result.pooled[e.request_id] = PooledChunk(e.start_pos, e.num_tokens, [float(sum(positions)), float(len(positions))])
            elif pooling.pooling_type == "last" and positions[-1] == len(e.prompt_token_ids) - 1:
                result.pooled[e.request_id] = PooledChunk(e.start_pos, e.num_tokens, [float(positions[-1]), 1.0])
    return result


def test_embeddings_take_a_share_of_the_step_beside_generation_and_the_whole_step_alone():
    s = make_scheduler(num_blocks=256, budget=64, max_seqs=16, max_len=256)
    s.add_request(embedding_request("e0", 40))
    out = s.schedule()
    assert plan(out) == {"e0": 40}  # nothing generates: the whole prompt at once
    s.update(out, pooled_run(out))
    assert s.requests == {} and s.schedule().finished_request_ids == ["e0"]
    for i in range(6):
        s.add_request(make_request(f"g{i}", 3, max_tokens=50))
    s.add_request(embedding_request("e1", 40, "mean"))
    s.add_request(make_request("late", 3, max_tokens=50))  # behind the embedding in the queue
    out = s.schedule()
    # generation is held: the embedding gets max(1, ceil(0.35 x 0 running)) = 1 token, and the
    # generation request behind it in the queue is admitted all the same
    assert plan(out)["e1"] == 1 and "late" in plan(out)
    s.update(out, pooled_run(out))
    chunks = []
    while "e1" in s.requests:
        out = s.schedule()
        chunks.append(plan(out).get("e1", 0))
        assert chunks[-1] <= 3  # ceil(0.35 x 7 generating)
        s.update(out, pooled_run(out))
    assert sum(chunks) + 1 == 40 and len(s.requests) == 7


def test_a_finished_embedding_is_its_pooled_prompt():
    import math

    s = make_scheduler(budget=8)
    r = embedding_request("e", 20, "mean")
    s.add_request(r)
    while "e" in s.requests:
        out = s.schedule()
        assert all(not e.sample_ids for e in out.scheduled)  # nothing is sampled for it
        s.update(out, pooled_run(out))
    mean = [sum(range(20)) / 20, 1.0]  # over chunks of 8, 8 and 4 positions
    norm = math.hypot(*mean)
    assert r.embedding == pytest.approx([v / norm for v in mean])
    assert r.finish_reason is FinishReason.STOP and r.output_token_ids == []
