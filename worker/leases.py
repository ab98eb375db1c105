"""Keeps a worker's leases: proof, refreshed every TTL/3, that a live worker still runs its jobs.

A run whose lease is no longer its own, or every run when Redis stayed unreachable for a whole TTL, is
handed to ``on_lost`` (the run table's ``lose``): by then the reaper may have handed its job to another worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from redis.exceptions import RedisError

from .jobs.run import Run
from .jobs.transitions import Transitions

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Refreshes the leases of ``runs``; awaits ``on_lost(runs)`` with those it can no longer vouch for."""

    def __init__(self, transitions: Transitions, runs: Mapping[str, Run], ttl_s: float,
                 on_lost: Callable[[list[Run]], Awaitable[None]]) -> None:
        self.transitions = transitions
        self.runs = runs
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self._last_ok = time.monotonic()

    async def run(self) -> None:
        """Refresh every ttl/3 until cancelled."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self.refresh()

    async def refresh(self) -> None:
        """One round trip: extend every lease still ours; the rest are lost."""
        runs = list(self.runs.values())
        if not runs:
            self._last_ok = time.monotonic()
            return
        try:
            held = await self.transitions.refresh(runs)
        except (RedisError, OSError) as exc:
            log.warning("lease refresh failed: %r", exc)
            if time.monotonic() - self._last_ok > self.ttl_s:
                await self._lose(runs, "Redis unreachable for a whole lease TTL")
            return
        self._last_ok = time.monotonic()
        await self._lose([r for r, ok in zip(runs, held) if not ok and r.rid in self.runs], "lease taken or expired")

    async def _lose(self, runs: list[Run], why: str) -> None:
        if runs:
            for run in runs:
                log.warning("job %s: %s", run.rid, why)
            await self.on_lost(runs)
