"""arq worker settings, configured from the environment: run ``arq worker.Settings``.

One arq queue per model (``<prefix>:queue:<name>``), JSON job payloads, a short poll delay, ``max_jobs``
above the batch capacity, and a health-check key per worker. The model loads at start-up on its MLX thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from arq.worker import func

from api.connection import JOB_FUNCTION, dumps_job, loads_job, redis_settings

from . import claims, runner, waker, watchdog
from .config import WorkerConfig
from .service import ModelService

__all__ = ["Settings", "worker_settings"]


def worker_settings(config: WorkerConfig) -> dict[str, Any]:
    """Keyword arguments for ``arq.Worker`` serving ``config.model``."""

    async def startup(ctx: dict[str, Any]) -> None:
        _configure_logging()
        ctx[runner.SERVICE] = await ModelService.start(config)

    async def shutdown(ctx: dict[str, Any]) -> None:
        service: ModelService | None = ctx.get(runner.SERVICE)
        if service is not None:
            await service.aclose()

    async def generate(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> str:
        # arq needs a function to register; worker.runner runs mlxq's jobs without calling it.
        raise RuntimeError("mlxq jobs run through worker.runner, which this process did not install")

    async def after_job_end(ctx: dict[str, Any]) -> None:
        # A slot is free: if the last poll left jobs queued, let arq take the next one now rather than at its
        # next poll. Two hops, so the wake lands after arq's done-callback has released the job's slot
        # (max_jobs). Without a backlog there is nothing to take: a poll per job end was 16 % of the event
        # loop's time in a burst of 1-token jobs.
        if ctx.get(claims.BACKLOG):
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, waker.wake)

    timeout = config.arq_job_timeout_s
    return {
        "functions": [func(generate, name=JOB_FUNCTION, timeout=timeout, max_tries=config.max_tries)],
        "queue_name": config.queue_name,
        "redis_settings": redis_settings(config.redis_url),
        "on_startup": startup,
        "on_shutdown": shutdown,
        "after_job_end": after_job_end,
        "max_jobs": config.arq_max_jobs,
        "poll_delay": config.poll_delay_s,
        "job_timeout": timeout,
        "max_tries": config.max_tries,
        "keep_result": config.keep_result_s,
        "job_serializer": dumps_job,
        "job_deserializer": functools.partial(loads_job, max_bytes=config.max_payload_bytes),
        "health_check_key": f"{config.queue_name}:health:{config.worker_id}",
        "health_check_interval": 10,
        # SIGTERM: stop taking jobs, let running ones finish for this long, then cancel (arq re-queues them).
        "job_completion_wait": config.drain_timeout_s,
        # A shutdown still running this long after the drain dumps every thread's stack and exits 1.
        "ctx": {watchdog.GRACE: config.shutdown_grace_s},
    }


def _configure_logging() -> None:
    # arq's CLI configures only the "arq" logger; give ours the same treatment unless the host app did.
    for name in ("worker", "engine", "api"):
        logger = logging.getLogger(name)
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


waker.install()
claims.install()
watchdog.install()


class Settings:
    """``arq worker.Settings``: the worker for ``MLXQ_MODEL`` (attributes filled from the environment)."""


for _name, _value in worker_settings(WorkerConfig.from_env()).items():
    setattr(Settings, _name, _value)
