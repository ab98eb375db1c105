"""``mlxq status`` and the health records it reads: real Redis, real arq workers on the tiny model (in this
process, and as a real ``arq mlxq.worker.Settings`` process behind the real ``mlxq`` command)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.protocol.keys import Keys
from mlxq.api.status import collect, render
from mlxq.worker.health import package_version
from mlxq.worker.tools.process import WorkerProcess
from tests.support import RunningWorker
from tests.worker.test_worker_cli import arq_worker, mlxq  # noqa: F401 (arq_worker is a fixture)

pytestmark = pytest.mark.e2e

FRAME = "\x1b[H\x1b[2J"  # what --watch writes before each refresh


async def _enqueue_ms(redis_url: str, rid: str) -> int:
    r = aredis.Redis.from_url(redis_url)
    try:
        record = await r.get(Keys().job(rid))
    finally:
        await r.aclose()
    assert record is not None
    return int(json.loads(record)["et"])


async def _oldest_s(client: Client, model: str) -> tuple[float, float, float]:
    """(time before the read, the oldest age read, time after the read)."""
    before = time.time()
    (queue,) = [q for q in await client.queues() if q.model == model]
    after = time.time()
    assert queue.oldest_s is not None
    return before, queue.oldest_s, after


async def test_the_oldest_waiting_age_counts_a_low_priority_job_that_many_higher_ones_passed(
        client: Client, redis_url: str) -> None:
    # Nobody serves "ghost": its jobs wait. The oldest is the lowest priority, so in score order it comes after
    # every later job of a higher priority, more of them than one read of the queue returns.
    old = await client.submit(model="ghost", prompt="old and unimportant", priority=-100)
    await asyncio.sleep(0.01)  # the later jobs get a later enqueue time (milliseconds)
    later = [await client.submit(model="ghost", prompt=f"later {i}", priority=i % 3) for i in range(250)]
    old_ms, first_later_ms = await _enqueue_ms(redis_url, old), await _enqueue_ms(redis_url, later[0])
    assert old_ms < first_later_ms
    before, oldest_s, after = await _oldest_s(client, "ghost")
    assert before - old_ms / 1000 <= oldest_s <= after - old_ms / 1000 + 1e-6
    report = json.loads(mlxq(redis_url, "status", "--json").stdout)
    (ghost,) = report["models"]
    assert ghost["queued"] == 251 and ghost["oldest_s"] >= oldest_s
    # Once the old job leaves the queue, the oldest is the first of the later ones.
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zrem(Keys().queue("ghost"), old)  # as a worker taking it would
    finally:
        await r.aclose()
    before, oldest_s, after = await _oldest_s(client, "ghost")
    assert before - first_later_ms / 1000 <= oldest_s <= after - first_later_ms / 1000 + 1e-6


async def test_the_oldest_waiting_age_reads_a_job_deferred_ahead_of_now(client: Client, redis_url: str) -> None:
    old = await client.submit(model="ghost", prompt="old")
    await asyncio.sleep(0.01)
    await client.submit(model="ghost", prompt="newer")
    old_ms = await _enqueue_ms(redis_url, old)
    r = aredis.Redis.from_url(redis_url)
    try:  # a start deferred because another run still held its lease: due a lease TTL from now
        await r.zadd(Keys().queue("ghost"), {old: int(time.time() * 1000) + 60_000})
    finally:
        await r.aclose()
    before, oldest_s, after = await _oldest_s(client, "ghost")
    assert before - old_ms / 1000 <= oldest_s <= after - old_ms / 1000 + 1e-6


async def test_a_workers_health_record_and_the_status_report_show_what_it_does(
        worker: RunningWorker, client: Client) -> None:
    await client.generate(model="tiny", prompt="Hello", max_tokens=20, timeout=60)
    await worker.host.health.beat()
    (status,) = await client.workers()
    assert (status.host, status.pid, status.version) == (socket.gethostname(), os.getpid(), package_version())
    assert status.started_at <= status.updated_at
    (model,) = status.models
    assert model.tokens_per_s > 0 and model.accepts_images is False
    report = await collect(client)
    (tiny,) = report.to_json()["models"]
    assert tiny["name"] == "tiny" and tiny["tokens_per_s"] > 0 and tiny["accepts_images"] is False
    lines = render(report).splitlines()
    header = next(ln for ln in lines if ln.startswith("MODEL "))
    assert header.split()[-1] == "IMAGES"
    assert next(ln for ln in lines if ln.startswith("tiny ")).split()[-1] == "no"
    assert "UPTIME" in next(ln for ln in lines if ln.startswith("WORKER "))


@pytest.mark.slow  # a fault or a whole program: out of the everyday run
def test_status_of_a_worker_process_shows_its_numbers_and_watch_refreshes_in_place(
        arq_worker: WorkerProcess, redis_url: str, tiny_model: Path) -> None:  # noqa: F811
    model = str(tiny_model)
    done = mlxq(redis_url, "submit", "--model", model, "--max-tokens", "16", "Hello")
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 60  # a safety timeout: the next heartbeat carries the job's tokens
    while True:
        report = json.loads(mlxq(redis_url, "status", "--json").stdout)
        (worker,) = report["workers"]
        if worker["models"][0]["tokens_per_s"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert worker["models"][0]["tokens_per_s"] > 0
    assert (worker["host"], worker["pid"], worker["version"]) == (socket.gethostname(), arq_worker.proc.pid,
                                                                  package_version())
    assert worker["started_at"] <= report["at"] and worker["models"][0]["accepts_images"] is False
    (served,) = report["models"]
    assert served["name"] == model and served["accepts_images"] is False and served["tokens_per_s"] > 0
    text = mlxq(redis_url, "status").stdout.splitlines()
    row = next(ln for ln in text if ln.startswith(model)).split()
    assert row[-1] == "no" and float(row[-2]) > 0  # IMAGES, TOK/S
    worker_row = next(ln for ln in text if ln.startswith(worker["id"])).split()
    assert worker_row[1:3] == [socket.gethostname(), str(arq_worker.proc.pid)]
    assert worker_row[-1] == package_version() and worker_row[-2].endswith(("s", "m"))  # UPTIME
    watched = mlxq(redis_url, "status", "--watch", "0.05", "--count", "3")
    assert watched.returncode == 0, watched.stderr
    frames = watched.stdout.split(FRAME)
    assert frames[0] == "" and len(frames) == 4  # each refresh clears the screen and redraws from the top
    assert all(f.startswith("mlxq status: ") and model in f for f in frames[1:])
