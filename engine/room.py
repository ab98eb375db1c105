"""What the batch can still take (:class:`Room`): the scheduler's answer to the worker's "how many more jobs?"."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .sequence import Sequence
from .shares import GroupShare, Shares
from .waiting import WaitingQueue

__all__ = ["Room"]


@dataclass(frozen=True, slots=True)
class Room:
    """What the batch can still take, as of the last step (other threads read it: replaced whole)."""

    free_slots: int  # sequence slots not running
    waiting: int  # requests waiting for one (preempted ones included)
    kv_rows: int  # more typical requests the KV headroom has room for beside the running ones
    # The lowest priority running, while no request that has not started yet waits: a new request of higher
    # priority would start at once (preempting) even with no room. None otherwise.
    outranked: int | None = None
    outranked_rows: int = 0  # running sequences of that priority: as many such requests start at once
    paused: int = 0  # of the waiting, the preempted ones (started, waiting to resume)
    # Each running group's part (``shares.py``), while no request that has not started yet waits: a new request
    # of a group below its share would start at once (taking an above-share group's place). () otherwise.
    groups: tuple[GroupShare, ...] = ()

    @property
    def admissible(self) -> int:
        """Requests that could join soon: free slots (bounded by KV room) not already promised to waiting ones."""
        return max(0, min(self.free_slots, self.kv_rows) - self.waiting)

    @classmethod
    def of(cls, free_slots: int, waiting: WaitingQueue[Sequence], kv_rows: int, running: Mapping[int, int],
           shares: Shares | None = None) -> Room:
        """The room of a batch with ``running`` sequences per priority (and per group, ``shares``): its lowest
        priority is outranked, and its groups' parts are open, while every waiting sequence has started (is
        preempted) already."""
        paused = sum(1 for s in waiting if s.admitted)
        if running and paused == len(waiting):
            lowest = min(running)
            groups = shares.snapshot() if shares is not None else ()
            return cls(free_slots, len(waiting), kv_rows, lowest, running[lowest], paused, groups)
        return cls(free_slots, len(waiting), kv_rows, paused=paused)
