"""Tenants on real workers (the tiny model): a tenant's max-running holds on two workers at once, checked from
its jobs' start and end events, and two backlogged tenants share one worker's work by their weights."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api import tenants
from mlxq.api.client import Client
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import DoneEvent
from tests.support import config_with, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KEYS = Keys("mlxq")


async def follow(client: Client, rid: str, log: list[tuple[float, str, str]], tenant: str) -> DoneEvent:
    """The job's events to its end; its start and end go into ``log`` (one subscription: publish order)."""
    end = None
    async for ev in client.events(rid, timeout=120):
        if ev.type == "start":
            log.append((time.monotonic(), "start", tenant))
        elif ev.type == "reset":
            log.append((time.monotonic(), "end", tenant))  # its next run starts again
        elif isinstance(ev, DoneEvent):
            log.append((time.monotonic(), "end", tenant))
            end = ev
    assert end is not None
    return end


async def test_max_running_2_never_has_a_third_job_running_on_two_workers(worker_config: Any, redis_url: str
                                                                          ) -> None:
    r = aredis.Redis.from_url(redis_url)
    w1 = await start_worker(config_with(worker_config, worker_id="w1"))
    w2 = await start_worker(config_with(worker_config, worker_id="w2"))
    try:
        async with Client(redis_url) as admin:
            await admin.set_tenant("acme", max_running=2)
        log: list[tuple[float, str, str]] = []
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, int(await r.hget(KEYS.tenants_running(), "acme") or 0))  # type: ignore[misc]
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        async with Client(redis_url) as c:
            jobs = [(await c.submit(model="tiny", prompt=f"job {i}", max_tokens=24, tenant=t), t)
                    for i in range(12) for t in ("acme", "globex")]
            await asyncio.gather(*(follow(c, rid, log, t) for rid, t in jobs))
        watcher.cancel()
        running, most = 0, 0
        for _, what, tenant in sorted(log):
            if tenant == "acme":
                running += 1 if what == "start" else -1
                most = max(most, running)
        assert most == 2 and peak == 2  # reached, never passed
        assert int(await r.hget(KEYS.tenants_running(), "acme") or 0) == 0  # type: ignore[misc]
        assert w1.worker.jobs_complete > 0 and w2.worker.jobs_complete > 0  # both workers took acme's and others'
        assert w1.worker.jobs_complete + w2.worker.jobs_complete == len(jobs)
    finally:
        await w1.close()
        await w2.close()
        await r.aclose()


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
async def test_two_backlogged_tenants_share_one_workers_work_by_weight(worker_config: Any, redis_url: str,
                                                                       weights: tuple[int, int]) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await tenants.store(r, KEYS, "acme", weight=weights[0])
        await tenants.store(r, KEYS, "globex", weight=weights[1])
        async with Client(redis_url) as c:  # both backlogged before the worker starts
            jobs = [(await c.submit(model="tiny", prompt="count to ten", max_tokens=16, tenant=t), t)
                    for _ in range(60) for t in ("acme", "globex")]
            worker = await start_worker(config_with(worker_config, capacity=8))
            try:
                ends: list[tuple[float, str, int]] = []

                async def one(rid: str, tenant: str) -> None:
                    done = await follow(c, rid, [], tenant)
                    ends.append((time.monotonic(), tenant, done.usage.prompt_tokens + done.usage.completion_tokens))

                await asyncio.gather(*(one(rid, t) for rid, t in jobs))
            finally:
                await worker.close()
        ends.sort()
        first_drained = min(max(i for i, e in enumerate(ends) if e[1] == t) for t in ("acme", "globex"))
        both = ends[:first_drained - 8]  # while both were backlogged (the last slots' worth aside)
        work = {t: sum(w for _, tt, w in both if tt == t) for t in ("acme", "globex")}
        want = weights[0] / sum(weights)
        assert abs(work["acme"] / sum(work.values()) - want) <= 0.1 * want, work
    finally:
        await r.aclose()
