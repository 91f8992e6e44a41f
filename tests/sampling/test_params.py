"""SamplingParams validation: bad values raise ValueError naming the field and the allowed range."""

import pytest

from octavo.sampling.params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p must be in"),
        ({"n": 0}, r"n must be an integer in \[1, 128\]"),
        ({"n": 10**9}, r"n must be an integer in \[1, 128\]"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"presence_penalty": "1"}, "presence_penalty must be a finite number"),
        ({"seed": 2**63}, r"seed must be an integer in \[-9223372036854775808, 9223372036854775807\]"),
        ({"seed": -(2**63) - 1}, "seed must be an integer in"),
        ({"stop": ["x"] * 17}, "at most 16 are allowed"),
        ({"stop": ["x" * 257]}, "at most 256 characters"),
        ({"stop_token_ids": list(range(257))}, "at most 256 are allowed"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"min_tokens": 5, "max_tokens": 3}, r"min_tokens \(5\) must be <= max_tokens \(3\)"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logprobs": 50}, "logprobs must be an integer in"),
        ({"stop": [""]}, "stop must be non-empty strings of at most"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_invalid_values_are_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5])
    assert p.stop == ("###",) and p.stop_token_ids == (5,)
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties and not SamplingParams().has_penalties
