"""Claiming arq jobs in one call (worker/claims.py): arq's per-job check-and-set, for many jobs at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aredis
from arq.constants import in_progress_key_prefix
from arq.jobs import Job as ArqJob
from arq.worker import Worker, func

from api.client import Client
from api.connection import JOB_FUNCTION, arq_pool, dumps_job, loads_job, redis_settings
from tests.support import config_with, start_worker
from worker import claims, waker
from worker.scripts import CLAIM, Script

QUEUE = "claims-test:queue"


async def test_claim_takes_due_free_jobs_up_to_the_free_slots(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        now = int(time.time() * 1000)
        await r.zadd(QUEUE, {"a": now - 30, "b": now - 20, "c": now + 60_000, "d": now - 10, "e": now - 5})
        await r.set(in_progress_key_prefix + "b", b"1")  # another worker runs b
        ids = ["a", "b", "c", "d", "e"]
        keys = [QUEUE, *(in_progress_key_prefix + j for j in ids)]
        claimed = await Script.of(CLAIM).run(r, keys, [now, 5000, 2, *ids])
        assert claimed[::2] == [b"a", b"d"]  # b is taken, c not due, e past the two free slots
        assert [int(s) for s in claimed[1::2]] == [now - 30, now - 10]
        for job in ("a", "d"):
            assert 0 < await r.pttl(in_progress_key_prefix + job) <= 5000
        assert not await r.exists(in_progress_key_prefix + "e")
        again = await Script.of(CLAIM).run(r, keys, [now, 5000, 10, *ids])
        assert again[::2] == [b"e"]  # a and d are in progress now
    finally:
        await r.aclose()


@pytest.mark.parametrize("workers", [1, 3])
async def test_competing_workers_run_every_job_once_within_max_jobs(redis_url: str, workers: int) -> None:
    runs: dict[str, int] = {}
    state = {"now": 0, "peak": 0}

    async def job(ctx: dict[str, Any], payload: Any) -> None:
        runs[ctx["job_id"]] = runs.get(ctx["job_id"], 0) + 1
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1

    claims.install()  # as worker/settings.py does
    assert Worker.start_jobs is claims.start_jobs
    max_jobs = 4
    settings = redis_settings(redis_url)
    arq_workers = [
        Worker(functions=[func(job, name=JOB_FUNCTION)], queue_name=QUEUE, redis_settings=settings, max_jobs=max_jobs,
               poll_delay=0.05, handle_signals=False, job_serializer=dumps_job, job_deserializer=loads_job,
               keep_result=1)
        for _ in range(workers)
    ]
    tasks = [asyncio.create_task(w.async_run()) for w in arq_workers]
    producer = arq_pool(redis_url)
    try:
        ids = [f"job-{i}" for i in range(40)]
        for job_id in ids:
            await producer.enqueue_job(JOB_FUNCTION, {"n": job_id}, _job_id=job_id, _queue_name=QUEUE)
        for _ in range(1000):
            if len(runs) == len(ids) and state["now"] == 0:
                break
            waker.wake()
            await asyncio.sleep(0.01)
        assert runs == {job_id: 1 for job_id in ids}
        assert state["peak"] <= max_jobs * workers
        assert sum(w.jobs_complete for w in arq_workers) == len(ids)
        info = await ArqJob(ids[0], producer, _queue_name=QUEUE, _deserializer=loads_job).result_info()
        assert info is not None and info.success and list(info.args) == [{"n": ids[0]}]  # arq's own result record
    finally:
        for w in arq_workers:
            await w.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await producer.aclose()


async def test_jobs_claimed_together_reach_an_idle_engine_in_one_step(worker_config: Any, client: Client) -> None:
    # A long admission bound: a loaded CI machine may take more than the default 10 ms to add six jobs;
    # the engine stops waiting as soon as they are all in.
    running = await start_worker(config_with(worker_config, admit_wait_ms=30_000.0))
    try:
        service = running.service
        running.worker.allow_pick_jobs = False  # let all jobs queue up, then one poll claims them all
        rids = [await client.submit(model="tiny", prompt=f"prompt {i}", max_tokens=4) for i in range(6)]
        backend = service.engine.scheduler.backend
        steps_at_insert: list[int] = []
        insert = backend.insert

        def recording_insert(*args: Any) -> int:
            steps_at_insert.append(service.engine.stats.steps)
            return int(insert(*args))

        backend.insert = recording_insert
        running.worker.allow_pick_jobs = True
        waker.wake()
        for rid in rids:
            assert (await client.result(rid, timeout=30)).usage.completion_tokens == 4
        assert len(steps_at_insert) == 6
        assert len(set(steps_at_insert)) == 1  # all six prefilled in the engine's first step
    finally:
        await running.close()


async def _wake_every(interval: float, times: int, sent: list[int]) -> None:
    for i in range(times):
        await asyncio.sleep(interval)
        waker.wake()
        sent.append(i)


async def test_a_woken_poll_waits_for_the_burst_of_wake_ups_to_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waker, "_BURST_GAP_S", 0.2)  # far above the wake-ups' spacing, even on a loaded machine
    monkeypatch.setattr(waker, "_BURST_MAX_S", 30.0)
    poll = waker.wakeable_poll(60.0)
    await anext(poll)
    sent: list[int] = []
    burst = asyncio.create_task(_wake_every(0.01, 5, sent))
    await anext(poll)  # woken by the first, it polls only once the burst has paused
    assert sent == [0, 1, 2, 3, 4]
    await burst
    await poll.aclose()


async def test_an_endless_stream_of_wake_ups_still_polls_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waker, "_BURST_GAP_S", 0.2)
    monkeypatch.setattr(waker, "_BURST_MAX_S", 0.3)
    poll = waker.wakeable_poll(60.0)
    await anext(poll)
    sent: list[int] = []
    stream = asyncio.create_task(_wake_every(0.01, 10_000, sent))
    await anext(poll)
    assert not stream.done()  # polled while wake-ups kept coming
    stream.cancel()
    await poll.aclose()


async def test_a_poll_cancelled_as_a_wake_up_lands_stays_cancelled() -> None:
    """arq stops its worker by cancelling the poll loop; a job's end may wake the poll in the same pass.
    Python 3.11's wait_for returned the wake-up and dropped the cancel there: the loop polled on and the
    worker hung after SIGTERM (caught by the chaos test, under load)."""
    async def arq_main() -> None:
        async for _ in waker.wakeable_poll(60.0):
            pass

    main = asyncio.create_task(arq_main())
    await asyncio.sleep(0.01)  # main now waits for a wake-up
    waker.wake()
    main.cancel()
    try:
        await asyncio.wait({main}, timeout=5)  # a swallowed cancel polls on for ever
        assert main.cancelled()
    finally:
        main.cancel()
