"""Speculative decoding's drafters: token proposals a request's next step verifies (pure Python)."""

from octavo.spec_decode.ngram import NgramDrafter
from octavo.spec_decode.suffix import SuffixDrafter

__all__ = ["NgramDrafter", "ProvidedDrafter", "SuffixDrafter", "best_num_drafts", "make_drafter"]


class ProvidedDrafter:
    """Drafts computed outside the scheduler (by a draft model, which the engine runs before each
    step over `Scheduler.draft_candidates`): handed in with `provide`, used once."""

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def provide(self, drafts: dict[str, tuple[int, list[int]]]) -> None:
        """request id -> (its token count when drafted, the drafts after its last token)."""
        self._drafts = drafts

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        entry = self._drafts.pop(request_id, None)
        if entry is None or entry[0] != len(token_ids):
            return []  # drafted for another state of the request (or not at all)
        return entry[1][:max_tokens]

    def finish(self, request_id: str, token_ids: list[int]) -> None:
        self._drafts.pop(request_id, None)


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
    recent requests; draft: what the engine's draft model provides)."""
    if method == "ngram":
        return NgramDrafter(min_n, max_n)
    if method == "suffix":
        return SuffixDrafter(max_depth=max(max_n, 8))
    if method == "draft":
        return ProvidedDrafter()
    raise ValueError(f"unknown speculative method {method!r}")
