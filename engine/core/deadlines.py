"""Requests' deadlines: which have passed, found without scanning every request at every step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from .request import EngineRequest

__all__ = ["Deadlines"]


class Deadlines:
    """The earliest deadline that may still be pending (it may be a gone request's): until the clock passes
    it no request is looked at."""

    def __init__(self) -> None:
        self.next = math.inf

    def add(self, deadline: float | None) -> None:
        if deadline is not None:
            self.next = min(self.next, deadline)

    def passed(self, now: float, requests: Callable[[], Iterable[EngineRequest]]) -> list[str]:
        """The ids of ``requests()`` whose deadline is before ``now`` (called only once one may be)."""
        if now <= self.next:  # the common case: no scan of every request each step
            return []
        late: list[str] = []
        self.next = math.inf
        for r in requests():
            if r.deadline is None:
                continue
            if now > r.deadline:
                late.append(r.rid)
            else:
                self.next = min(self.next, r.deadline)
        return late
