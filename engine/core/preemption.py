"""Which running sequences leave for a waiting one (as vLLM's preemption, counting slots as well as memory).

Eligible: running sequences of its own group (``shares.py``; one group unless the worker names tenants) of
strictly lower priority whose aged key is no better, and sequences of another group above its share (whatever
their priority: between groups the share decides). Lowest priority first, then the most loaded group's, latest
first; the plan takes as few as make room, keeping their caches for their resume where that fits too. A bulk
request (``EngineRequest.bulk``, of the lowest priority) preempts nobody, and gives way to a request of higher
priority whatever its group: it takes only room no other request wants. The scheduler carries the plan out
(``scheduler.py``). Caches parked by preempted sequences give way, the same way round, to a waiting one that
cannot join for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .admission import KVAdmission
from .sequence import Sequence
from .shares import Shares

__all__ = ["Preemption", "drop_parked_caches", "plan_preemption"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Preemption:
    """A preemption: the request it makes room for, its victims, and whether their caches are parked."""

    top: Sequence
    victims: list[Sequence]
    park: bool

    @property
    def across(self) -> bool:
        """Whether a victim is of another group (it leaves for the share, not for priority)."""
        return any(v.req.group != self.top.req.group for v in self.victims)

    def describe(self, victim: Sequence) -> str:
        """The log line of ``victim`` leaving the batch (its cache parked or not: the scheduler parks it first)."""
        why = f"; group {victim.req.group!r} above its share" if victim.req.group != self.top.req.group else ""
        return (f"request {victim.rid} preempted (priority {victim.req.priority}, {victim.generated} tokens "
                f"generated; {'cache parked' if victim.parked else 'to recompute'}) for request {self.top.rid} "
                f"(priority {self.top.req.priority}{why})")


def plan_preemption(top: Sequence, running: Iterable[Sequence], lowest: int | None, kv: KVAdmission,
                    parks_caches: bool, shares: Shares | None = None) -> Preemption | None:
    """The fewest running sequences whose leaving lets ``top`` join, and whether their caches can be parked
    then; None if no eligible set does. ``lowest``: the lowest priority running (None: none runs).
    ``shares``: the running groups (None: one group)."""
    prio, group = top.req.priority, top.req.group
    outranks = lowest is not None and lowest < prio
    fair = shares is not None and not top.req.bulk and shares.below(top.req)  # bulk takes no share's place
    if not outranks and not fair:  # the common case: nobody to preempt
        return None
    eligible = [s for s in running if ((s.req.group == group or s.req.bulk) and s.req.priority < prio
                                        and s.key >= top.key)
                or (fair and s.req.group != group)]
    if not eligible:
        return None
    if shares is None:
        eligible.sort(key=lambda s: (s.req.priority, -s.key, -s.order))  # lowest priority, latest first
    else:  # lowest priority, then the most loaded group's, latest first
        eligible.sort(key=lambda s: (s.req.priority, -shares.spare(s.req.group), -s.key, -s.order))
        eligible = _within_share(top, eligible, shares)
    if not eligible or not kv.fits(top, eligible):
        return None
    parks = (True, False) if parks_caches else (False,)
    for k in range(1, len(eligible) + 1):  # as few victims as possible; keeping their caches if that fits
        for park in parks:
            if kv.fits(top, eligible[:k], park=park):
                return Preemption(top, eligible[:k], park)
    return None


def _within_share(top: Sequence, eligible: list[Sequence], shares: Shares) -> list[Sequence]:
    """``eligible`` less the sequences of other groups past the point where their group would fall below
    ``top``'s share (each leaving one counts)."""
    taken: dict[str, int] = {}
    kept = []
    for s in eligible:
        group = s.req.group
        if group != top.req.group and not s.req.bulk:  # a bulk one yields to priority, whatever the share
            if not shares.yields_to(s.req, top.req, taken.get(group, 0)):
                continue
            taken[group] = taken.get(group, 0) + 1
        kept.append(s)
    return kept


def drop_parked_caches(top: Sequence, waiting: Iterable[Sequence], kv: KVAdmission,
                       unpark: Callable[[Sequence], object]) -> bool:
    """Let ``top`` join by dropping caches parked by other waiting sequences (``unpark``: they resume by
    recomputing instead), lowest priority and latest first; whether it can join now. Without this, caches parked
    for sequences queued behind ``top`` could keep it out of an idle batch for good."""
    if kv.parked == top.parked_bytes or not kv.fits(top, drop_parked=True):
        return False
    others = sorted((s for s in waiting if s.parked is not None and s is not top),
                    key=lambda s: (s.req.priority, -s.key, -s.order))
    for s in others:
        log.info("request %s drops its parked cache (%d bytes; it will recompute) for request %s",
                 s.rid, s.parked_bytes, top.rid)
        unpark(s)
        if kv.fits(top):
            return True
    return False
