"""Speculative decoding's drafters: token proposals a request's next step verifies (pure Python)."""

from octavo.spec_decode.ngram import NgramDrafter
from octavo.spec_decode.suffix import SuffixDrafter

__all__ = ["NgramDrafter", "SuffixDrafter", "best_num_drafts", "make_drafter"]


def best_num_drafts(acceptance: float, draft_cost: float, max_drafts: int) -> int:
    """The draft length (1..max_drafts) that makes the most tokens per unit of step cost, when
    each draft is kept with probability `acceptance` if the ones before it were (so k drafts
    yield (1 - a^(k+1)) / (1 - a) tokens) and each costs `draft_cost` of a decode step."""
    best, best_rate = 1, 0.0
    for k in range(1, max_drafts + 1):
        tokens = k + 1 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
        rate = tokens / (1.0 + draft_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def make_drafter(method: str, min_n: int, max_n: int):
    """The drafter of a `--speculative-method` (ngram: prompt lookup; suffix: a tree over this and
    recent requests)."""
    if method == "ngram":
        return NgramDrafter(min_n, max_n)
    if method == "suffix":
        return SuffixDrafter(max_depth=max(max_n, 8))
    raise ValueError(f"unknown speculative method {method!r}")
