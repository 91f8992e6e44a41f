"""Suffix drafting: continuations counted over this request's tokens and recent requests' tokens,
followed greedily from the longest context that matches the sequence's end.

After SuffixDecoding (Oliaro et al., 2024, arXiv:2411.04975): a suffix tree over the current
request and one over earlier outputs, a draft grown by the most frequent child while its
frequency share stays high. Here the trees are tables of bounded depth: context (its last 1..D
tokens) -> next token -> count, one table per live request (its prompt and output) and one shared
by recent requests (two generations, so memory stays bounded and old traffic ages out).
"""

from __future__ import annotations

Counts = dict[tuple[int, ...], dict[int, int]]


class SuffixDrafter:
    """Proposes up to k tokens per request from its own history, then from recent requests."""

    def __init__(self, max_depth: int = 8, min_share: float = 0.3, max_shared_contexts: int = 1 << 20) -> None:
        if max_depth < 1 or not 0.0 < min_share <= 1.0:
            raise ValueError("suffix drafting needs max_depth >= 1 and 0 < min_share <= 1")
        self.max_depth, self.min_share, self.max_shared = max_depth, min_share, max_shared_contexts
        self._local: dict[str, tuple[Counts, list[int]]] = {}  # rid -> (its table, [tokens counted])
        self._shared: Counts = {}
        self._older: Counts = {}  # the previous generation of the shared table

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens, each the most frequent continuation of the longest context
        (at most max_depth tokens) ending the sequence so far, while it has at least `min_share`
        of that context's count; [] when nothing matches. `token_ids` only grows between calls."""
        if max_tokens <= 0:
            return []
        local = self._local.get(request_id)
        if local is None:
            local = self._local[request_id] = ({}, [0])
        table, counted = local
        _count(table, token_ids, counted[0], self.max_depth)
        counted[0] = len(token_ids)
        draft: list[int] = []
        tail = token_ids[-self.max_depth :]
        while len(draft) < max_tokens:
            token = self._next(table, tail)
            if token is None:
                break
            draft.append(token)
            tail = (tail + [token])[-self.max_depth :]
        return draft

    def _next(self, table: Counts, tail: list[int]) -> int | None:
        for depth in range(len(tail), 0, -1):
            context = tuple(tail[len(tail) - depth :])
            for counts in (table.get(context), self._shared.get(context), self._older.get(context)):
                if counts:
                    token, count = max(counts.items(), key=lambda kv: kv[1])
                    return token if count >= self.min_share * sum(counts.values()) else None
        return None

    def finish(self, request_id: str, token_ids: list[int]) -> None:
        """The request has ended: its history joins the shared table, its own table goes."""
        self._local.pop(request_id, None)
        _count(self._shared, token_ids, 0, self.max_depth)
        if len(self._shared) > self.max_shared:
            self._older, self._shared = self._shared, {}


def _count(table: Counts, token_ids: list[int], first: int, max_depth: int) -> None:
    """Count every (context of 1..max_depth tokens -> next token) whose next token is at a
    position in [first, len(token_ids))."""
    for pos in range(max(first, 1), len(token_ids)):
        token = token_ids[pos]
        for depth in range(1, min(max_depth, pos) + 1):
            counts = table.setdefault(tuple(token_ids[pos - depth : pos]), {})
            counts[token] = counts.get(token, 0) + 1
