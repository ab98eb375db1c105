"""Runs an mlxq worker's jobs inside arq's Worker: arq's ``run_job``, fused with the job's start and end.

arq 0.28's ``Worker.run_job`` costs every job two MULTI/EXEC transactions (read the job and count the
try; then delete its keys and store its result), two INFO log lines and a task with a timer, on the event
loop that shares the GIL with the engine: about a third of the loop's CPU per job on the tiny model. Here
the START script reads the job, counts the try and takes the lease in one call, and the EMIT call that
publishes the job's terminal event also finishes the arq job (``worker/scripts.py``). Everything else
about the Worker stays arq's: its poll loop, claims (``claims.py``), ``max_jobs``, health checks, signals
and the SIGTERM drain, which cancels these tasks after ``job_completion_wait``.

:func:`install` replaces ``arq.worker.Worker.run_job`` (pinned arq 0.28); a Worker without an mlxq
service in its context (``SERVICE``) keeps arq's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import arq.worker

if TYPE_CHECKING:
    from .service import ModelService

__all__ = ["SERVICE", "install", "run_job"]

log = logging.getLogger(__name__)

SERVICE = "mlxq"  # arq ctx key of the worker's ModelService
_ARQ_RUN_JOB = arq.worker.Worker.run_job


async def run_job(self: arq.worker.Worker, job_id: str, score: int) -> None:
    """Drop-in for ``Worker.run_job``: one claimed job, from START to its terminal event (or handed back)."""
    service: ModelService | None = self.ctx.get(SERVICE)
    if service is None:
        return await _ARQ_RUN_JOB(self, job_id, score)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(service.config.arq_job_timeout_s):  # a backstop: the engine's deadline is first
            outcome = await service.run(job_id, self.job_deserializer or _no_deserializer)
    except asyncio.CancelledError:  # shutdown: the service handed the job back, or failed it on its last try
        self.jobs_retried += 1
        log.info("job %s: cancelled after %.2fs (worker shutting down)", job_id, time.monotonic() - t0)
        return  # as arq's run_job: the task ends quietly, so arq's poll loop never re-raises it
    except TimeoutError:
        self.jobs_failed += 1
        log.warning("job %s: ran past the arq job timeout (%.0fs); handed back or failed",
                    job_id, service.config.arq_job_timeout_s)
    else:
        if outcome in ("deferred", "fenced"):
            self.jobs_retried += 1
        else:
            self.jobs_complete += 1
        log.debug("job %s: %s in %.3fs", job_id, outcome, time.monotonic() - t0)
    if self.after_job_end is not None:
        await self.after_job_end(self.ctx)


def _no_deserializer(data: bytes) -> dict[str, Any]:
    raise RuntimeError("an mlxq worker needs its JSON job_deserializer (worker.settings)")


def install() -> None:
    """Use :func:`run_job` in every arq worker of this process (idempotent)."""
    arq.worker.Worker.run_job = run_job  # type: ignore[method-assign]
