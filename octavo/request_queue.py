"""Waiting queues of the scheduler: first come first served, or by priority then arrival."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from octavo.request import Request


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest `priority` value first, then earliest arrival. A preempted request keeps its key, so it
    goes back ahead of everything that arrived after it at its priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; supported: fcfs, priority")
