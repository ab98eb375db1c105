"""A worker's health record: what it serves and how busy it is, in Redis for clients, `mlxq status`, `mlxq
health` and the gateway (``api.registry`` reads it).

Every ``interval_s`` one pipeline writes the record (``<prefix>:worker:<id>``, TTL three intervals) and the
heartbeat's time into ``<prefix>:workers``; a clean stop deletes both, a crash leaves the record to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from mlxq.api.protocol.keys import REGISTRY_TTL_S, Keys
from mlxq.api.schema import WorkerStatus

__all__ = ["HealthReporter", "TokenRate", "package_version"]

log = logging.getLogger(__name__)

RECORD_TTL_INTERVALS = 3


def package_version() -> str:
    """mlxq's installed version (for the health record)."""
    try:
        return importlib.metadata.version("mlxq")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class TokenRate:
    """Tokens per second over a sliding window, from a running count sampled at each heartbeat."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, total: int) -> float:
        """Record the running count ``total`` now; the rate over the window (or since the first sample)."""
        now = self._clock()
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0


class HealthReporter:
    """Writes ``snapshot()`` as this worker's health record every ``interval_s`` until cancelled."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, snapshot: Callable[[], WorkerStatus],
                 interval_s: float = 2.0, before: Callable[[], Awaitable[None]] | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.before = before  # reads what the record needs from Redis (each beat, before the snapshot)
        self._failing = False

    async def run(self) -> None:
        """Beat every ``interval_s`` (the first beat is the starter's: the worker is ready once it is written)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.beat()

    async def beat(self) -> None:
        """Write the record now (failures are logged once, then retried at the next beat)."""
        ttl_ms = int(self.interval_s * RECORD_TTL_INTERVALS * 1000)
        try:
            if self.before is not None:
                await self.before()
            record = self.snapshot().model_dump_json()
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.keys.worker(self.worker_id), record, px=ttl_ms)
                pipe.zadd(self.keys.workers(), {self.worker_id: int(time.time() * 1000)})
                pipe.expire(self.keys.workers(), REGISTRY_TTL_S)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("could not write this worker's health record: %r", exc)
            self._failing = True
            return
        self._failing = False

    async def remove(self) -> None:
        """Take the record away (a clean stop): readers see the worker gone at once."""
        with contextlib.suppress(RedisError, OSError):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.keys.worker(self.worker_id))
                pipe.zrem(self.keys.workers(), self.worker_id)
                await pipe.execute()
