"""Property-based: random add / step / abort sequences keep the KV-cache invariants.

Every block is free (in the free queue, ref 0) or held; a block's ref count equals the number of
block tables holding it; each running request's table covers its computed tokens; and once every
request has ended, every block is free again. A shadow KV cache records which token each slot was
written with (the forward's writes, copy-on-write copies included): every context a scheduled
request attends to must hold exactly its own tokens, so a prefix hit on a block whose KV was never
written (a stale hash) fails here. The same holds with several KV groups (global and
sliding-window ones, as Gemma 3 pages its layers): each group's table is checked for the keys its
window reads, so a window that gave back a block it still needs fails too.
"""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput
from octavo.request import FinishReason, RequestStatus, TokenLogprob
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
        st.tuples(
            st.just("beam"),
            st.integers(1, 30),  # prompt length
            st.integers(1, 10),  # max tokens
            st.integers(0, 3),  # which of 4 shared prefixes
            st.integers(1, 4),  # beam width
        ),
        st.tuples(st.just("step"), st.integers(0, 1000)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
    ),
    max_size=60,
)


class ShadowKV:
    """slot -> the token id last written there; what a real forward would have left in the pool."""

    def __init__(self, windows: tuple[int | None, ...] = (None,)) -> None:
        self.slots: dict[tuple[int, int], int] = {}
        self.windows = windows

    def run(self, s: Scheduler, out) -> None:
        """Check every scheduled request's context in every group (the keys its window reads),
        then write its new tokens (as the runner does)."""
        for src, dst in out.copies:
            for offset in range(BS):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
                else:
                    self.slots.pop((dst, offset), None)
        for e in out.scheduled:
            tokens = s.requests[e.request_id].all_token_ids
            assert len(e.block_tables) == len(self.windows)
            for table, window in zip(e.block_tables, self.windows):
                first = 0 if window is None else max(0, e.start_pos - window + 1)
                for pos in range(first, e.start_pos):
                    slot = (table[pos // BS], pos % BS)
                    assert self.slots.get(slot) == tokens[pos], f"{e.request_id} reads unwritten or foreign KV at {pos}"
                for pos, token in zip(range(e.start_pos, e.start_pos + e.num_tokens), e.token_ids):
                    self.slots[(table[pos // BS], pos % BS)] = token


def fake_model(s: Scheduler, out, seed: int) -> ModelRunnerOutput:
    """Token `seed` for every sampled sequence; for a beam, 2 x width candidates with logprobs
    that vary with the seed and the beam, so beams fork, drop and (token 3 is EOS) finish."""
    sampled, logprobs = {}, {}
    for e in out.scheduled:
        for sid in e.sample_ids:
            sampled[sid] = seed % 50
            beam = s.requests[e.request_id].beam
            if beam is not None:
                k = 2 * beam.width
                rng = random.Random(hash((seed, sid, len(s.requests[sid].all_token_ids))))
                top = {t: -rng.random() * 3 for t in rng.sample(range(8), min(k, 8))}
                logprobs[sid] = TokenLogprob(max(top, key=top.get), max(top.values()), top)
    return ModelRunnerOutput(sampled=sampled, logprobs=logprobs)


def check_invariants(s: Scheduler) -> None:
    kv = s.kv_cache
    assert kv.check_invariants() == []
    holders = Counter()
    for rid in s.requests:
        holders.update(kv.held_blocks(rid))
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
    for req in s.running:
        assert req.status is RequestStatus.RUNNING
        assert len(kv.block_ids(req.request_id)) * BS >= req.num_computed_tokens
    for req in s.waiting:
        assert kv.block_ids(req.request_id) == []


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 24), budget=st.sampled_from([4, 16, 64]), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]),
       windows=st.sampled_from([(None,), (None,), (None, 6), (5,), (None, 9, 4)]))
def test_random_operations_keep_invariants(ops, num_blocks, budget, caching, policy, windows):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=64, policy=policy)
    s = Scheduler(cfg, KVCacheManager(num_blocks * len(windows), BS, enable_prefix_caching=caching, group_windows=windows))
    num_blocks *= len(windows)
    prefixes = [[7] * 8, [8] * 8, list(range(8)), [9] * 3]
    shadow = ShadowKV(windows)
    ids = []
    for i, op in enumerate(ops):
        if op[0] in ("add", "beam"):
            _, length, max_tokens, prefix, n = op
            prompt = (prefixes[prefix] + list(range(100 + i, 100 + i + length)))[:length + 4]
            req = make_request(f"r{i}", prompt, max_tokens=max_tokens, priority=i % 3, arrival=float(i),
                               **(dict(n=n) if op[0] == "add" else dict(beam_width=n, eos=(3,))))
            try:
                s.add_request(req)
                ids.append(req.request_id)
            except RequestRefused:
                pass
        elif op[0] == "step":
            out = s.schedule()
            shadow.run(s, out)
            s.update(out, fake_model(s, out, op[1]))
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
        assert out.scheduled, f"nothing scheduled while requests wait: livelock; running {[(r.request_id, r.num_computed_tokens, r.num_tokens, r.beam and sorted(r.beam.running), r.beam and sorted(r.beam.candidates)) for r in s.running]}, waiting {[r.request_id for r in s.waiting]}, {ops}"
        shadow.run(s, out)
        s.update(out, fake_model(s, out, 1))
        check_invariants(s)
    assert not s.has_unfinished_requests()
    assert s.kv_cache.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv_cache.pool.blocks)
