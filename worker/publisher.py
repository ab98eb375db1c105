"""Batches a worker's engine outputs and cancels for its run table (worker/jobs/table.py): one apply, so one EMIT
call, per batch.

Engine outputs arrive from the MLX threads (via ``loop.call_soon_threadsafe``) and queue up while a write is
in flight; each batch carries every queued output of every job, coalesced to one per job, so Redis sees at
most one round trip per engine step whatever the batch size, and the next step never waits for Redis. What
the outputs mean (events, ends, fences) is the table's to decide. A cancel the table queues here comes back
with the batch, after the job's outputs queued before it; the job's outputs queued after it are dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from mlxq.engine.core.request import RequestOutput, coalesce

__all__ = ["Publisher"]

# A batch: its outputs, the jobs cancelled after them, and whether engine steps made any (``RunTable.apply``)
Apply = Callable[[list[RequestOutput], list[str], bool], Awaitable[None]]


class Publisher:
    """Queues engine outputs and cancels; hands each batch to ``apply`` (``RunTable.apply``)."""

    def __init__(self, apply: Apply) -> None:
        self._apply = apply
        self._pending: list[RequestOutput] = []
        self._cancels: dict[str, int] = {}  # job id -> how many of _pending were queued before its cancel
        self._wake = asyncio.Event()

    def feed(self, outs: Sequence[RequestOutput]) -> None:
        """Queue engine outputs (call on the event loop thread)."""
        self._pending.extend(outs)
        self._wake.set()

    def cancel(self, rid: str) -> None:
        """Queue a job's cancel, in order with its engine outputs."""
        self._cancels.setdefault(rid, len(self._pending))
        self._wake.set()

    async def run(self) -> None:
        """Hand queued outputs and cancels to the table, a batch at a time, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, cancels = self._pending, self._cancels
            self._pending, self._cancels = [], {}
            outs = [out for i, out in enumerate(batch) if i < cancels.get(out.rid, i + 1)] if cancels else batch
            await self._apply(coalesce(outs), list(cancels), bool(batch))
