"""Speculative decoding without a model: the SpecDecodeController drafts (prompt lookup), the
scheduler schedules and rolls back; what a step drafts, what it keeps, and that rejected drafts'
slots are given back and never enter the prefix cache."""

from octavo.config import SchedulerConfig, SpeculativeConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput
from octavo.scheduler import Scheduler
from octavo.request import RequestStatus
from octavo.spec_decode import SpecDecodeController, best_num_drafts, make_proposer
from tests.helpers import make_request

BS = 4
LOOP = [1, 2, 3, 4, 5, 1, 2]  # prompt lookup proposes 3, 4, 5, 1, ... after its last "1, 2"


def make(k=4, budget=64, max_batch=4, num_blocks=32, backoff=16, cost_batch=1e9):
    """A scheduler drafting up to k tokens (with the default cost_batch drafts cost nothing: the
    adaptive length is always k)."""
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k, prompt_lookup_min=2, max_batch=max_batch,
                             max_backoff_steps=backoff, draft_cost_batch=cost_batch)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64, speculative=spec)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS)), SpecDecodeController(spec, 64, budget, make_proposer(spec))


def run(s, spec, keep: dict[str, int] | None = None, token: int = 9):
    """One step as the engine runs it; a request verifying drafts keeps keep[rid] of them (default
    all), then `token` (or token(the last token kept))."""
    out = s.schedule(spec.propose(s.running))
    sampled = {}
    for e in out.scheduled:
        for row in e.samples:
            drafts = row.draft_token_ids
            n = min((keep or {}).get(row.seq_id, len(drafts)), len(drafts))
            last = token(drafts[n - 1] if n else s.requests[row.seq_id].all_token_ids[-1]) if callable(token) else token
            tokens = drafts[:n] + [last if n == len(drafts) or last != drafts[n] else last + 1]
            sampled[row.seq_id] = tokens
    result = ModelRunnerOutput(tokens=sampled)
    changed = s.update(out, result)
    spec.observe(out, result)
    spec.finish([r for r in changed if r.status is RequestStatus.FINISHED])
    return out


def test_a_decoding_request_verifies_its_drafts_and_keeps_those_agreed():
    s, spec = make()
    s.add_request(make_request("a", LOOP[:-1], max_tokens=20))
    run(s, spec, token=2)  # the prompt; it samples 2: now ... 1, 2
    out = run(s, spec)  # decodes with drafts 3, 4, 5, 1 after its last token 2
    (entry,) = out.scheduled
    assert entry.token_ids == [2, 3, 4, 5, 1] and entry.samples[0].draft_token_ids == [3, 4, 5, 1]
    r = s.requests["a"]
    assert r.output_token_ids == [2, 3, 4, 5, 1, 9] and r.num_computed_tokens == r.num_tokens - 1
    st = spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 4)
    assert st.acceptance_counts == [0, 0, 0, 0, 1]


def test_rejected_drafts_give_back_their_blocks_and_are_never_cached():
    s, spec = make(k=4)
    s.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1], max_tokens=20))  # three blocks
    run(s, spec, token=2)  # output 2 at position 12; the drafts will be 3, 4, 5, 6
    before = set(s.kv_cache.pool.cached)
    assert len(before) == 3
    out = run(s, spec, keep={"a": 0}, token=7)
    assert out.scheduled[0].num_tokens == 5  # last token + 4 drafts: positions 12..16, blocks 3 and 4
    r = s.requests["a"]
    assert r.output_token_ids == [2, 7] and r.num_computed_tokens == 13
    assert len(s.kv_cache.block_tables("a")[0]) == 4  # positions 0..13 need four blocks: the fifth went back
    # block 3 (positions 12..15) was filled, with drafts at 13..15: it must not be cached
    assert set(s.kv_cache.pool.cached) == before
    assert s.kv_cache.view().check_invariants() == []


def test_drafts_fit_the_budget_max_tokens_and_max_batch():
    s, spec = make(k=4, budget=3)
    s.add_request(make_request("a", LOOP[:-1], max_tokens=20))
    run(s, spec, token=2)
    assert run(s, spec).scheduled[0].num_tokens == 3  # the budget: last token + 2 drafts
    s, spec = make(k=4)
    s.add_request(make_request("b", LOOP[:-1], max_tokens=3))
    run(s, spec, token=2)
    assert run(s, spec).scheduled[0].samples[0].draft_token_ids == [3]  # 1 output so far: at most 2 more after it
    assert s.requests == {}  # and it ended at max_tokens
    s, spec = make(k=4, max_batch=1)
    s.add_request(make_request("c", LOOP[:-1], max_tokens=20))
    s.add_request(make_request("d", [10 + t for t in LOOP[:-1]], max_tokens=20))
    run(s, spec, token=2)
    assert all(not e.samples[0].draft_token_ids for e in run(s, spec).scheduled)  # two decode: over max_batch


def test_backs_off_after_verifications_that_keep_nothing():
    s, spec = make(k=2, backoff=4)
    s.add_request(make_request("a", [5, 6, 5, 6, 5, 6, 5], max_tokens=40))
    run(s, spec, token=6)
    drafted = []
    for _ in range(16):
        out = run(s, spec, keep={"a": 0}, token=8)
        drafted.append(bool(out.scheduled[0].samples[0].draft_token_ids))
        s.requests["a"].output_token_ids[-1:] = [6]  # keep the loop going: the drafter keeps proposing 5, 6
        s.requests["a"].all_token_ids[-1:] = [6]
    # drafts, then 1 step without, drafts, 2 without, drafts, 4 without (capped at 4), ...
    assert drafted[:12] == [True, False, True, False, False, True, False, False, False, False, True, False]


def test_the_draft_length_follows_the_acceptance_rate_and_the_cost():
    lengths = [best_num_drafts(a, 0.2, 8) for a in (0.3, 0.6, 0.8, 0.9, 0.99)]
    assert lengths == sorted(lengths) and lengths[0] == 1 and lengths[-1] == 8
    assert [best_num_drafts(0.9, c, 8) for c in (0.1, 0.5, 2.0)] == sorted([best_num_drafts(0.9, c, 8) for c in (0.1, 0.5, 2.0)], reverse=True)
    # a request whose drafts are all kept drafts longer; one whose drafts are refused drafts 1
    s, spec = make(k=6, cost_batch=4.0)  # one decoding request: a draft costs 1 / 5 of a step
    s.add_request(make_request("a", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5], max_tokens=50))
    run(s, spec, token=6)
    cycle = {5: 6, 6: 7, 7: 5}.get  # the model goes on with the loop: every draft is kept
    sizes = [len(run(s, spec, token=cycle).scheduled[0].samples[0].draft_token_ids) for _ in range(6)]
    # 1 at first (no history: acceptance 1/2), then longer up to the 3 tokens a period offers
    assert sizes[0] == 1 and sizes[-1] == 3 and sizes == sorted(sizes), sizes
    s, spec = make(k=6, cost_batch=4.0)
    s.add_request(make_request("b", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5], max_tokens=50))
    run(s, spec, token=6)
    assert [len(run(s, spec, token=cycle).scheduled[0].samples[0].draft_token_ids) for _ in range(3)][-1] == 3
    spec.states["b"].rejected = 50.0  # a long record of refused drafts: one draft a step at most
    assert len(run(s, spec, token=cycle).scheduled[0].samples[0].draft_token_ids) == 1
