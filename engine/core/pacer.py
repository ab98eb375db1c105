"""Paces step outputs: each request's tokens go out at most every ``interval`` seconds, merged.

A small model decodes a step in a millisecond or two; sending every step's tokens as their own events costs
more CPU downstream (events, Redis, every subscriber parsing them) than the step itself, and that CPU comes
out of the decode on a busy host. Deferring tokens for a few milliseconds turns many one-token events into
a few larger ones, as vLLM's and SGLang's ``stream_interval`` do, but by time instead of token count, so a
slow model (a step longer than the interval) still streams every step. A request's first token (its time to
first token) and its finish are never deferred. Its start is deferred like a token, and goes out with its first token
(two or three steps later in mlx-lm's batch), one send where there would be two, but stamped when its step handed
it over (``started_at``): its time queued ends there, not when the pacer sends it. (Sent at once, each admitting
step's starts took a send of their own: a churn of short jobs made half again as many writes to Redis, and a
job's end waited behind them.)

A batch of many rows sends that many outputs per interval: with a ``rate``, the interval grows with the
requests deferred so that no more than ``rate`` outputs a second go out (64 rows at 1,600 a second: every 40 ms),
so what streaming costs the host stays bounded as the batch grows instead of growing with it.

A bulk request's outputs (:meth:`Pacer.hold`: a batch's line, whose results are read at its end) go out with its
end, or every ``bulk_interval_s`` while it runs: its first token is not urgent, and no interval's send carries it.
Streamed like an interactive one's, a bulk row's tokens took an EMIT's share of Redis and of the worker's event
loop every interval, time an interactive job's claim and first token then waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from .request import RequestOutput, merge_into

__all__ = ["Pacer"]


class Pacer:
    """Defers step outputs until they are due; use from one thread (the engine's).

    It defers one merged output per request, so a push costs the same however long outputs have been deferred.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic, *, rate: float = 0.0,
                 wall: Callable[[], float] = time.time, bulk_interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.rate = rate  # most outputs a second (0: no bound); the interval grows with the requests deferred
        self.bulk_interval_s = bulk_interval_s
        self._clock = clock
        self._wall = wall  # stamps starts (epoch seconds, as the jobs' enqueue times)
        self._deferred: dict[str, RequestOutput] = {}
        self._urgent: dict[str, None] = {}  # deferred requests to send now (an ordered set)
        self._held: set[str] = set()  # bulk requests (hold())
        self._last = clock()
        self._last_bulk = self._last

    @property
    def deferring(self) -> bool:
        return bool(self._deferred)

    @property
    def deferred(self) -> Mapping[str, RequestOutput]:
        """The merged output deferred for each request: a step may write its tokens into them in place (and pass
        them to :meth:`push` as its own), instead of making a record per request per step to merge."""
        return self._deferred

    def hold(self, rid: str) -> None:
        """``rid`` is a bulk request: its outputs go out with its end (or every ``bulk_interval_s``)."""
        self._held.add(rid)

    def interval(self) -> float:
        """Seconds between sends: ``interval_s``, or longer while more requests are deferred than ``rate`` allows."""
        if self.rate <= 0:
            return self.interval_s
        return max(self.interval_s, (len(self._deferred) - len(self._held)) / self.rate)

    def push(self, outs: list[RequestOutput], flush: bool = False) -> list[RequestOutput]:
        """Take one step's outputs (the pacer owns them now); return what is due, merged per request
        (``flush``: everything)."""
        deferred, held = self._deferred, self._held
        for out in outs:
            if out.started and not out.started_at:
                out.started_at = self._wall()
            acc = deferred.get(out.rid)
            if acc is None:
                deferred[out.rid] = out
            elif acc is not out:  # (the deferred output itself, written in place by the step: nothing to merge)
                merge_into(acc, out)
            if out.finish is not None:
                self._urgent[out.rid] = None
                held.discard(out.rid)
            elif out.token_ids and out.completion_tokens == len(out.token_ids) and out.rid not in held:
                self._urgent[out.rid] = None  # its first token (completion_tokens counts it)
        now = self._clock()
        due_all = now - self._last >= self.interval()
        if flush or (due_all and (not held or now - self._last_bulk >= self.bulk_interval_s)):
            self._last = self._last_bulk = now
            due = list(deferred.values())
            deferred.clear()
        elif due_all:  # all but the bulk requests' (the urgent ones are among them: none is held)
            self._last = now
            due = [out for rid, out in deferred.items() if rid not in held]
            for out in due:
                del deferred[out.rid]
        elif self._urgent:
            due = [deferred.pop(rid) for rid in self._urgent]
        else:
            return []
        self._urgent.clear()
        return due
