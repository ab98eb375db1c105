"""Finds jobs whose worker died (or froze) and gets them going again.

Every worker sweeps the running jobs every few seconds. One whose lease expired lost its worker: while tries
remain the reaper hands it back to its queue with a ``reset`` event, so any worker runs it again at once;
on its last try (or if its record is gone) it ends it with an error. The reaper owns no run: its writes go
through only while nobody holds the lease and the job's log is as the sweep read it, so two reapers never
both act on one job, and a worker that wakes up later finds its lease gone (worker/lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from api.schema import ErrorCode

from .lifecycle import Lifecycle, Lost, Record, Write

__all__ = ["Reaper"]

log = logging.getLogger(__name__)


class Reaper:
    """Sweeps for lost jobs every ``interval_s``."""

    def __init__(self, lifecycle: Lifecycle, max_tries: int, interval_s: float) -> None:
        self.lifecycle = lifecycle
        self.max_tries = max_tries
        self.interval_s = interval_s
        self.reaped = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except (RedisError, OSError) as exc:
                log.warning("reaper sweep failed: %r", exc)

    async def sweep(self) -> list[str]:
        """Hand back or end every running job whose lease expired; the ids this reaper acted on."""
        acted = []
        for lost in await self.lifecycle.sweep():
            if await self._reap(lost):
                acted.append(lost.rid)
        return acted

    async def _reap(self, lost: Lost) -> bool:
        run = self.lifecycle.orphan(lost)
        if lost.tries < self.max_tries and lost.has_record:
            record = Record(run, [run.reset("worker lost; job re-queued")], Write.HAND_BACK)
            what = "re-queued"
        elif lost.has_record:
            msg = f"the worker running this job was lost (try {lost.tries} of {self.max_tries})"
            record = Record(run, [run.error(ErrorCode.WORKER_LOST, msg)], Write.END)
            what = "failed on its last try"
        else:
            msg = "the worker running this job was lost, and the job's record is gone from Redis: it cannot run again"
            record = Record(run, [run.error(ErrorCode.DATA_LOST, msg)], Write.END)
            what = "failed (its record is gone)"
        (ok,) = await self.lifecycle.write([record])
        if ok:
            self.reaped += 1
            log.info("job %s: its worker was lost; %s", lost.rid, what)
        return ok
