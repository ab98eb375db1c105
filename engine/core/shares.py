"""Groups sharing one batch by weight (a worker's tenants): who may take whose place.

A request's ``group`` (``EngineRequest.group``; "" for all by default) shares the batch with the others by its
``weight``: a group's *load* is its running sequences ÷ its weight. Priority orders requests within a group;
between groups the load decides. A waiting request may take a running sequence's place (preempt it) when that
sequence is of its own group and of lower priority (as before groups), or of another group whose load, even after
the move, stays at least the request's group's load after it: ``(r_u - 1) / w_u >= (r_g + 1) / w_g``. The move
then never reverses (the group it came from is not below the other after it), so two groups do not preempt each
other back and forth; at equal loads nobody moves. With a single group nothing changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from .request import EngineRequest
from .sequence import Sequence

__all__ = ["GroupShare", "Shares", "with_queued"]


@dataclass(frozen=True, slots=True)
class GroupShare:
    """One group's part of the batch, as the worker reads it: its running sequences and weight."""

    group: str
    running: int
    weight: float
    queued: int = 0  # its requests taken in and not started: waiting unstarted, on their way, or announced

    @property
    def taken(self) -> int:
        """Its requests this engine holds or will: running, and queued (each counts against its share)."""
        return self.running + self.queued

    @property
    def spare(self) -> float:
        """Its load after giving one sequence up: a request of another group whose load after joining is at
        most this may take one of its places."""
        return (self.running - 1) / self.weight


class Shares:
    """The running sequences per group and each group's weight (the last joining request's); the groups of the
    waiting requests, counted (a scheduler looks past the head of its queue only while they differ)."""

    __slots__ = ("running", "waiting", "weights")

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()
        self.weights: dict[str, float] = {}

    def join(self, req: EngineRequest) -> None:
        self.running[req.group] += 1
        self.weights[req.group] = _weight(req)

    def leave(self, req: EngineRequest) -> None:
        _drop(self.running, req.group)
        if req.group not in self.running:
            self.weights.pop(req.group, None)

    def wait(self, req: EngineRequest) -> None:
        self.waiting[req.group] += 1

    def unwait(self, req: EngineRequest) -> None:
        _drop(self.waiting, req.group)

    def clear(self) -> None:
        self.running.clear()
        self.waiting.clear()
        self.weights.clear()

    @property
    def mixed(self) -> bool:
        """Whether requests of more than one group wait."""
        return len(self.waiting) > 1

    def load_after(self, req: EngineRequest) -> float:
        """``req``'s group's load once ``req`` runs too."""
        return (self.running[req.group] + 1) / _weight(req)

    def spare(self, group: str, taken: int = 0) -> float:
        """``group``'s load after giving up one more sequence (``taken``: sequences already leaving)."""
        return (self.running[group] - taken - 1) / self.weights[group]

    def yields_to(self, victim: EngineRequest, top: EngineRequest, taken: int = 0) -> bool:
        """Whether running ``victim`` of another group may leave for ``top`` (``taken``: sequences of its group
        already leaving for it)."""
        group = victim.group
        return self.running[group] - taken > 0 and self.spare(group, taken) >= self.load_after(top)

    def below(self, top: EngineRequest) -> bool:
        """Whether some running group is above ``top``'s share: one of its sequences may leave for ``top``."""
        after = self.load_after(top)
        return any(g != top.group and self.spare(g) >= after for g in self.running)

    def furthest_below(self, head: EngineRequest, waiting: Iterable[Sequence]) -> Sequence | None:
        """While ``head`` cannot join: the waiting sequence of another group that is furthest below its share, if
        some running group is above it (the earliest of that group's); None if none is."""
        if not self.mixed:  # the common case: one group waits
            return None
        best: tuple[float, float, int] | None = None
        found = None
        for seq in waiting:
            if seq.req.group == head.group or not self.below(seq.req):
                continue
            rank = (self.load_after(seq.req), seq.key, seq.order)
            if best is None or rank < best:
                best, found = rank, seq
        return found

    def snapshot(self, unstarted: Mapping[str, int] | None = None) -> tuple[GroupShare, ...]:
        """Each running group's part, and each group's ``unstarted`` requests (waiting, not started yet) as its
        queued ones (see :func:`with_queued`)."""
        parts = tuple(GroupShare(g, n, self.weights[g]) for g, n in self.running.items())
        return with_queued(parts, unstarted or {})


def with_queued(parts: tuple[GroupShare, ...], queued: Mapping[str, int]) -> tuple[GroupShare, ...]:
    """``parts`` with each group's ``queued`` requests added to its queued ones; a group queued that none of them
    shows gets a part of its own (none running, weight 1: its spare is never used)."""
    if not queued:
        return parts
    shown = {g.group for g in parts}
    return (*(replace(g, queued=g.queued + queued.get(g.group, 0)) for g in parts),
            *(GroupShare(group, 0, 1.0, n) for group, n in queued.items() if n > 0 and group not in shown))


def _weight(req: EngineRequest) -> float:
    return req.weight if req.weight > 0 else 1.0


def _drop(counter: Counter[str], key: str) -> None:
    left = counter[key] - 1
    if left > 0:
        counter[key] = left
    else:
        del counter[key]
