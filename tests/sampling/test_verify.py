"""Speculative decoding's verification (sampling/verify.py): the tokens a sequence keeps are
exactly what plain decoding would produce, whatever the drafts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.sampling.logprobs import TokenLogprob
from octavo.sampling.verify import draft_outputs, verify


def model(prefix: list[int]) -> int:
    """A deterministic next-token rule: what greedy decoding would pick after `prefix`."""
    return (sum(prefix) * 31 + len(prefix)) % 5


@settings(max_examples=300, deadline=None)
@given(output=st.lists(st.integers(0, 4), max_size=6), drafts=st.lists(st.integers(0, 4), max_size=5))
def test_the_kept_tokens_are_plain_decodings_whatever_the_drafts(output, drafts):
    rows = draft_outputs(output, drafts)
    assert len(rows) == len(drafts) + 1 and all(r[: len(output)] == output for r in rows)
    tokens = [model(r) for r in rows]  # row j samples as if drafts[:j] were output
    kept = verify(["s"] * len(rows), tokens, [None] * len(rows), {"s": drafts})["s"]
    plain = list(output)
    for _ in kept.tokens:
        plain.append(model(plain))
    assert kept.tokens == plain[len(output):]
    num_agreed = len(kept.tokens) - 1
    assert drafts[:num_agreed] == kept.tokens[:num_agreed]  # only agreed drafts are kept...
    assert num_agreed == len(drafts) or drafts[num_agreed] != kept.tokens[num_agreed]  # ...all of them
    # the generator rewinds to the last kept row's draw unless every row was kept
    assert kept.rewind_row == (num_agreed if num_agreed < len(drafts) else None)


def test_sequences_without_drafts_keep_one_token_and_logprobs_follow_the_tokens():
    lp = [TokenLogprob(t, -0.1 * t, {t: -0.1 * t}) for t in (7, 3, 9, 5, 2)]
    out = verify(["a", "b", "b", "b", "c"], [7, 3, 9, 5, 2], lp, {"b": [3, 8]})
    assert out["a"].tokens == [7] and out["a"].rewind_row is None and out["a"].logprobs == lp[:1]
    assert out["b"].tokens == [3, 9] and out["b"].rewind_row == 2  # draft 3 agreed, 8 did not: row 2's 9
    assert out["b"].logprobs == lp[1:3]
    assert out["c"].tokens == [2] and out["c"].logprobs == lp[4:]
    assert verify(["a"], [4], [None], {})["a"].logprobs is None
