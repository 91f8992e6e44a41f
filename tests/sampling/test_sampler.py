"""Sampler: greedy, truncation, seeded reproducibility, penalties, min_tokens and logprobs."""

import pytest
import torch

from octavo.sampling.params import SamplingParams
from octavo.sampling.sampler import SamplingRow, apply_penalties, sample, truncate


def row(params, out=(), prompt=(), eos=(0,), seed=None):
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(prompt), list(out), tuple(eos), gen)


def test_greedy_takes_argmax_and_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = SamplingParams(temperature=0)
    tokens, _ = sample(logits, [row(greedy)] * 4)
    assert tokens == logits.argmax(-1).tolist()
    tokens_k1, _ = sample(logits, [row(SamplingParams(temperature=1.0, top_k=1))] * 4)
    assert tokens_k1 == tokens


def test_seeded_rows_repeat_regardless_of_batch_companions():
    torch.manual_seed(1)
    logits = torch.randn(3, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[1:2], [row(p, seed=42)])[0][0]]
    r = row(p, seed=42)
    batched = sample(logits, [row(SamplingParams()), r, row(SamplingParams(temperature=0.5))])[0][1]
    assert batched == alone[0]
    # and a second draw from the same generator continues the stream identically
    r1, r2 = row(p, seed=42), row(p, seed=42)
    seq1 = [sample(logits[1:2], [r1])[0][0] for _ in range(5)]
    seq2 = [sample(logits[1:2], [r2])[0][0] for _ in range(5)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(truncate(logits, SamplingParams(top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(truncate(logits, SamplingParams(top_p=0.1)))
    assert kept.tolist() == [True, False, False, False]


def test_min_p_and_top_k():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(truncate(logits, SamplingParams(min_p=0.2))).tolist() == [True, True, True, False]
    assert torch.isfinite(truncate(logits, SamplingParams(top_k=2))).tolist() == [True, True, False, False]


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = logits.clone()
    apply_penalties(out, row(p, out=[2, 2], prompt=[0, 1]))
    # repetition: 2 -> 1, -2 -> -4, 1 -> 0.5; then token 2 (seen twice) loses 2*0.5 + 0.25
    assert torch.allclose(out, torch.tensor([1.0, -4.0, 0.5 - 1.25, 0.5]))


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[10.0, 0.0, 9.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    tokens, _ = sample(logits, [row(p, out=[3], eos=(0,))])
    assert tokens == [3]
    tokens, _ = sample(logits, [row(p, out=[3, 3], eos=(0,))])
    assert tokens == [0]


def test_logprobs_are_raw_log_softmax_with_top_k():
    torch.manual_seed(2)
    logits = torch.randn(1, 30)
    p = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    tokens, lps = sample(logits, [row(p, prompt=[int(logits.argmax())])])
    ref = torch.log_softmax(logits[0], -1)
    (lp,) = lps
    assert lp.token_id == tokens[0]
    assert abs(lp.logprob - float(ref[tokens[0]])) < 1e-6
    assert list(lp.top) == torch.topk(ref, 3).indices.tolist()
    assert sample(logits, [row(SamplingParams(temperature=0))])[1] == [None]


def test_batched_filters_equal_the_per_row_reference():
    """truncate_batched / apply_penalties_batched (what sample runs, one op for all rows) keep and
    mask exactly what the per-row functions do, over a mix of rows asking for different filters."""
    from octavo.sampling.sampler import apply_penalties_batched, truncate_batched

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.1, top_k=12),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=2.0, frequency_penalty=0.4, presence_penalty=0.3, top_k=39),
    ]
    rows = [row(p, out=torch.randint(0, 40, (7,), generator=g).tolist(), prompt=[1, 2, 3]) for p in params]
    penalized = apply_penalties_batched(logits, rows)
    for i, r in enumerate(rows):
        expected = logits[i].clone()
        if r.params.has_penalties:
            apply_penalties(expected, r)
        torch.testing.assert_close(penalized[i], expected)
    batched = truncate_batched(penalized, params)
    for i, p in enumerate(params):
        expected = truncate(penalized[i], p)
        assert torch.equal(torch.isfinite(batched[i]), torch.isfinite(expected)), p
        torch.testing.assert_close(batched[i][torch.isfinite(expected)], expected[torch.isfinite(expected)])


def test_logprobs_of_rows_asking_different_k():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    rows = [row(SamplingParams(temperature=0, logprobs=k)) for k in (0, 4)] + [row(SamplingParams(temperature=0))]
    tokens, lps = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert lps[0].top == {} and lps[2] is None
    assert list(lps[1].top) == torch.topk(ref[1], 4).indices.tolist()
    assert abs(lps[0].logprob - float(ref[0, tokens[0]])) < 1e-6


def test_logit_bias_forces_and_bans_tokens_per_row():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0], [5.0, 1.0, 0.0, 4.0], [5.0, 1.0, 0.0, 4.0]])
    greedy = SamplingParams(temperature=0)
    rows = [row(SamplingParams(temperature=0, logit_bias={2: 100})),
            row(SamplingParams(temperature=0, logit_bias={0: -100})), row(greedy)]
    tokens, _ = sample(logits, rows)
    assert tokens == [2, 3, 0]
    sampled = [sample(logits[:1], [row(SamplingParams(temperature=1.0, logit_bias={0: -100, 3: -100}, seed=s), seed=s)])[0][0]
               for s in range(20)]
    assert 0 not in sampled and 3 not in sampled
    with pytest.raises(ValueError, match="logit_bias values must be numbers in \\[-100, 100\\]"):
        SamplingParams(logit_bias={1: 101})
