"""A worker's Prometheus metrics, scraped over HTTP from a real worker serving real jobs: the same registry
feeds the endpoint and the stats line."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.client import Client
from api.errors import JobFailed
from tests.support import config_with, start_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        steps = value(samples, "mlxq:engine_steps_total", model_name="tiny")
        assert steps == host.services["tiny"].engine.stats.steps > 0
        assert value(samples, "mlxq:engine_step_seconds_count", model_name="tiny") == steps
        assert value(samples, "mlxq:redis_writes_total") == host.publisher.stats.writes
        assert value(samples, "mlxq:redis_write_seconds_count") >= host.publisher.stats.writes
        assert value(samples, "mlxq:num_requests_running", model_name="tiny") == 0
        assert value(samples, "mlxq:queue_depth", model_name="tiny") == 0
        totals = host.metrics.totals()  # the stats line reads the same registry
        assert totals["engine_steps"] == steps and totals["generation_tokens"] == generated
        assert f"engine_steps={steps:g}" in host.stats_line()
        (status,) = await client.workers()
        assert status.metrics_url == f"http://127.0.0.1:{port}/metrics"
    finally:
        await running.close()
