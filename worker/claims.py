"""Claim every job one arq poll found in one Redis call, instead of arq's four round trips per job.

arq 0.28's ``Worker.start_jobs`` claims queued jobs one at a time: WATCH the job's in-progress key, EXISTS,
ZSCORE, then MULTI/PSETEX/EXEC, awaiting each. When 32 jobs arrive together the engine waits for 128
sequential round trips (and the event loop's GIL time) before the last one can join the batch. The CLAIM
script makes the same check-and-set per job, atomically, for all of them at once; what runs each job
(``Worker.run_job``, its timeout, retries, result keys) stays arq's own. A worker serving a model goes
further: its START script claims and starts the jobs in the same call, and ``runner.py`` runs them.

:func:`install` replaces ``arq.worker.Worker.start_jobs`` (pinned arq 0.28) with :func:`start_jobs`.
"""

from __future__ import annotations

import arq.worker
from arq.constants import in_progress_key_prefix
from arq.utils import timestamp_ms

from . import runner
from .scripts import CLAIM, Script

__all__ = ["BACKLOG", "install", "start_jobs"]


_CLAIM = Script.of(CLAIM)
BACKLOG = "mlxq_backlog"  # arq ctx key: the last poll left jobs queued that a free slot could take


async def start_jobs(self: arq.worker.Worker, job_ids: list[bytes]) -> None:
    """Drop-in for ``Worker.start_jobs``: claim as many of ``job_ids`` as slots are free in one call, start each.

    Jobs another worker (or this one) already holds are skipped without taking a slot, as arq does. An mlxq
    worker's claim also starts its jobs (``runner.py``).
    """
    free = self.max_jobs - self.job_counter
    # Jobs left queued, or every slot taken (arq does not poll a full worker, so jobs enqueued meanwhile wait
    # for a slot): a job's end wakes the poll for them (settings.after_job_end). A read of queue_read_limit
    # ids may have left more behind.
    self.ctx[BACKLOG] = len(job_ids) >= free or len(job_ids) >= self.queue_read_limit
    if free <= 0 or not job_ids:
        return
    ids = [j.decode() for j in job_ids]
    if runner.SERVICE in self.ctx:
        return await runner.start_jobs(self, ids, free)
    keys = [self.queue_name, *(in_progress_key_prefix + j for j in ids)]
    claimed = await _CLAIM.run(self.pool, keys, [timestamp_ms(), int(self.in_progress_timeout_s * 1000), free, *ids])
    for job_id_b, score in zip(claimed[::2], claimed[1::2]):
        job_id = job_id_b.decode()
        await runner.spawn(self, job_id, self.run_job(job_id, int(score)))


def install() -> None:
    """Use :func:`start_jobs` in every arq worker of this process (idempotent)."""
    arq.worker.Worker.start_jobs = start_jobs  # type: ignore[method-assign]
