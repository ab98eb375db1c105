"""``arq worker.Settings``: a worker serving ``MLXQ_MODEL`` (or every model of ``MLXQ_MODELS``), configured
from the environment.

One queue per model (``<prefix>:queue:<name>``), a short poll backed by producers' wake-ups, ``max_jobs``
above the models' batch capacity and a health record per worker. Each model loads at start-up on its own MLX
thread.
"""

from __future__ import annotations

import logging
from typing import Any

from api.arqseam import Host, WorkerSpec
from api.arqseam import worker_settings as arq_worker_settings

from . import watchdog
from .config import WorkerConfig
from .host import WorkerHost

__all__ = ["Settings", "worker_settings"]


def worker_settings(config: WorkerConfig) -> dict[str, Any]:
    """Keyword arguments for ``arq.Worker`` serving ``config.served``."""

    host: WorkerHost | None = None

    async def start() -> Host:
        nonlocal host
        _configure_logging()
        host = await WorkerHost.start(config)
        return host

    def on_stop_signal(drain_s: float) -> None:
        # A shutdown still running this long after the drain dumps every thread's stack and exits 1.
        watchdog.arm(drain_s + config.shutdown_grace_s)
        if host is not None:
            host.drain()

    first = config.keys.queue(config.served[0].name) if config.served else config.keys.queue("")
    return arq_worker_settings(WorkerSpec(
        queue=first,
        redis_url=config.redis_url,
        start=start,
        max_jobs=config.arq_max_jobs,
        poll_delay_s=config.poll_delay_s,
        job_timeout_s=config.arq_job_timeout_s,
        drain_s=config.drain_timeout_s,
        health_key=f"{first}:health:{config.worker_id}",
        on_stop_signal=on_stop_signal,
        on_closed=watchdog.disarm,
    ))


def _configure_logging() -> None:
    # arq's CLI configures only the "arq" logger; give ours the same treatment unless the host app did.
    for name in ("worker", "engine", "api"):
        logger = logging.getLogger(name)
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


class Settings:
    """``arq worker.Settings``: the worker for ``MLXQ_MODEL`` or ``MLXQ_MODELS`` (attributes filled from the
    environment)."""


for _name, _value in worker_settings(WorkerConfig.from_env()).items():
    setattr(Settings, _name, _value)
