"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from max_n down to min_n), found through an index kept up to date as tokens come.

Why an index and not a search per step: a search over the whole history costs O(length) per
request per step (vLLM's n-gram proposer runs a KMP over it, compiled with numba); here each new
token adds max_n - min_n + 1 entries once, and a proposal is max_n - min_n + 1 dict lookups.
"""

from __future__ import annotations


class _Index:
    """n-gram -> the position just after its latest occurrence that ends before the last token."""

    __slots__ = ("positions", "num_indexed")

    def __init__(self) -> None:
        self.positions: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # occurrences ending at positions < this are in `positions`


class NgramDrafter:
    """Proposes up to k tokens per request from its own prompt and output (prompt lookup)."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` tokens that followed the latest earlier occurrence of the longest
        suffix of `token_ids` (of min_n..max_n tokens) seen before; [] when none matches.
        `token_ids` is the request's whole sequence and only ever grows between calls with the
        same id (`finish` it when it ends)."""
        if max_tokens <= 0:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index()
        num = len(token_ids)
        self._extend(index, token_ids, num - 1)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            end = index.positions.get(tuple(token_ids[num - n :]))
            if end is not None:
                return token_ids[end : min(end + max_tokens, num)]
        return []

    def _extend(self, index: _Index, token_ids: list[int], upto: int) -> None:
        """Index every occurrence ending at a position in [num_indexed, upto): the latest wins."""
        positions = index.positions
        for end in range(max(index.num_indexed, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                positions[tuple(token_ids[end - n : end])] = end
        index.num_indexed = max(index.num_indexed, upto + 1)

    def finish(self, request_id: str, token_ids: list[int]) -> None:
        """The request has ended (or was cut back): drop its index."""
        self._indexes.pop(request_id, None)
