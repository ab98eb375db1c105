"""Leases on running jobs: proof that a live worker is still running them.

Each running job's lease (``<prefix>:{rid}:lease`` = this run's token) has a short TTL, refreshed for all
of a worker's jobs in one pipeline every ttl/3. A job whose lease is no longer ours, or every job when
Redis stayed unreachable for a whole TTL, is fenced: the worker stops it and publishes nothing more for it,
because by then the reaper may have handed it to another worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.keys import Keys

from .job import Job
from .scripts import REFRESH, Script, is_noscript

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Refreshes the leases of ``jobs``; calls ``on_lost(job)`` for each job it can no longer vouch for."""

    def __init__(self, redis: Redis, keys: Keys, jobs: dict[str, Job], ttl_s: float,
                 on_lost: Callable[[Job], None]) -> None:
        self.redis = redis
        self.keys = keys
        self.jobs = jobs
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self._script: Script | None = None
        self._last_ok = time.monotonic()

    async def start(self) -> None:
        self._script = await Script.load(self.redis, REFRESH)

    async def run(self) -> None:
        """Refresh every ttl/3 until cancelled."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self.refresh()

    async def refresh(self) -> None:
        """One round trip: extend every lease still ours; fence the rest."""
        assert self._script is not None
        jobs = [j for j in self.jobs.values() if j.token]
        if not jobs:
            self._last_ok = time.monotonic()
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            self._script.call(pipe, [self.keys.lease(job.rid)], [job.token, int(self.ttl_s * 1000)])
        try:
            results = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            log.warning("lease refresh failed: %r", exc)
            if time.monotonic() - self._last_ok > self.ttl_s:
                self._lose(jobs, "Redis unreachable for a whole lease TTL")
            return
        if any(is_noscript(r) for r in results):
            await self._script.reload(self.redis)
            return
        self._last_ok = time.monotonic()
        self._lose([j for j, r in zip(jobs, results) if r != 1], "lease taken or expired")

    def _lose(self, jobs: list[Job], why: str) -> None:
        for job in jobs:
            log.warning("job %s: %s; fencing it", job.rid, why)
            self.on_lost(job)
