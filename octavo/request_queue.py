"""Waiting queues of the scheduler: first come first served, by priority then arrival, or ranked
each step by a key the scheduler computes (cache-aware: reusable cached tokens, with aging).

Removal (an abort, a stop) is O(1): the request is marked dead and skipped when it reaches the
front; the queue compacts itself when dead entries outnumber live ones, so memory stays
O(live requests) however many clients come and go.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from octavo.config import SCHEDULING_POLICIES
from octavo.request import Request

_COMPACT_SLACK = 64  # dead entries tolerated beyond the number of live ones before a rebuild


class _LazyRemoval:
    """Dead-entry bookkeeping shared by both queues; entries are keyed by object identity (a
    dead request stays referenced by its entry, so its id cannot be reused meanwhile)."""

    def __init__(self) -> None:
        self._dead: set[int] = set()

    def _mark_dead(self, request: Request) -> None:
        self._dead.add(id(request))

    def _is_dead(self, request: Request) -> bool:
        return id(request) in self._dead

    def _forget(self, request: Request) -> None:
        self._dead.discard(id(request))

    def _needs_compaction(self, num_entries: int) -> bool:
        return len(self._dead) > num_entries - len(self._dead) + _COMPACT_SLACK


class FCFSQueue(_LazyRemoval):
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def _drop_dead_front(self) -> None:
        while self._queue and self._is_dead(self._queue[0]):
            self._forget(self._queue.popleft())

    def peek(self) -> Request:
        self._drop_dead_front()
        return self._queue[0]

    def pop(self) -> Request:
        self._drop_dead_front()
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """O(1): the entry is skipped later. The request must be in the queue."""
        self._mark_dead(request)
        if self._needs_compaction(len(self._queue)):
            self._queue = deque(r for r in self._queue if not self._is_dead(r))
            self._dead.clear()

    def __len__(self) -> int:
        return len(self._queue) - len(self._dead)

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._queue if not self._is_dead(r))


class PriorityQueue(_LazyRemoval):
    """Lowest `priority` value first, then earliest arrival. A preempted request keeps its key, so it
    goes back ahead of everything that arrived after it at its priority."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    add_preempted = add

    def _drop_dead_front(self) -> None:
        while self._heap and self._is_dead(self._heap[0][3]):
            self._forget(heapq.heappop(self._heap)[3])

    def peek(self) -> Request:
        self._drop_dead_front()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_dead_front()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """O(1) amortised: the entry is skipped later. The request must be in the queue."""
        self._mark_dead(request)
        if self._needs_compaction(len(self._heap)):
            self._heap = [entry for entry in self._heap if not self._is_dead(entry[3])]
            heapq.heapify(self._heap)
            self._dead.clear()

    def __len__(self) -> int:
        return len(self._heap) - len(self._dead)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if not self._is_dead(entry[3]))


class RankedQueue(FCFSQueue):
    """FCFS between ranks (new requests at the back, preempted ones at the front); `rank(key)`
    reorders it by a key the caller computes from state the queue cannot see (the cache).
    The sort is stable: requests with equal keys keep their order."""

    def rank(self, key: Callable[[Request], Any]) -> None:
        """Reorder by `key` (smallest first), dropping dead entries. O(n log n) plus n keys."""
        self._queue = deque(sorted((r for r in self._queue if not self._is_dead(r)), key=key))
        self._dead.clear()


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue | RankedQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "cache-aware":
        return RankedQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; supported: {', '.join(SCHEDULING_POLICIES)}")
