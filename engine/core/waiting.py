"""The waiting queue: requests by priority with aging, first come first served within a key.

A request's key is ``arrival - priority * aging_s``; the lowest key goes first. So a request of priority
``p`` goes ahead of one of priority 0 only if it arrived less than ``p * aging_s`` seconds after it: nobody
waits longer than that behind a stream of higher-priority requests. The producer scores the Redis queue the
same way, so what a worker claims and what its engine admits agree. A bulk request's key is moved
``BULK_BAND_S`` later: aging orders bulk requests among themselves but never lifts one above another request.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["BULK_BAND_S", "WaitingQueue", "priority_key"]

T = TypeVar("T")
BULK_BAND_S = 1e9  # ~32 years: more than any wait or priority lead (a float keeps ~0.1 ms at this size)


def priority_key(arrival: float, priority: int, aging_s: float, bulk: bool = False) -> float:
    """The sort key of a request (lower first): its arrival, moved ``aging_s`` earlier per priority level;
    ``bulk``: behind every request not bulk."""
    return arrival - priority * aging_s + (BULK_BAND_S if bulk else 0.0)


class WaitingQueue(Generic[T]):
    """Items by ``(key, order)``; removal by id is O(1) (the heap entry is skipped when it surfaces)."""

    __slots__ = ("_heap", "_items", "_pushes")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str, T]] = []  # key, order, push number (unique), rid, item
        self._items: dict[str, T] = {}
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[T]:
        """Items in the order they were pushed (not the order they will leave)."""
        return iter(list(self._items.values()))

    def push(self, rid: str, key: float, order: int, item: T) -> None:
        """Add ``item``; ``order`` breaks ties between equal keys (lower first)."""
        self._items[rid] = item
        self._pushes += 1
        heapq.heappush(self._heap, (key, order, self._pushes, rid, item))

    def peek(self) -> T | None:
        """The item that leaves next, or None."""
        heap = self._heap
        while heap:
            _, _, _, rid, item = heap[0]
            if self._items.get(rid) is item:
                return item
            heapq.heappop(heap)  # removed (or replaced) since it was pushed
        return None

    def pop(self) -> T:
        """Remove and return the item that leaves next (the queue must not be empty)."""
        item = self.peek()
        if item is None:
            raise IndexError("pop from an empty WaitingQueue")
        rid = heapq.heappop(self._heap)[3]
        del self._items[rid]
        return item

    def remove(self, rid: str) -> T | None:
        """Take the item of ``rid`` out, wherever it is; None if there is none."""
        item = self._items.pop(rid, None)
        if not self._items:
            self._heap.clear()  # the skipped entries would hold their items until something else is pushed
        return item

    def clear(self) -> None:
        """Drop every item."""
        self._heap.clear()
        self._items.clear()
