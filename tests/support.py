"""Helpers shared by tests: an in-process arq worker on the test's event loop."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any


class RunningWorker:
    """A real arq Worker running on the test's event loop."""

    def __init__(self, worker: Any, task: asyncio.Task[None]) -> None:
        self.worker = worker
        self.task = task

    @property
    def host(self) -> Any:
        """The worker's host (worker/host.py): claims, runs, the shared loops."""
        from mlxq.worker.arqseam import host_of

        return host_of(self.worker)

    @property
    def service(self) -> Any:
        """The one model it serves (worker/service.py)."""
        (service,) = self.host.services.values()
        return service

    async def close(self, drain_s: float = 10.0) -> None:
        # Like a SIGTERM with job_completion_wait: stop taking jobs and let running ones finish, since
        # arq's close() cancels whatever is still running (even a job recording its result).
        self.worker.allow_pick_jobs = False
        for _ in range(int(drain_s / 0.01)):
            if all(t.done() for t in self.worker.tasks.values()):
                break
            await asyncio.sleep(0.01)
        await self.worker.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def start_worker(config: Any, **overrides: Any) -> RunningWorker:
    from arq.worker import Worker

    from mlxq.worker.settings import worker_settings

    worker = Worker(**{**worker_settings(config), "handle_signals": False, **overrides})
    task = asyncio.create_task(worker.async_run())
    from mlxq.worker.arqseam import host_of

    for _ in range(600):
        if host_of(worker) is not None:
            return RunningWorker(worker, task)
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    raise RuntimeError("worker did not start")


def config_with(config: Any, **changes: Any) -> Any:
    return replace(config, **changes)


async def enqueue_raw(redis_url: str, payload: Any, job_id: str, model: str = "tiny", prefix: str = "mlxq") -> None:
    """Queue a job record around any payload, as a producer other than ``Client`` might."""
    import time

    import redis.asyncio as aredis

    from mlxq.api.jobrecord import job_record
    from mlxq.api.keys import Keys

    keys, now = Keys(prefix), int(time.time() * 1000)
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(keys.job(job_id), job_record(payload, now), px=86_400_000)
        await r.zadd(keys.queue(model), {job_id: now})
    finally:
        await r.aclose()
