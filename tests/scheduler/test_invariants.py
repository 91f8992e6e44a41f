"""Property-based: random add / step / abort sequences keep the KV-cache invariants.

Every block is free (in the free queue, ref 0) or held; a block's ref count equals the number of
block tables holding it; each running request's table covers its computed tokens; and once every
request has ended, every block is free again. A shadow KV cache records which token each slot was
written with (the forward's writes, copy-on-write copies included): every context a scheduled
request attends to must hold exactly its own tokens, so a prefix hit on a block whose KV was never
written (a stale hash) fails here. The same holds with several KV groups (global and
sliding-window ones, as Gemma 3 pages its layers): each group's table is checked for the keys its
window reads, so a window that gave back a block it still needs fails too. With a second KV
tier, the shadow snapshots each evicted block into a shadow disk before anything writes the pool,
reports the writes a step late, and loads blocks back (every third load failing its checksum):
a block served from the tier must hold exactly the request's tokens too, the tier never exceeds
its slots, and no block is lost.
"""

import random
from collections import Counter

import pytest

from hypothesis import example, given, settings
from hypothesis import strategies as st

from octavo.config import SchedulerConfig, SpeculativeConfig
from octavo.kv_cache.events import BlockStored, apply_events
from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.prefix_cache import hash_block_tokens
from octavo.kv_cache.tier import TierIndex
from octavo.outputs import ModelRunnerOutput
from octavo.request import FinishReason, RequestStatus, TokenLogprob
from octavo.limits import RequestRefused
from octavo.scheduler import Scheduler
from octavo.spec_decode import SpecDecodeController, make_proposer
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
        st.tuples(st.just("pin"), st.integers(1, 30), st.integers(1, 2), st.integers(0, 3), st.just(1)),
    ),
    max_size=60,
)


class ShadowKV:
    """slot -> the token id last written there; what a real forward would have left in the pool."""

    def __init__(self, windows: tuple[int | None, ...] = (None,)) -> None:
        self.slots: dict[tuple[int, int], int] = {}
        self.windows = windows
        self.disk: dict[int, dict[int, int]] = {}  # tier slot -> offset -> token
        self.pending_stores: list[int] = []
        self.num_loads = 0
        self.skipped: list[tuple[str, int]] = []

    def run(self, s: Scheduler, out) -> dict:
        """Load the tier's blocks (as the runner does: before the forward), leave out the requests
        that read a block whose load failed, check every other scheduled request's context in
        every group (the keys its window reads), then write its new tokens. Returns the tier's
        reports; `self.skipped` holds (request id, chunk start) of the requests left out."""
        held = Counter(b for rid in s.requests for b in s.kv_cache.view().held_blocks(rid))
        for t in out.tier_stores:  # copied out before anything writes the pool (it may be reused at once)
            self.disk[t.slot] = {o: self.slots[(t.block_id, o)] for o in range(BS) if (t.block_id, o) in self.slots}
        stored, self.pending_stores = [(slot, True) for slot in self.pending_stores], [t.slot for t in out.tier_stores]
        loaded = {}
        for t in out.tier_loads:
            # only the loading request's own table may hold it (a running request loading ahead)
            holders = [rid for rid in s.requests if t.block_id in s.kv_cache.view().held_blocks(rid)]
            assert held[t.block_id] <= 1 and set(holders) <= {t.request_id}, "a tier load writes a block another request holds"
            self.num_loads += 1
            loaded[t.block_id] = self.num_loads % 3 != 0  # every third load fails its checksum
            for o in range(BS):
                self.slots[(t.block_id, o)] = self.disk[t.slot][o] if loaded[t.block_id] else -1  # -1: garbage
        # as the runner does: a load names the one request whose table the block joins; those of
        # this step's requests whose load failed are left out (and a bad block is in no other table)
        left_out = {t.request_id for t in out.tier_loads if not loaded[t.block_id]} & {e.request_id for e in out.scheduled}
        self.skipped = [(e.request_id, e.start_pos) for e in out.scheduled if e.request_id in left_out]
        for src, dst in out.copies:
            for offset in range(BS):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
                else:
                    self.slots.pop((dst, offset), None)
        for e in out.scheduled:
            if e.request_id in left_out:
                continue
            tokens = s.requests[e.request_id].all_token_ids
            assert len(e.block_tables) == len(self.windows)
            for table, window in zip(e.block_tables, self.windows):
                first = 0 if window is None else max(0, e.start_pos - window + 1)
                for pos in range(first, e.start_pos):
                    slot = (table[pos // BS], pos % BS)
                    assert self.slots.get(slot) == tokens[pos], f"{e.request_id} reads unwritten or foreign KV at {pos}"
                for pos, token in zip(range(e.start_pos, e.start_pos + e.num_tokens), e.token_ids):
                    self.slots[(table[pos // BS], pos % BS)] = token
        return {"tier_stored": stored, "tier_loaded": loaded, "left_out": sorted(left_out)}

    def check_rolled_back(self, s: Scheduler) -> None:
        """A request left out of the step has not advanced past the chunk it did not compute."""
        for rid, start in self.skipped:
            request = s.requests.get(rid)
            assert request is None or request.num_computed_tokens <= start, f"{rid} kept a chunk it never computed"


def fake_model(s: Scheduler, out, seed: int, tier_reports: dict | None = None) -> ModelRunnerOutput:
    """Token `seed` for every sampled sequence; for a beam, 2 x width candidates with logprobs
    that vary with the seed and the beam, so beams fork, drop and (token 3 is EOS) finish. A
    sequence verifying drafts keeps a number of them that varies with the seed, then one token
    that differs from the next draft."""
    sampled, logprobs = {}, {}
    for e in out.scheduled:
        for row in e.samples:
            sid = row.seq_id
            sampled[sid] = [seed % 50]
            drafts = row.draft_token_ids
            if drafts:
                num_kept = random.Random(f"{seed}/{sid}/{len(drafts)}").randint(0, len(drafts))
                tokens = drafts[:num_kept] + [drafts[num_kept] + 1 if num_kept < len(drafts) else seed % 50]
                sampled[sid] = tokens
            beam = s.requests[e.request_id].beam
            if beam is not None:
                k = 2 * beam.width
                rng = random.Random(f"{seed}/{sid}/{len(s.requests[sid].all_token_ids)}")  # not hash(): salted per process
                top = {t: -rng.random() * 3 for t in rng.sample(range(8), min(k, 8))}
                logprobs[sid] = [TokenLogprob(max(top, key=top.get), max(top.values()), top)]
    return ModelRunnerOutput(tokens=sampled, logprobs=logprobs, **(tier_reports or {}))


def spec_step(s: Scheduler, drafter: SpecDecodeController | None, seed: int, shadow: ShadowKV) -> None:
    """One step as the engine runs it: drafts (speculative decoding), schedule, the fake model."""
    out = s.schedule(drafter.propose(s.running) if drafter else None)
    finish_step(s, drafter, out, fake_model(s, out, seed, shadow.run(s, out)))


def finish_step(s: Scheduler, drafter: SpecDecodeController | None, out, result: ModelRunnerOutput) -> None:
    changed = s.update(out, result)
    if drafter is not None:
        drafter.observe(out, result)
        drafter.finish([r for r in changed if r.status is RequestStatus.FINISHED])


def check_invariants(s: Scheduler, events_index: set | None = None) -> None:
    kv = s.kv_cache
    assert kv.view().check_invariants() == []
    if events_index is not None:
        check_events(kv, events_index)
    holders = Counter(kv.view().held_by_others())
    for rid in s.requests:
        holders.update(kv.view().held_blocks(rid))
    if kv.tier is not None:
        assert len(kv.tier) <= kv.tier.num_slots
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
    for req in s.running:
        assert req.status is RequestStatus.RUNNING
        assert len(kv.block_tables(req.request_id)[0]) * BS >= req.num_computed_tokens
    for req in s.waiting:
        assert kv.block_tables(req.request_id) == []


def check_events(kv: KVCacheManager, index: set) -> None:
    """The KV events since the last call, applied to `index` as a subscriber would, leave it
    holding the pool's hash map and the tier's ready entries; each stored block whose tokens are
    given hashes to what it claims from its parent, tokens and extra keys."""
    events = kv.events.drain()
    for e in events:
        if isinstance(e, BlockStored) and e.token_ids:
            parent = e.parent_hash
            for i, h in enumerate(e.block_hashes):
                extra = e.extra_keys[i] if e.extra_keys else None
                assert hash_block_tokens(parent, e.token_ids[i * BS:(i + 1) * BS], extra) == h, e
                parent = h
    apply_events(index, events)
    want = {("GPU", g, h) for g, h in kv.pool.cached}
    if kv.tier is not None:
        want |= {("DISK", g, h) for g, h in kv.tier.ready_keys()}
    assert index == want, (sorted(index - want)[:3], sorted(want - index)[:3])


# a single sliding-window group once took the loads-ahead path meant for one global group (tables
# with dropped entries): found by a 24,000-example run
@example(ops=[("add", 1, 1, 0, 1), ("add", 1, 1, 0, 1), ("add", 3, 4, 1, 3), ("add", 12, 2, 0, 1), ("add", 1, 1, 0, 1),
              ("abort", 0)], num_blocks=8, budget=16, caching=True, policy="fcfs", windows=(5,), tier_slots=3,
         victim="newest", max_wait=128, headroom=0, spec=None)
# a failed load into block 0 left out every request whose sliding-window table showed block 0 for
# blocks given back, and the scheduler advanced them (found by a 6,000-example run)
@example(ops=[("add", 18, 7, 0, 2), ("step", 0), ("step", 0), ("add", 1, 8, 2, 1), ("pin", 1, 1, 0, 1), ("add", 1, 1, 0, 1),
              ("step", 0), ("step", 0), ("step", 0), ("beam", 11, 7, 1, 4), ("add", 1, 1, 0, 1), ("pin", 1, 1, 0, 1),
              ("add", 25, 4, 3, 3), ("step", 0), ("step", 0), ("add", 5, 1, 1, 1)],
         num_blocks=16, budget=4, caching=True, policy="priority", windows=(5,), tier_slots=40, victim="cheapest",
         max_wait=2, headroom=0, spec=None)
# a pin with an output pinned its output's block too, one more than counted when requests were sized
@example(ops=[("add", 1, 1, 0, 1), ("add", 1, 1, 0, 1), ("pin", 3, 2, 1, 1), ("add", 1, 1, 0, 1), ("add", 1, 1, 0, 1),
              ("add", 10, 12, 0, 1)],
         num_blocks=8, budget=4, caching=True, policy="fcfs", windows=(None,), tier_slots=None, victim="cheapest",
         max_wait=2, headroom=0, spec=None)
# a request added while a pin was still computing was sized without the blocks the pin then held:
# it never fitted (found by a 6,000-example run)
@example(ops=[("add", 1, 1, 0, 1), ("add", 1, 1, 0, 1), ("add", 1, 1, 0, 1), ("pin", 1, 1, 1, 1), ("add", 14, 12, 0, 1)],
         num_blocks=8, budget=4, caching=True, policy="fcfs", windows=(None,), tier_slots=None, victim="cheapest",
         max_wait=2, headroom=0, spec=None)
# a preempted beam search whose beams fit only in chunks smaller than the budget was sized for
# budget-sized chunks, and its forked beam recomputed in them: it never fitted again (livelock)
@example(ops=[("add", 1, 1, 0, 1), ("beam", 12, 2, 0, 2), ("add", 9, 1, 0, 1)], num_blocks=8, budget=4, caching=False,
         policy="fcfs", windows=(None, 6), tier_slots=None, victim="newest", max_wait=2, headroom=0, spec=None)
@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 24), budget=st.sampled_from([4, 16, 64]), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority", "cache-aware"]), victim=st.sampled_from(["cheapest", "newest"]),
       max_wait=st.sampled_from([2, 128]), headroom=st.sampled_from([0, 4, 64]),
       windows=st.sampled_from([(None,), (None,), (None, 6), (5,), (None, 9, 4)]),
       tier_slots=st.sampled_from([None, None, 3, 40]), spec=st.sampled_from([None, None, "ngram", "suffix"]))
def test_random_operations_keep_invariants(ops, num_blocks, budget, caching, policy, windows, tier_slots, victim, max_wait,
                                           headroom, spec):
    speculative = SpeculativeConfig(spec, num_speculative_tokens=3, prompt_lookup_min=1, max_batch=6) if spec else None
    drafter = SpecDecodeController(speculative, 64, budget, make_proposer(speculative)) if spec else None
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=64, policy=policy,
                          preemption_victim=victim, max_wait_steps=max_wait, admission_headroom_steps=headroom,
                          speculative=speculative)
    tier = TierIndex(tier_slots) if tier_slots and caching else None
    s = Scheduler(cfg, KVCacheManager(num_blocks * len(windows), BS, enable_prefix_caching=caching, group_windows=windows,
                                      tier=tier))
    num_blocks *= len(windows)
    s.kv_cache.pins.max_blocks = num_blocks // 4
    s.kv_cache.enable_events()
    events_index: set = set()
    prefixes = [[7] * 8, [8] * 8, list(range(8)), [9] * 3]
    shadow = ShadowKV(windows)
    ids = []
    for i, op in enumerate(ops):
        if op[0] in ("add", "beam", "pin"):
            _, length, max_tokens, prefix, n = op
            prompt = (prefixes[prefix] + list(range(100 + i, 100 + i + length)))[:length + 4]
            req = make_request(f"r{i}", prompt, max_tokens=max_tokens, priority=i % 3, arrival=float(i),
                               **(dict(n=n) if op[0] != "beam" else dict(beam_width=n, eos=(3,))))
            req.pin = op[0] == "pin"  # its blocks stay pinned when it ends (a pinned prefix)
            try:
                s.add_request(req)
                ids.append(req.request_id)
            except RequestRefused:
                pass
        elif op[0] == "step":
            spec_step(s, drafter, op[1], shadow)
            shadow.check_rolled_back(s)
        else:
            live = sorted(s.requests)
            if live:
                s.finish_requests([live[op[1] % len(live)]], FinishReason.ABORT)
        check_invariants(s, events_index)
    # drain: the oldest always progresses, so everything finishes (no livelock)
    idle = False
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule(drafter.propose(s.running) if drafter else None)
        # one step may be idle (a request whose next blocks load from the tier takes them before
        # computing on); two in a row would be a livelock
        idle, was_idle = not (out.scheduled or out.tier_loads), idle
        assert not (idle and was_idle), f"nothing scheduled while requests wait: livelock; running {[(r.request_id, r.num_computed_tokens, r.num_tokens, r.beam and sorted(r.beam.running), r.beam and sorted(r.beam.candidates)) for r in s.running]}, waiting {[r.request_id for r in s.waiting]}, {ops}"
        finish_step(s, drafter, out, fake_model(s, out, 1, shadow.run(s, out)))
        shadow.check_rolled_back(s)
        check_invariants(s, events_index)
    assert not s.has_unfinished_requests()
    assert s.kv_cache.pins.num_blocks <= s.kv_cache.pins.max_blocks
    s.kv_cache.pins.unpin_all()
    assert s.kv_cache.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv_cache.pool.blocks)


@pytest.mark.parametrize("windows", [(None,), (None, 8, 8)], ids=["one-group", "with-windows"])
def test_a_pool_too_small_for_the_shared_prefixes_serves_them_from_the_tier_and_never_wrong_kv(windows):
    """Four 24-token prefixes in a pool of 16 blocks (per KV group): requests keep evicting each
    other's prefixes, which come back through the tier (a third of loads failing their checksum
    and recomputed), in every group alike. Every context read is checked by the shadow (each
    window's keys too); the tier must actually carry the load."""
    rng = random.Random(5)
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, max_model_len=64)
    s = Scheduler(cfg, KVCacheManager(16 * len(windows), BS, tier=TierIndex(40 * len(windows)), group_windows=windows))
    shadow = ShadowKV(windows)
    prefixes = [[10 + p] * 3 + list(range(20 * p, 20 * p + 21)) for p in range(4)]
    for i in range(80):
        prompt = prefixes[rng.randrange(4)] + [200 + i, 300 + i]
        s.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 6)))
        for _ in range(rng.randint(0, 4)):
            out = s.schedule()
            s.update(out, fake_model(s, out, rng.randrange(50), shadow.run(s, out)))
            shadow.check_rolled_back(s)
            check_invariants(s)
    for _ in range(3000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.scheduled or out.tier_loads
        s.update(out, fake_model(s, out, 1, shadow.run(s, out)))
        shadow.check_rolled_back(s)
        check_invariants(s)
    assert not s.has_unfinished_requests()
    stats = s.stats()
    assert stats.tier.num_loaded >= 20 and stats.tier.num_corrupt >= 5, stats
    assert stats.prefix.num_tier_hits_tokens > 0 and stats.prefix.num_hits_tokens >= stats.prefix.num_tier_hits_tokens
    assert s.kv_cache.num_free_blocks == 16 * len(windows) and not s.kv_cache.view().held_by_others()
