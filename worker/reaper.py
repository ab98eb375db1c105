"""Finds jobs whose worker died (or froze) and gets them going again, and ends queued jobs that expired.

Every worker sweeps the running jobs every few seconds. One whose lease expired lost its worker: while tries
remain the reaper hands it back to its queue with a ``reset`` event, so any worker runs it again at once;
on its last try (or if its record is gone) it ends it with an error. The reaper owns no run: its writes go
through only while nobody holds the lease and the job's log is as the sweep read it, so two reapers never
both act on one job, and a worker that wakes up later finds its lease gone (worker/lifecycle.py).

Each sweep also ends every job of any queue under the prefix (models nobody serves included) that was still
queued when its expiry passed, with ``error(expired)`` (or ``done(cancelled)`` when a cancel was waiting).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from mlxq.api.schema import ErrorCode, FinishReason

from .lifecycle import Lapsed, Lifecycle, Lost, Record, Write

__all__ = ["Reaper"]

log = logging.getLogger(__name__)


class Reaper:
    """Sweeps for lost jobs every ``interval_s``."""

    def __init__(self, lifecycle: Lifecycle, max_tries: int, interval_s: float) -> None:
        self.lifecycle = lifecycle
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
        for lost in await self.lifecycle.sweep():
            if await self._reap(lost):
                acted.append(lost.rid)
        return acted

    async def lapse(self) -> list[str]:
        """End every queued job whose expiry passed; the ids this reaper ended."""
        lapsed = await self.lifecycle.lapsed()
        if not lapsed:
            return []
        records = [self._lapse_record(job) for job in lapsed]
        ended = [job for job, ok in zip(lapsed, await self.lifecycle.write(records)) if ok]
        for job in ended:
            log.info("job %s: still queued on %s when it expired; ended", job.rid, job.queue)
        self.expired += len(ended)
        return [job.rid for job in ended]

    def _lapse_record(self, job: Lapsed) -> Record:
        run = self.lifecycle.expiring(job)
        if job.cancelled:
            return Record(run, [run.done(FinishReason.CANCELLED)], Write.EXPIRE)
        waited = f" {time.time() - job.enqueue_ms / 1000:.0f}s" if job.enqueue_ms else ""
        msg = f"no worker took the job before it expired (it waited{waited} on {job.queue}); see `mlxq status`"
        return Record(run, [run.error(ErrorCode.EXPIRED, msg)], Write.EXPIRE)

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
