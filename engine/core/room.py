"""What the batch can still take (:class:`Room`): the scheduler's answer to the worker's "how many more jobs?"."""

from __future__ import annotations

from collections import Counter
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
    # Each running group's part (``shares.py``), its unstarted waiting requests counted as queued: a new request
    # of a group below its share would start at once (taking an above-share group's place). () when none runs.
    groups: tuple[GroupShare, ...] = ()

    @property
    def admissible(self) -> int:
        """Requests that could join soon: free slots (bounded by KV room) not already promised to waiting ones."""
        return max(0, min(self.free_slots, self.kv_rows) - self.waiting)

    @classmethod
    def of(cls, free_slots: int, waiting: WaitingQueue[Sequence], kv_rows: int, running: Mapping[int, int],
           shares: Shares | None = None) -> Room:
        """The room of a batch with ``running`` sequences per priority (and per group, ``shares``): its lowest
        priority is outranked while every waiting sequence has started (is preempted) already; its groups' parts
        show while any runs, each with its requests waiting unstarted (a request of a group below its share starts
        at once past them: ``Scheduler._below_share``)."""
        # (a bulk request waiting is behind any new one, and takes no share's place: it closes neither)
        unstarted = Counter(s.req.group for s in waiting if not s.admitted and not s.req.bulk)
        paused = sum(1 for s in waiting if s.admitted)
        groups = shares.snapshot(unstarted) if shares is not None and running else ()
        if running and not unstarted:
            lowest = min(running)
            return cls(free_slots, len(waiting), kv_rows, lowest, running[lowest], paused, groups)
        return cls(free_slots, len(waiting), kv_rows, paused=paused, groups=groups)
