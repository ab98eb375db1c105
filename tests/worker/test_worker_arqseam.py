"""arq behind one seam (worker/arqseam.py): claims in one call, the wakeable poll, poison entries, the version check."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import arq.utils
import arq.worker
import pytest
import redis.asyncio as aredis
from arq.connections import RedisSettings, create_pool
from arq.worker import Worker, func

from mlxq.api.client import Client
from mlxq.worker import arqseam
from tests.support import config_with, start_worker

QUEUE = "plain-arq:queue"


async def test_a_plain_arq_worker_in_the_same_process_keeps_arqs_own_claim_and_run(
        redis_url: str, worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert getattr(Worker, "_mlxq", False)  # the seam is applied to arq's class (the mlxq worker runs beside)
    polls: list[tuple[str, float]] = []  # which poll each Worker.main started from now on took, and its step

    def spy(name: str, poll: Callable[[float], AsyncGenerator[float, None]]) -> None:
        def record(step: float = 0.5) -> AsyncGenerator[float, None]:
            polls.append((name, step))
            return poll(step)

        monkeypatch.setattr(arqseam, name, record)

    spy("_arq_poll", arqseam._arq_poll)
    spy("_wakeable_poll", arqseam._wakeable_poll)
    runs: list[str] = []

    async def job(ctx: dict[str, Any], n: int) -> int:
        runs.append(ctx["job_id"])
        return n * 2

    settings = RedisSettings.from_dsn(redis_url)
    plain = Worker(functions=[func(job, name="job")], queue_name=QUEUE, redis_settings=settings, poll_delay=0.05,
                   handle_signals=False)
    task = asyncio.create_task(plain.async_run())
    producer = await create_pool(settings)
    try:
        jobs = [await producer.enqueue_job("job", i, _job_id=f"plain-{i}", _queue_name=QUEUE) for i in range(5)]
        assert [await j.result(timeout=30) for j in jobs if j is not None] == [0, 2, 4, 6, 8]
        assert sorted(runs) == [f"plain-{i}" for i in range(5)] and plain.jobs_complete == 5
        assert polls == [("_arq_poll", 0.05)]  # arq's own poll: mlxq's wake-ups do not reach it
        assert arqseam._spec_of(plain) is None and arqseam._spec_of(worker.worker) is not None
        plain.handle_sig_wait_for_completion(signal.SIGTERM)  # arq's drain, and none of mlxq's stop hooks
        assert not plain.allow_pick_jobs and not worker.host.draining
    finally:
        await plain.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await producer.aclose()


async def test_the_poll_arq_reads_is_the_wakeable_one_only_inside_an_mlxq_workers_main() -> None:
    arqseam._install()
    assert arq.worker.poll is arqseam._poll
    outside = arqseam._poll(1.0)
    with arqseam._wakeable_polls():
        inside = arqseam._poll(1.0)
    after = arqseam._poll(1.0)
    assert outside.ag_code is arq.utils.poll.__code__ and after.ag_code is arq.utils.poll.__code__
    assert inside.ag_code is arqseam._wakeable_poll.__code__
    for gen in (outside, inside, after):
        await gen.aclose()


def test_an_unsupported_arq_version_fails_at_import_with_a_clear_message() -> None:
    code = "import arq.version; arq.version.VERSION = '0.29.1'; import mlxq.worker.arqseam"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "mlxq needs arq 0.28.x" in proc.stderr and "arq 0.29.1 is installed" in proc.stderr


async def test_queue_entries_that_are_no_job_id_are_moved_aside_and_the_worker_serves_on(
    worker: Any, client: Client, redis_url: str
) -> None:
    # Issue 13, scenario 4: an id that is not UTF-8 crashed arq's poll loop, and every restarted worker.
    poison = [b"\xff\xfe\xfd", b"has space", b"x" * 65, b"ok\n"]
    r = aredis.Redis.from_url(redis_url)
    try:
        now = int(time.time() * 1000)
        await r.zadd("mlxq:queue:tiny", {p: now - 1000 for p in poison})
        arqseam.wake()
        result = await client.generate(model="tiny", prompt="still serving", max_tokens=4, timeout=60)
        assert result.usage.completion_tokens == 4
        for _ in range(500):
            if worker.host.dead_lettered == len(poison):
                break
            await asyncio.sleep(0.01)
        assert worker.host.dead_lettered == len(poison) and not worker.task.done()
        assert await r.zcard("mlxq:queue:tiny") == 0
        letters = [json.loads(x) for x in await r.lrange("mlxq:dead", 0, -1)]
        assert sorted(bytes.fromhex(x["hex"]) for x in letters) == sorted(poison)
        assert {x["reason"] for x in letters} == {"the queue entry is not a job id"}
        assert await r.ttl("mlxq:dead") > 0
    finally:
        await r.aclose()


async def test_jobs_claimed_together_reach_an_idle_engine_in_one_step(worker_config: Any, client: Client) -> None:
    # A long admission bound: a loaded CI machine may take more than the default 10 ms to add six jobs.
    # Once they are all in, the engine lingers a fifth of it for more of the burst (0.6 s here).
    running = await start_worker(config_with(worker_config, admit_wait_ms=3_000.0))
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
        arqseam.wake()
        for rid in rids:
            assert (await client.result(rid, timeout=30)).usage.completion_tokens == 4
        assert len(steps_at_insert) == 6
        assert len(set(steps_at_insert)) == 1  # all six prefilled in the engine's first step
    finally:
        await running.close()


async def _wake_every_pass(times: int, sent: list[int]) -> None:
    """A wake-up on each of ``times`` event-loop passes: a burst arriving as fast as it can be read."""
    for i in range(times):
        await asyncio.sleep(0)
        arqseam.wake()
        sent.append(i)


async def test_a_woken_poll_reads_the_burst_of_wake_ups_before_it_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arqseam, "_BURST_MAX_S", 30.0)
    poll = arqseam._wakeable_poll(60.0)
    await anext(poll)
    sent: list[int] = []
    burst = asyncio.create_task(_wake_every_pass(20, sent))
    await anext(poll)  # woken by the first, it polls only once the burst has paused
    assert sent == list(range(20))
    await burst
    await poll.aclose()


async def test_an_endless_stream_of_wake_ups_still_polls_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arqseam, "_BURST_MAX_S", 0.3)
    poll = arqseam._wakeable_poll(60.0)
    await anext(poll)
    sent: list[int] = []
    stream = asyncio.create_task(_wake_every_pass(10_000_000, sent))
    await anext(poll)
    assert not stream.done()  # polled while wake-ups kept coming
    stream.cancel()
    await poll.aclose()


async def test_a_poll_cancelled_as_a_wake_up_lands_stays_cancelled() -> None:
    """arq stops its worker by cancelling the poll loop; a job's end may wake the poll in the same pass.
    Python 3.11's wait_for returned the wake-up and dropped the cancel there: the loop polled on and the
    worker hung after SIGTERM (caught by the chaos test, under load)."""
    async def arq_main() -> None:
        async for _ in arqseam._wakeable_poll(60.0):
            pass

    main = asyncio.create_task(arq_main())
    await asyncio.sleep(0.01)  # main now waits for a wake-up
    arqseam.wake()
    main.cancel()
    try:
        await asyncio.wait({main}, timeout=5)  # a swallowed cancel polls on for ever
        assert main.cancelled()
    finally:
        main.cancel()
