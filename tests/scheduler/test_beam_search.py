"""Beam search in pure Python: BeamGroup's rounds follow transformers' rules, and the scheduler's
forks and drops of beams keep every block accounted for (thousands of them, with a shadow KV cache
checking that each beam reads only its own tokens' KV through the shared, copied-on-write blocks)."""

import random

import pytest

from octavo.beam_search import BeamGroup, Hypothesis
from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.request import FinishReason
from octavo.sampling.params import BeamSearchParams
from octavo.limits import RequestRefused
from octavo.scheduler import Scheduler
from tests.helpers import make_request
from tests.scheduler.test_invariants import BS, ShadowKV, check_invariants, fake_model

EOS = 2


def group(width=2, max_tokens=5, **kw) -> BeamGroup:
    g = BeamGroup(BeamSearchParams(width, max_tokens=max_tokens, **kw), (EOS,))
    g.start("b0")
    return g


def test_first_round_forks_the_top_width_and_an_eos_below_rank_width_is_ignored():
    g = group()
    g.add_candidates("b0", {5: -0.1, 7: -0.5, EOS: -1.0, 9: -2.0})
    r = g.advance({"b0": []})
    assert [(c.parent_id, c.token_id, c.cum_logprob) for c in r.continuations] == [("b0", 5, -0.1), ("b0", 7, -0.5)]
    assert r.dropped == [] and not r.done and g.finished == []


def test_an_eos_in_the_top_width_finishes_a_hypothesis_scored_by_length():
    g = group(length_penalty=2.0)
    g.running = {"a": -1.0, "b": -2.0}
    g.num_generated = 2
    g.add_candidates("a", {EOS: -0.5, 4: -0.7, 6: -3.0, 8: -4.0})
    g.add_candidates("b", {4: -0.1, 5: -0.2, 6: -5.0, 8: -6.0})
    r = g.advance({"a": [10, 11], "b": [10, 12]})
    # pool: a+EOS -1.5 (rank 0, ends), a+4 -1.7, b+4 -2.1, b+5 -2.2; the running are the best 2 that do not end
    assert [(c.parent_id, c.token_id) for c in r.continuations] == [("a", 4), ("b", 4)]
    (hyp,) = g.finished
    assert hyp.token_ids == [10, 11, EOS] and hyp.ended_on_eos
    assert hyp.score == pytest.approx(-1.5 / 3**2.0)


def test_the_last_allowed_token_ends_every_beam():
    g = group(max_tokens=3)
    g.running, g.num_generated = {"a": -1.0, "b": -1.5}, 2
    g.add_candidates("a", {4: -0.1, 5: -0.2, 6: -0.3, 7: -0.4})
    g.add_candidates("b", {4: -0.1, 5: -0.2, 6: -0.3, 7: -0.4})
    r = g.advance({"a": [1, 1], "b": [1, 2]})
    assert r.done and r.continuations == [] and r.dropped == ["a", "b"]
    assert [h.token_ids for h in g.results()] == [[1, 1, 4], [1, 1, 5]]  # only the top width candidates
    assert not any(h.ended_on_eos for h in g.results())


@pytest.mark.parametrize("early_stopping, stops", [(True, True), (False, False)])
def test_early_stopping_true_stops_once_width_hypotheses_exist(early_stopping, stops):
    """Both rules with `width` hypotheses finished: True stops; False goes on while the best running
    beam at its current length (-1.2 / 3) beats the worst finished score (-2.0)."""
    g = group(early_stopping=early_stopping)
    g.finished = [Hypothesis([1, 1, EOS], -6.0, -2.0, True)]
    g.running, g.num_generated = {"a": -1.0, "b": -1.1}, 2
    g.add_candidates("a", {EOS: -0.1, 4: -0.2, 6: -9.0, 8: -9.5})
    g.add_candidates("b", {5: -0.5, 6: -0.6, 7: -9.0, 8: -9.5})
    r = g.advance({"a": [1, 4], "b": [3, 3]})
    assert len(g.finished) == 2 and g.finished[0].score == pytest.approx(-1.1 / 3)
    assert r.done == stops
    assert [c.token_id for c in r.continuations] == ([] if stops else [4, 5])


def test_early_stopping_false_stops_when_no_running_beam_can_win():
    g = group(early_stopping=False)
    g.finished = [Hypothesis([1, 1, EOS], -0.3, -0.1, True)]
    g.running, g.num_generated = {"a": -1.0, "b": -1.1}, 2
    g.add_candidates("a", {EOS: -0.1, 4: -0.2, 6: -9.0, 8: -9.5})
    g.add_candidates("b", {5: -0.5, 6: -0.6, 7: -9.0, 8: -9.5})
    r = g.advance({"a": [1, 4], "b": [3, 3]})
    assert r.done and not g.improvable  # -1.2 / 3 = -0.4 cannot beat the worst finished, -1.1 / 3


def test_ignore_eos_never_finishes_on_eos():
    g = group(ignore_eos=True)
    g.add_candidates("b0", {EOS: -0.1, 7: -0.5, 8: -1.0, 9: -2.0})
    r = g.advance({"b0": []})
    assert [c.token_id for c in r.continuations] == [EOS, 7] and g.finished == []


def test_beam_width_is_validated():
    with pytest.raises(ValueError, match="beam_width must be an integer in \\[1, 10\\]"):
        BeamSearchParams(11)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(2, early_stopping="sometimes")


def test_thousands_of_forks_and_drops_leave_no_block_behind():
    rng = random.Random(0)
    num_blocks = 48
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=12, max_model_len=48),
                  KVCacheManager(num_blocks, BS, enable_prefix_caching=True))
    shadow = ShadowKV()
    forks = drops = 0
    for i in range(1200):
        if rng.random() < 0.35:
            prompt = [7] * rng.randint(0, 6) + [rng.randint(10, 60) for _ in range(rng.randint(1, 9))]
            req = make_request(f"s{i}", prompt, max_tokens=rng.randint(1, 8), beam_width=rng.randint(1, 4), eos=(3,))
            try:
                s.add_request(req)
            except RequestRefused:
                pass
        if rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(sorted(s.requests))], FinishReason.ABORT)
        before = {id(r.beam): r.beam.next_beam_index for r in s.requests.values() if r.beam}
        live_before = set(s.requests)
        out = s.schedule()
        shadow.run(s, out)
        s.update(out, fake_model(s, out, rng.randint(0, 1000)))
        forks += sum(r.beam.next_beam_index - before.get(id(r.beam), 1) for r in s.requests.values() if r.beam)
        drops += len(live_before - set(s.requests))
        check_invariants(s)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.scheduled
        shadow.run(s, out)
        s.update(out, fake_model(s, out, 1))
        check_invariants(s)
    assert not s.has_unfinished_requests()
    assert s.kv_cache.num_free_blocks == num_blocks and all(b.ref_cnt == 0 for b in s.kv_cache.pool.blocks)
    assert forks > 1000 and drops > 1000, (forks, drops)
