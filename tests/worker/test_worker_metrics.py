"""A worker's Prometheus metrics, scraped over HTTP from a real worker serving real jobs: the same registry
feeds the endpoint and the stats line."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client.parser import text_string_to_metric_families

from mlxq.api.client import Client
from mlxq.api.errors import JobFailed
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import ErrorCode, ErrorEvent
from tests.support import config_with, free_port, start_worker, wait_for

pytestmark = pytest.mark.e2e


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_the_metrics_endpoint_counts_jobs_tokens_and_latencies(worker_config: Any, client: Client) -> None:
    port = free_port()
    running = await start_worker(config_with(worker_config, metrics_port=port, metrics_addr="127.0.0.1"))
    try:
        done = await client.generate(model="tiny", prompt="Hello world", max_tokens=12, timeout=60)
        with pytest.raises(JobFailed):
            await client.generate(model="tiny", prompt="x", max_tokens=10**6, timeout=60)  # over the limit
        rid = await client.submit(model="tiny", prompt="cancel me", max_tokens=400)
        async for ev in client.events(rid, timeout=60):
            if ev.type == "token":
                await client.cancel(rid)
        host = running.host
        engine = host.services["tiny"].engine
        while engine.scheduler.has_work or engine._scheduled:  # until its thread is idle (a cancelled sequence
            await asyncio.sleep(0.01)                          # leaves at a step's end)
        await host.health.beat()
        samples = await asyncio.to_thread(scrape, port)
        assert value(samples, "mlxq:request_success_total", model_name="tiny", finished_reason="length") == 1
        assert value(samples, "mlxq:request_success_total", model_name="tiny", finished_reason="cancelled") == 1
        assert value(samples, "mlxq:request_failure_total", model_name="tiny", code="bad_request") == 1
        generated = value(samples, "mlxq:generation_tokens_total", model_name="tiny")
        assert generated >= done.usage.completion_tokens + 1  # the cancelled job made some too
        assert value(samples, "mlxq:prompt_tokens_total", model_name="tiny") >= done.usage.prompt_tokens
        assert value(samples, "mlxq:time_to_first_token_seconds_count", model_name="tiny") == 2
        assert value(samples, "mlxq:e2e_request_latency_seconds_count", model_name="tiny") == 3
        # Admitted into the batch: the two that generated (the refused one never was).
        assert value(samples, "mlxq:request_queue_time_seconds_count", model_name="tiny") == 2
        assert value(samples, "mlxq:request_queue_time_seconds_sum", model_name="tiny") > 0
        assert value(samples, "mlxq:time_per_output_token_seconds_count", model_name="tiny") >= 1  # 12 tokens
        assert value(samples, "mlxq:time_per_output_token_seconds_sum", model_name="tiny") > 0
        steps = value(samples, "mlxq:engine_steps_total", model_name="tiny")
        assert steps == host.services["tiny"].engine.stats.steps > 0
        assert value(samples, "mlxq:engine_step_seconds_count", model_name="tiny") == steps
        assert value(samples, "mlxq:redis_writes_total") == host.runs.stats.writes
        assert value(samples, "mlxq:redis_write_seconds_count") >= host.runs.stats.writes
        assert value(samples, "mlxq:num_requests_running", model_name="tiny") == 0
        assert value(samples, "mlxq:queue_depth", model_name="tiny") == 0
        totals = host.metrics.totals()  # the stats line reads the same registry
        assert totals["engine_steps"] == steps and totals["generation_tokens"] == generated
        assert f"engine_steps={steps:g}" in host.stats_line()
        (status,) = await client.workers()
        assert status.metrics_url == f"http://127.0.0.1:{port}/metrics"
    finally:
        await running.close()


class StepGate:
    """Holds the engine's MLX thread before a step when asked (the batch stays as it is meanwhile)."""

    def __init__(self, running: Any) -> None:
        self.hold, self.held, self.go = threading.Event(), threading.Event(), threading.Event()
        backend = running.service.engine.scheduler.backend
        step = backend.step

        def gated() -> Any:
            if self.hold.is_set():
                self.held.set()
                self.go.wait(60)
            time.sleep(0.01)  # a long job stays in the batch for seconds
            return step()

        backend.step = gated


async def test_running_waiting_and_queue_depth_follow_the_batch_and_the_queue(worker_config: Any,
                                                                             client: Client) -> None:
    port = free_port()
    running = await start_worker(config_with(worker_config, capacity=2, metrics_port=port, metrics_addr="127.0.0.1"))
    gate = StepGate(running)
    try:
        long = await client.submit(model="tiny", prompt="a long one", max_tokens=400)
        async for ev in client.events(long, timeout=60):
            if ev.type == "token":
                break
        gate.hold.set()
        assert await asyncio.to_thread(gate.held.wait, 60)  # the MLX thread waits before its next step
        # Room for one more: the worker claims one job, which waits outside the held batch; the other stays queued.
        others = [await client.submit(model="tiny", prompt=f"short {i}", max_tokens=3) for i in range(2)]
        await wait_for(lambda: len(running.service.active) == 2, "the worker to claim one more job")
        await running.host.health.beat()  # reads the queue's depth
        samples = await asyncio.to_thread(scrape, port)
        assert value(samples, "mlxq:num_requests_running", model_name="tiny") == 1
        assert value(samples, "mlxq:num_requests_waiting", model_name="tiny") == 1
        assert value(samples, "mlxq:queue_depth", model_name="tiny") == 1
        await client.cancel(long)
        gate.hold.clear()
        gate.go.set()
        for rid in others:
            assert (await client.result(rid, timeout=60)).usage.completion_tokens == 3
        await client.result(long, timeout=60)
        await wait_for(lambda: len(running.service.active) == 0, "every job to leave the worker")
        await running.host.health.beat()
        samples = await asyncio.to_thread(scrape, port)
        for gauge in ("num_requests_running", "num_requests_waiting", "queue_depth"):
            assert value(samples, f"mlxq:{gauge}", model_name="tiny") == 0
    finally:
        gate.go.set()
        await running.close()


async def test_recovery_counters_move_when_their_event_happens(worker_config: Any, client: Client,
                                                               redis_url: str) -> None:
    port = free_port()
    # A long lease: its keeper does not refresh during the test, so the lease deleted below is found gone by
    # the run's next write (a fenced run), and the reaper (every 0.1 s) re-queues the job.
    running = await start_worker(config_with(worker_config, metrics_port=port, metrics_addr="127.0.0.1",
                                             lease_ttl_s=60.0, reap_interval_s=0.1))
    StepGate(running)
    keys = Keys()
    counters = ("lease_losses", "resets", "reaped", "dead_lettered", "expired")

    async def read() -> dict[str, float]:
        samples = await asyncio.to_thread(scrape, port)
        return {name: value(samples, f"mlxq:{name}_total") for name in counters}

    r = aredis.Redis.from_url(redis_url)
    try:
        assert await read() == dict.fromkeys(counters, 0)
        await r.zadd(keys.queue("tiny"), {"no-such-job": int(time.time() * 1000)})  # no job record: dead letter
        await wait_for(lambda: running.host.dead_lettered == 1, "the entry to be moved aside")
        lapsing = await client.submit(model="ghost", prompt="nobody serves this", expires_in=0.1)
        (end,) = [ev async for ev in client.events(lapsing, timeout=60)]
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.EXPIRED
        assert await read() == {**dict.fromkeys(counters, 0), "dead_lettered": 1, "expired": 1}

        lost = await client.submit(model="tiny", prompt="its lease goes", max_tokens=30)
        seen: list[str] = []
        async for ev in client.events(lost, timeout=60):
            seen.append(ev.type)
            if ev.type == "token" and "reset" not in seen:
                await r.delete(keys.lease(lost))  # as if its worker had been paused past the lease's TTL
        assert seen.count("reset") == 1 and seen[-1] == "done"
        assert await read() == {**dict.fromkeys(counters, 0), "dead_lettered": 1, "expired": 1, "lease_losses": 1,
                                "reaped": 1}
    finally:
        await r.aclose()
    handed = await client.submit(model="tiny", prompt="shut down under it", max_tokens=400)
    async for ev in client.events(handed, timeout=60):
        if ev.type == "token":
            break
    await running.close(drain_s=0)  # a shutdown that cannot wait: the job is handed back to its queue
    assert running.host.metrics.totals()["resets"] == 1
    assert [(q.model, q.depth) for q in await client.queues()] == [("tiny", 1)]
