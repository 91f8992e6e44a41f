"""Speculative decoding's drafters: token proposals a request's next step verifies (pure Python)."""

from octavo.spec_decode.ngram import NgramDrafter
from octavo.spec_decode.suffix import SuffixDrafter

__all__ = ["NgramDrafter", "SuffixDrafter", "make_drafter"]


def make_drafter(method: str, min_n: int, max_n: int):
    """The drafter of a `--speculative-method` (ngram: prompt lookup; suffix: a tree over this and
    recent requests)."""
    if method == "ngram":
        return NgramDrafter(min_n, max_n)
    if method == "suffix":
        return SuffixDrafter(max_depth=max(max_n, 8))
    raise ValueError(f"unknown speculative method {method!r}")
