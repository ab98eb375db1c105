"""Results kept and fetched later: a real Redis and a real arq worker on the tiny model. A job's result (text,
usage, finish reason, tenant, timings; a failed job's error) is read by id after its replay log expired, for as
long as its request (``keep_result_s``) or the workers (``MLXQ_KEEP_RESULT``) keep it; ``mlxq job`` shows it; a
Redis at its maxmemory (noeviction) refuses new jobs with one clear exception."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aredis

from mlxq.api import fleet
from mlxq.api.client import Client
from mlxq.api.errors import JobFailed, QueueFull, QueueOutOfMemory
from mlxq.api.gateway.errors import problem_of
from mlxq.api.protocol.keys import Keys
from mlxq.api.protocol.notify import eviction_risk
from mlxq.api.schema import ErrorCode, FinishReason
from mlxq.worker.tools.redis_server import RedisServer
from tests.api.gateway_support import PREFIX, Deployment, occupy, release
from tests.support import RunningWorker, config_with, start_worker

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent.parent
KEEP_S = 900  # the workers' default in these tests (MLXQ_KEEP_RESULT)


@pytest.fixture
async def short_logs(worker_config: Any) -> AsyncIterator[RunningWorker]:
    """A worker whose jobs' logs live one second after their end (MLXQ_DONE_TTL=1)."""
    running = await start_worker(config_with(worker_config, done_ttl_s=1, keep_result_s=KEEP_S))
    try:
        yield running
    finally:
        await running.close()


async def log_gone(client: Client, rid: str) -> None:
    """Wait until the job's replay log expired (its TTL: one second after its end)."""
    while await client.redis.exists(client.keys.log(rid)):
        await asyncio.sleep(0.1)


async def test_a_result_is_read_by_id_after_its_log_expired_by_a_client_that_never_followed_it(
        short_logs: RunningWorker, client: Client, redis_url: str) -> None:
    followed = await client.generate(model="tiny", prompt="kept for later", max_tokens=12, tenant="acme")
    await log_gone(client, followed.id)
    async with Client(redis_url) as later:  # a new client: nothing of the job in memory
        result = await later.result(followed.id, timeout=5)
        events = [ev async for ev in later.events(followed.id, timeout=5)]
    assert result.text == followed.text and result.text
    assert (result.finish_reason, result.usage, result.tenant) == (followed.finish_reason, followed.usage, "acme")
    assert result.timings == followed.timings
    assert events[-1].type == "done" and "".join(e.text for e in events if e.type == "token") == followed.text
    view = await client.job(followed.id)
    assert view.status == "done" and view.text == followed.text and view.kept is not None
    page = await fleet.job(client, followed.id, full=True)  # the dashboard's job page
    assert page["state"] == "done" and page["events"][-1]["type"] == "done"
    assert "".join(e.get("text", "") for e in page["events"] if e["type"] == "token") == followed.text


async def test_each_job_keeps_its_result_as_long_as_it_asked_else_the_workers_default(
        short_logs: RunningWorker, client: Client) -> None:
    asked = await client.generate(model="tiny", prompt="a", max_tokens=4, keep_result_s=7200)
    default = await client.generate(model="tiny", prompt="b", max_tokens=4)
    none = await client.generate(model="tiny", prompt="c", max_tokens=4, keep_result_s=0)
    assert 7000 * 1000 < await client.redis.pttl(client.keys.result(asked.id)) <= 7200 * 1000
    assert (KEEP_S - 100) * 1000 < await client.redis.pttl(client.keys.result(default.id)) <= KEEP_S * 1000
    assert not await client.redis.exists(client.keys.result(none.id))


async def test_a_failed_jobs_error_is_kept_and_raised_later(short_logs: RunningWorker, client: Client) -> None:
    rid = await client.submit(model="tiny", prompt="x " * 2000, max_tokens=8)  # past the 512-token context
    with pytest.raises(JobFailed):
        await client.result(rid, timeout=30)
    await log_gone(client, rid)
    with pytest.raises(JobFailed) as failed:
        await client.result(rid, timeout=5)
    assert failed.value.code is ErrorCode.BAD_REQUEST
    view = await client.job(rid)
    assert view.status == "failed" and view.error is not None and view.error.code is ErrorCode.BAD_REQUEST


def mlxq(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLXQ_REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-m", "mlxq.api.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


async def test_mlxq_job_shows_a_kept_result_in_one_block_and_as_json(short_logs: RunningWorker, client: Client,
                                                                      redis_url: str) -> None:
    done = await client.generate(model="tiny", prompt="shown", max_tokens=10)
    await log_gone(client, done.id)
    shown = await asyncio.to_thread(mlxq, redis_url, "job", done.id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"job {done.id}: done ({done.finish_reason.value})")
    assert f"{done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} completion tokens" in shown.stdout
    assert shown.stdout.rstrip("\n").endswith(done.text.rstrip("\n"))
    as_json = await asyncio.to_thread(mlxq, redis_url, "job", done.id, "--json")
    data = json.loads(as_json.stdout)
    assert (data["status"], data["text"], data["finish_reason"]) == ("done", done.text, done.finish_reason.value)
    unknown = await asyncio.to_thread(mlxq, redis_url, "job", "nope")
    assert unknown.returncode == 1 and "unknown" in unknown.stderr and unknown.stderr.count("\n") == 1


async def test_a_running_jobs_view_is_its_text_so_far(worker: RunningWorker, client: Client) -> None:
    rid = await client.submit(model="tiny", prompt="long", max_tokens=400)
    async for ev in client.events(rid, timeout=30):
        if ev.type == "token":
            break
    view = await client.job(rid)
    assert view.status == "running" and view.kept is None
    await client.cancel(rid)
    assert (await client.result(rid, timeout=30)).finish_reason is FinishReason.CANCELLED


async def test_a_full_redis_refuses_new_jobs_with_one_clear_exception() -> None:
    with RedisServer() as server:
        r = aredis.Redis.from_url(server.url)
        try:
            assert await eviction_risk(r) is None  # no maxmemory: nothing is evicted
            await r.config_set("maxmemory-policy", "allkeys-lru")
            await r.config_set("maxmemory", 64 << 20)
            assert "allkeys-lru" in (await eviction_risk(r) or "")
            await r.config_set("maxmemory-policy", "noeviction")
            assert await eviction_risk(r) is None
            used = int((await r.info("memory"))["used_memory"])
            await r.config_set("maxmemory", used + (2 << 20))
            async with Client(server.url) as client:
                with pytest.raises(QueueOutOfMemory) as full:
                    for i in range(200):  # 200 jobs of 64 KB: past the 2 MB left
                        await client.submit(model="tiny", prompt="y" * 65536, id=f"job{i}", max_tokens=4)
            assert isinstance(full.value, QueueFull) and "out of memory" in str(full.value)
            problem = problem_of(full.value)
            assert problem.status == 503 and problem.code == "queue_out_of_memory"
        finally:
            await r.aclose()


@pytest.fixture(scope="module")
def short_lived(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A deployment whose worker's job logs live one second after their end; no gateway yet."""
    d = Deployment(tiny_model, tmp_path_factory.mktemp("kept-responses"))
    try:
        d.worker("tiny", MLXQ_DONE_TTL="1")
        yield d
    finally:
        d.close()


async def test_a_background_response_nobody_followed_is_completed_from_its_kept_result_hours_later(
        short_lived: Deployment) -> None:
    d = short_lived
    r = aredis.Redis.from_url(d.redis.url)
    keys = Keys(PREFIX)
    try:
        fillers = await occupy(d)  # its job waits queued behind them while its gateway stops
        with d.gateway() as gw:  # it answers at once and stops (its follower with it) before its job runs
            oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
            resp = await oai.responses.create(model="tiny", input="remember me", max_output_tokens=300,
                                              background=True)
        await release(d, fillers)
        job = resp.id.removeprefix("resp_")
        while await r.exists(keys.job(job)) or await r.exists(keys.log(job)):  # ended, and its log expired
            await asyncio.sleep(0.1)
        assert await r.hget(keys.response(job), "status") in (b"queued", b"in_progress")  # nobody recorded it
        with d.gateway() as gw:
            oai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
            got = await oai.responses.retrieve(resp.id)
            same = await oai.responses.create(model="tiny", input="remember me", max_output_tokens=300)
        assert got.status == same.status and got.status in ("completed", "incomplete")
        assert got.output_text == same.output_text and got.output_text
        assert got.usage is not None and same.usage is not None
        assert got.usage.output_tokens == same.usage.output_tokens
    finally:
        await r.aclose()


async def test_a_watched_job_that_expires_queued_becomes_one_failed_webhook_event_and_keeps_its_error(
        worker: RunningWorker, client: Client) -> None:
    from mlxq.api.protocol.notify import watch

    rid = "expiring1"
    await watch(client.redis, client.keys, rid, "response", f"resp_{rid}", "acme", 600)
    await client.submit(model="ghost", prompt="nobody serves me", id=rid, expires_in=0.2, tenant="acme")
    with pytest.raises(JobFailed) as failed:  # the worker's reaper expires it (any queue's jobs)
        await client.result(rid, timeout=60)
    assert failed.value.code is ErrorCode.EXPIRED
    entries = await client.redis.xrange(client.keys.webhooks())
    assert [(f[b"type"], f[b"id"], f[b"tenant"]) for _, f in entries] == [(b"response.failed", b"resp_expiring1",
                                                                           b"acme")]
    assert not await client.redis.exists(client.keys.notify(rid))  # once: the key went with the end
    assert (await client.kept(rid)) is not None
