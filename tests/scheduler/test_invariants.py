"""Property-based: random add / step / abort sequences keep the KV-cache invariants.

Every block is free (in the free queue, ref 0) or held; a block's ref count equals the number of
block tables holding it; each running request's table covers its computed tokens; and once every
request has ended, every block is free again.
"""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput
from octavo.request import FinishReason, RequestStatus
from octavo.scheduler import RequestRefused, Scheduler
from tests.helpers import make_request

BS = 4

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 30),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(0, 3),  # which of 4 shared prefixes
            st.integers(1, 3),  # n
        ),
        st.tuples(st.just("step"), st.integers(0, 1000)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    max_size=60,
)


def check_invariants(s: Scheduler) -> None:
    kv = s.kv_cache
    pool = kv.pool
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    holders = Counter()
    for rid in s.requests:
        holders.update(kv.block_ids(rid))
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in free_ids)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    for req in s.running:
        assert req.status is RequestStatus.RUNNING
        assert len(kv.block_ids(req.request_id)) * BS >= req.num_computed_tokens
    for req in s.waiting:
        assert kv.block_ids(req.request_id) == []


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 24), budget=st.sampled_from([4, 16, 64]), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_operations_keep_invariants(ops, num_blocks, budget, caching, policy):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=64, policy=policy)
    s = Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_prefix_caching=caching))
    prefixes = [[7] * 8, [8] * 8, list(range(8)), [9] * 3]
    ids = []
    for i, op in enumerate(ops):
        if op[0] == "add":
            _, length, max_tokens, prefix, n = op
            prompt = (prefixes[prefix] + list(range(100 + i, 100 + i + length)))[:length + 4]
            req = make_request(f"r{i}", prompt, max_tokens=max_tokens, n=n, priority=i % 3, arrival=float(i))
            try:
                s.add_request(req)
                ids.append(req.request_id)
            except RequestRefused:
                pass
        elif op[0] == "step":
            out = s.schedule()
            tok = op[1]
            s.update(out, ModelRunnerOutput(sampled={sid: tok for e in out.scheduled for sid in e.sample_ids}))
        else:
            live = sorted(s.requests)
            if live:
                s.finish_requests([live[op[1] % len(live)]], FinishReason.ABORT)
        check_invariants(s)
    # drain: the oldest always progresses, so everything finishes (no livelock)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.scheduled, "nothing scheduled while requests wait: livelock"
        s.update(out, ModelRunnerOutput(sampled={sid: 1 for e in out.scheduled for sid in e.sample_ids}))
        check_invariants(s)
    assert not s.has_unfinished_requests()
    assert s.kv_cache.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv_cache.pool.blocks)
