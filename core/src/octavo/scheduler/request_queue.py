"""The scheduler's queues of requests that wait: first come first served, or by priority.

Both orders are keyed by ``Request.sort_key`` = ``(priority, arrival time, admission number,
beam index)``, the priority being 0 for every request under FCFS. ``FCFSQueue`` keeps the
order requests came in, except that a preempted request goes back to the head (``prepend``):
it was admitted before anything still waiting. ``PriorityQueue`` always serves the smallest key
(lower priority value first, then the oldest), preempted or not.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from octavo.messages import Request


class RequestQueue(ABC):
    """What the scheduler needs of a queue (see the two implementations)."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Queue a preempted request (FCFS: at the head)."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to serve (the queue must not be empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a request anywhere in the queue (aborted); O(n)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Queued requests in the order they would be served."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of queued requests."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class FCFSQueue(RequestQueue):
    """Arrival order; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue(RequestQueue):
    """Smallest ``sort_key`` first: (priority, arrival, admission number, beam index)."""

    def __init__(self) -> None:
        # (key, insertion number: never compare two requests, request)
        self._heap: list[tuple[tuple[float, ...], int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        assert request.sort_key, f"{request.request_id} has no sort key"
        heapq.heappush(self._heap, (request.sort_key, next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # its key already puts it before later arrivals of its priority

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        for i, (_, _, queued) in enumerate(self._heap):
            if queued is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not queued")

    def __iter__(self) -> Iterator[Request]:
        return iter([item[2] for item in sorted(self._heap, key=lambda item: item[:2])])

    def __len__(self) -> int:
        return len(self._heap)
