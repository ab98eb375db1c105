"""What producers learn about the deployment before and after they queue: live workers' health records, the
refusal of a job no worker serves, the queue cap, and the expiry of jobs left queued. Real Redis, real arq
workers on the tiny model."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.errors import NoWorker, QueueFull
from mlxq.api.protocol.keys import Keys, deadline_member
from mlxq.api.schema import DoneEvent, ErrorCode, ErrorEvent, FinishReason, ModelState
from tests.support import RunningWorker, config_with, start_worker

pytestmark = pytest.mark.e2e


async def test_a_worker_publishes_its_health_record_and_removes_it_when_it_stops(worker_config: Any,
                                                                                  client: Client) -> None:
    running = await start_worker(worker_config)
    try:
        (status,) = await client.workers()
        assert status.id == worker_config.worker_id and not status.draining and status.pid > 0
        (model,) = status.models
        assert (model.name, model.state, model.capacity) == ("tiny", ModelState.SERVING, 8)
        assert model.context_length == 512
        await client.generate(model="tiny", prompt="Hello", max_tokens=20, timeout=60)
        await running.host.health.beat()
        (status,) = await client.workers()
        assert status.models[0].tokens_per_s > 0  # 20 tokens since the first beat
        models = await client.models()
        assert list(models) == ["tiny"] and models["tiny"].workers == 1
    finally:
        await running.close()
    assert await client.workers() == []
    assert await client.models() == {}


async def test_require_worker_refuses_a_job_no_live_worker_serves_and_names_those_served(
        worker: RunningWorker, client: Client, redis_url: str) -> None:
    with pytest.raises(NoWorker, match=r"no live worker serves model 'ghost' \(models served now: 'tiny'\)"):
        await client.submit(model="ghost", prompt="hi", require_worker=True)
    r = aredis.Redis.from_url(redis_url)
    try:
        assert not await r.exists(Keys().queue("ghost"))  # nothing was queued
    finally:
        await r.aclose()
    result = await client.generate(model="tiny", prompt="hi", max_tokens=3, timeout=60)  # served: not refused
    assert result.usage.completion_tokens == 3
    rid = await client.submit(model="tiny", prompt="hi", max_tokens=3, require_worker=True)
    assert (await client.result(rid, timeout=60)).usage.completion_tokens == 3


async def test_a_full_queue_refuses_submits_until_it_drains(redis_url: str) -> None:
    async with Client(redis_url, config=ClientConfig(max_queued=2)) as client:
        first = [await client.submit(model="nobody", prompt=f"job {i}") for i in range(2)]
        with pytest.raises(QueueFull, match="the queue of model 'nobody' is full \\(2 jobs waiting\\)"):
            await client.submit(model="nobody", prompt="one too many")
        await client.cancel(first[0])
        r = aredis.Redis.from_url(redis_url)
        try:
            assert await r.zcard(Keys().queue("nobody")) == 2
            await r.zrem(Keys().queue("nobody"), first[0])  # as a worker taking it would
        finally:
            await r.aclose()
        await client.submit(model="nobody", prompt="fits again")


async def test_a_job_still_queued_at_its_expiry_ends_with_error_expired(worker_config: Any, redis_url: str) -> None:
    # A worker of another model sweeps every queue under the prefix: the job's queue has no worker at all. The
    # test sweeps by hand (the worker's own sweeps are an hour apart) and moves deadlines as time would.
    running = await start_worker(config_with(worker_config, reap_interval_s=3600))
    reaper, keys, queue = running.host.reaper, Keys(), Keys().queue("ghost")
    r = aredis.Redis.from_url(redis_url)
    try:
        async with Client(redis_url) as client:
            lapsing = await client.submit(model="ghost", prompt="hi", expires_in=600)
            cancelled = await client.submit(model="ghost", prompt="hi", expires_in=600)
            await client.cancel(cancelled)
            lasting = await client.submit(model="ghost", prompt="hi", expires_in=0)
            for rid in (lapsing, cancelled):  # each deadline is its enqueue time plus its expires_in
                enqueued = json.loads(await r.get(keys.job(rid)))["et"]
                assert await r.zscore(keys.deadlines(), deadline_member(rid, queue)) == enqueued + 600_000
            assert await r.zscore(keys.deadlines(), deadline_member(lasting, queue)) is None  # never expires
            assert await reaper.lapse() == []  # before their deadlines: nothing ends
            assert await r.zcard(queue) == 3
            past = int(time.time() * 1000) - 1
            await r.zadd(keys.deadlines(), {deadline_member(rid, queue): past for rid in (lapsing, cancelled)},
                         xx=True)
            assert sorted(await reaper.lapse()) == sorted([lapsing, cancelled])
            (end,) = [ev async for ev in client.events(lapsing, timeout=30)]
            assert isinstance(end, ErrorEvent) and end.code is ErrorCode.EXPIRED and end.retryable
            assert "no worker took the job before it expired" in end.message and "ghost" in end.message
            (done,) = [ev async for ev in client.events(cancelled, timeout=30)]
            assert isinstance(done, DoneEvent) and done.finish_reason is FinishReason.CANCELLED
            assert await reaper.lapse() == []  # each ends once
            assert reaper.expired == 2
            assert await r.zrange(queue, 0, -1) == [lasting.encode()]
            assert not await r.exists(keys.job(lapsing), keys.job(cancelled), keys.deadlines())
    finally:
        await r.aclose()
        await running.close()


async def test_a_job_that_starts_before_its_expiry_runs_to_its_end(worker: RunningWorker, client: Client,
                                                                    redis_url: str) -> None:
    result = await client.generate(model="tiny", prompt="hi", max_tokens=5, expires_in=5, timeout=60)
    assert result.usage.completion_tokens == 5
    r = aredis.Redis.from_url(redis_url)
    try:
        assert not await r.exists(Keys().deadlines())  # started: its deadline is gone
    finally:
        await r.aclose()
