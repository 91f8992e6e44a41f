"""Drafters against plain references: the n-gram index proposes what a search over the whole
history finds; the suffix tables propose the most frequent continuation of the longest context."""

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.spec_decode import NgramDrafter, SuffixDrafter


def search_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The reference: for n from max_n down, the latest earlier occurrence of the last n tokens
    (ending before the last token), and the k tokens after it."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        for end in range(num - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), cuts=st.lists(st.integers(1, 60), max_size=6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 6))
def test_ngram_index_proposes_what_a_full_search_finds(tokens, cuts, min_n, extra, k):
    drafter = NgramDrafter(min_n, min_n + extra)
    for cut in sorted(set(c for c in cuts if c <= len(tokens))) + [len(tokens)]:  # the sequence grows between calls
        prefix = tokens[:cut]
        assert drafter.propose("r", prefix, k) == search_ngram(prefix, min_n, min_n + extra, k), prefix


def test_ngram_copies_a_span_of_the_prompt():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2]
    drafter = NgramDrafter(2, 4)
    assert drafter.propose("r", prompt + [7, 8], 4) == [9, 10, 11, 12]
    assert drafter.propose("r", prompt + [7, 8, 9], 2) == [10, 11]
    drafter.finish("r", [])
    assert drafter.propose("r", [1, 2, 3], 4) == []  # after finish the id starts afresh: nothing repeats


def test_suffix_drafter_follows_the_most_frequent_continuation_and_learns_from_finished_requests():
    drafter = SuffixDrafter(max_depth=2, min_share=0.3)
    history = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4]
    assert drafter.propose("a", history + [1, 2], 3) == [3, 4, 1]  # (2, 3) -> 4 twice, -> 5 once
    drafter.finish("a", history)
    # a new request with nothing of its own to copy drafts from the finished one's tokens
    assert drafter.propose("b", [9, 9, 2, 3], 2) == [4, 1]
    assert drafter.propose("c", [42], 3) == []


def test_suffix_drafter_stops_where_no_continuation_has_the_share():
    drafter = SuffixDrafter(max_depth=2, min_share=0.6)
    tokens = [1, 2, 1, 3, 1, 4, 1]  # after 1: 2, 3, 4 once each (a third each)
    assert drafter.propose("a", tokens, 4) == []
    drafter2 = SuffixDrafter(max_depth=2, min_share=0.6)
    assert drafter2.propose("a", [1, 2, 1, 2, 1, 2, 1, 3, 1], 1) == [2]  # 3 of 4 after 1


def test_engine_args_take_vllms_speculative_config_and_refuse_what_they_cannot_do():
    import pytest

    from octavo.engine_args import EngineArgs

    args = EngineArgs(speculative_config='{"method": "suffix", "num_speculative_tokens": 6, "prompt_lookup_max": 5}')
    assert (args.speculative_method, args.num_speculative_tokens, args.prompt_lookup_max) == ("suffix", 6, 5)
    for bad, reason in [("{", "not valid JSON"), ('{"k": 1}', 'with a "method"'),
                        ('{"method": "ngram", "foo": "x"}', "keys not supported: foo"),
                        ('{"method": "ngram", "model": "x"}', "needs --speculative-method draft"),
                        ('{"method": "eagle"}', "must be one of ngram, suffix, draft")]:
        with pytest.raises(ValueError, match=reason):
            EngineArgs(speculative_config=bad)
