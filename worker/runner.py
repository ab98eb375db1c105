"""Runs an mlxq worker's jobs inside arq's Worker, in place of arq's ``run_job``.

arq 0.28 claims a job with four round trips, then its ``run_job`` costs two MULTI/EXEC transactions (read
the job and count the try; delete its keys and store its result), two INFO log lines and a task with a
timer, all on the event loop that shares the GIL with the engine. Here one START call claims every job a
poll found, reads each, counts its try and takes its lease, and the EMIT call that publishes a job's
terminal event also finishes its arq job (``worker/scripts.py``): the loop's CPU per 1-token job on the
tiny model went from 1.19 ms to 0.66 ms. Everything else about the Worker stays arq's: its poll loop,
``max_jobs``, health checks, signals and the SIGTERM drain, which cancels these tasks after
``job_completion_wait``.

``claims.start_jobs`` (installed over arq's) hands a worker with an mlxq service in its context
(``SERVICE``) to :func:`start_jobs`; any other Worker keeps arq's claim and ``run_job``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import arq.worker

if TYPE_CHECKING:
    from .service import ModelService, Started

__all__ = ["SERVICE", "run_started", "spawn", "start_jobs"]

log = logging.getLogger(__name__)

SERVICE = "mlxq"  # arq ctx key of the worker's ModelService


async def start_jobs(worker: arq.worker.Worker, job_ids: list[str], free: int) -> None:
    """Claim and start up to ``free`` of ``job_ids`` in one call; run each started job in a task of its own."""
    service: ModelService = worker.ctx[SERVICE]
    started = await service.claim(job_ids, free, int(worker.in_progress_timeout_s * 1000))
    leased = [s for s in started if s.acquired]
    if leased:
        service.on_claimed(len(leased))
    for s in started:
        if not s.acquired:
            worker.jobs_retried += 1
            log.info("job %s: another run holds its lease; deferred", s.rid)
    for s in leased:
        await spawn(worker, s.rid, run_started(worker, service, s))


async def spawn(worker: arq.worker.Worker, job_id: str, run: Coroutine[Any, Any, None]) -> None:
    """Run a claimed job in a slot of the worker's own, with arq's bookkeeping (``max_jobs``, ``tasks``)."""
    await worker.sem.acquire()  # free slots were counted by the claim: never waits
    worker.job_counter += 1
    task = worker.loop.create_task(run)
    task.add_done_callback(lambda _: worker._release_sem_dec_counter_on_complete())
    worker.tasks[job_id] = task


async def run_started(worker: arq.worker.Worker, service: ModelService, start: Started) -> None:
    """One started job, to its terminal event (or handed back), with arq's job timeout and counters."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(service.config.arq_job_timeout_s):  # a backstop: the engine's deadline is first
            outcome = await service.run(start, worker.job_deserializer or _no_deserializer)
    except asyncio.CancelledError:  # shutdown: the service handed the job back, or failed it on its last try
        worker.jobs_retried += 1
        log.info("job %s: cancelled after %.2fs (worker shutting down)", start.rid, time.monotonic() - t0)
        return  # as arq's run_job: the task ends quietly, so arq's poll loop never re-raises it
    except TimeoutError:
        worker.jobs_failed += 1
        log.warning("job %s: ran past the arq job timeout (%.0fs); handed back or failed",
                    start.rid, service.config.arq_job_timeout_s)
    except Exception:  # a bug: never let it reach arq's poll loop, which re-raises a task's exception and stops
        worker.jobs_failed += 1
        log.exception("job %s: failed", start.rid)
    else:
        if outcome == "fenced":
            worker.jobs_retried += 1
        else:
            worker.jobs_complete += 1
        log.debug("job %s: %s in %.3fs", start.rid, outcome, time.monotonic() - t0)
    if worker.after_job_end is not None:
        try:
            await worker.after_job_end(worker.ctx)
        except Exception:
            log.exception("after_job_end failed")


def _no_deserializer(data: bytes) -> dict[str, Any]:
    raise RuntimeError("an mlxq worker needs its JSON job_deserializer (worker.settings)")
