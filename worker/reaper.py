"""Finds jobs whose worker died (or froze) and gets them going again, and ends queued jobs that expired.

Every worker sweeps the running jobs every few seconds. One whose lease expired lost its worker: while tries
remain the reaper hands it back to its queue with a ``reset`` event, so any worker runs it again at once;
on its last try (or if its record is gone) it ends it with an error. The reaper owns no run: its writes go
through only while nobody holds the lease and the job's log is as the sweep read it, so two reapers never
both act on one job, and a worker that wakes up later finds its lease gone. The reaper finds the jobs; the run
table (worker/jobs/table.py) picks and writes each one's reset or end.

Each sweep also ends every job of any queue under the prefix (models nobody serves included) that was still
queued when its expiry passed, with ``error(expired)`` (or ``done(cancelled)`` when a cancel was waiting).
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from .jobs.table import RunTable

__all__ = ["Reaper"]

log = logging.getLogger(__name__)


class Reaper:
    """Sweeps for lost jobs every ``interval_s``; the run table (``runs``) ends or hands back each."""

    def __init__(self, runs: RunTable, max_tries: int, interval_s: float) -> None:
        self.runs = runs
        self.max_tries = max_tries
        self.interval_s = interval_s
        self.reaped = 0
        self.expired = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
                await self.lapse()
            except (RedisError, OSError) as exc:
                log.warning("reaper sweep failed: %r", exc)

    async def sweep(self) -> list[str]:
        """Hand back or end every running job whose lease expired; the ids this reaper acted on."""
        acted = []
        for lost in await self.runs.transitions.sweep():
            if await self.runs.reap(lost, self.max_tries):
                self.reaped += 1
                acted.append(lost.rid)
        return acted

    async def lapse(self) -> list[str]:
        """End every queued job whose expiry passed; the ids this reaper ended."""
        ended = await self.runs.expire(await self.runs.transitions.lapsed())
        self.expired += len(ended)
        return [job.rid for job in ended]
