"""Which running sequences leave for a waiting one (as vLLM's preemption, counting slots as well as memory).

Running sequences of strictly lower priority whose aged key is no better are eligible, lowest and latest
first; the plan takes as few as make room, keeping their caches for their resume where that fits too. The
scheduler carries the plan out (``scheduler.py``). Caches held by preempted sequences give way, the same way
round, to a waiting one that cannot join for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .admission import KVAdmission
from .sequence import Sequence

__all__ = ["Preemption", "drop_held_caches", "plan_preemption"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Preemption:
    """A preemption: the request it makes room for, its victims, and whether their caches are held."""

    top: Sequence
    victims: list[Sequence]
    hold: bool


def plan_preemption(top: Sequence, running: Iterable[Sequence], lowest: int | None, kv: KVAdmission,
                    holds_caches: bool) -> Preemption | None:
    """The fewest running sequences whose leaving lets ``top`` join, and whether their caches can be held
    then; None if no eligible set does. ``lowest``: the lowest priority running (None: none runs)."""
    prio = top.req.priority
    if lowest is None or lowest >= prio:  # the common case: nobody to preempt
        return None
    eligible = [s for s in running if s.req.priority < prio and s.key >= top.key]
    if not eligible or not kv.fits(top, eligible):
        return None
    eligible.sort(key=lambda s: (s.req.priority, -s.key, -s.order))  # lowest priority, latest first
    holds = (True, False) if holds_caches else (False,)
    for k in range(1, len(eligible) + 1):  # as few victims as possible; keeping their caches if that fits
        for hold in holds:
            if kv.fits(top, eligible[:k], hold=hold):
                return Preemption(top, eligible[:k], hold)
    return None


def drop_held_caches(top: Sequence, waiting: Iterable[Sequence], kv: KVAdmission,
                     unhold: Callable[[Sequence], object]) -> bool:
    """Let ``top`` join by dropping caches held by other waiting sequences (``unhold``: they resume by
    recomputing instead), lowest priority and latest first; whether it can join now. Without this, caches held
    for sequences queued behind ``top`` could keep it out of an idle batch for good."""
    if kv.held == top.held_bytes or not kv.fits(top, drop_held=True):
        return False
    others = sorted((s for s in waiting if s.held is not None and s is not top),
                    key=lambda s: (s.req.priority, -s.key, -s.order))
    for s in others:
        log.info("request %s drops its held cache (%d bytes; it will recompute) for request %s",
                 s.rid, s.held_bytes, top.rid)
        unhold(s)
        if kv.fits(top):
            return True
    return False
