"""A :class:`Client` over fakeredis with one worker (``w``) serving model ``m``: the queue as a producer sees it,
for tests whose fake worker then plays the worker's part."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import fakeredis

from mlxq.api.client import Client
from mlxq.api.schema import ModelState, ModelStatus, WorkerStatus


@asynccontextmanager
async def served_client(capacity: int) -> AsyncIterator[Client]:
    """A client (prefix ``t``) whose Redis says worker ``w`` serves ``m`` with ``capacity`` slots."""
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    c = Client(prefix="t", redis=redis)
    now = time.time()
    status = WorkerStatus(id="w", host="h", pid=1, version="0", started_at=now, updated_at=now,
                          models=[ModelStatus(name="m", state=ModelState.SERVING, capacity=capacity)])
    await redis.set(c.keys.worker("w"), status.model_dump_json())
    await redis.zadd(c.keys.workers(), {"w": int(now * 1000)})
    try:
        yield c
    finally:
        await c.aclose()
        await redis.aclose()
