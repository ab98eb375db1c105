"""Batches a worker's engine outputs for its run table (worker/lifecycle.py): one apply, so one EMIT call, per batch.

Engine outputs arrive from the MLX threads (via ``loop.call_soon_threadsafe``) and queue up while a write is
in flight; each batch carries every queued output of every job, coalesced to one per job, so Redis sees at
most one round trip per engine step whatever the batch size, and the next step never waits for Redis. What
the outputs mean (events, ends, fences) is the table's to decide; a cancel it queues here lands after the
job's outputs already queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from mlxq.engine.request import FinishReason, RequestOutput, coalesce

__all__ = ["Publisher"]

Apply = Callable[[list[RequestOutput], bool], Awaitable[None]]  # a batch, and whether engine steps made it


class Publisher:
    """Queues engine outputs and cancelled ends; hands each batch to ``apply`` (``RunTable.apply``)."""

    def __init__(self, apply: Apply) -> None:
        self._apply = apply
        self._pending: list[RequestOutput] = []
        self._cancels = 0  # of _pending, synthetic cancel ends
        self._wake = asyncio.Event()

    def feed(self, outs: Sequence[RequestOutput]) -> None:
        """Queue engine outputs (call on the event loop thread)."""
        self._pending.extend(outs)
        self._wake.set()

    def feed_cancel(self, rid: str) -> None:
        """Queue a job's cancelled end, in order with its engine outputs."""
        self._pending.append(RequestOutput(rid, finish=FinishReason.CANCELLED))
        self._cancels += 1
        self._wake.set()

    async def run(self) -> None:
        """Hand queued outputs to the table, a batch at a time, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            only_cancels, self._cancels = len(batch) == self._cancels, 0
            await self._apply(coalesce(batch), not only_cancels)
