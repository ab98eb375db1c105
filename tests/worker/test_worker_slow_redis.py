"""A slow and a stalling Redis: a worker and its clients behind a loopback proxy that holds each reply 50 ms,
or every byte for 3 s, or for longer than a lease. Each fault's figures (jobs completed, re-run, failed) are
printed, and deploy/README.md's failures section states them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.errors import QueueUnavailable
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import decode_event, is_terminal
from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools.redis_server import RedisServer
from tests.redis_faults import FaultProxy
from tests.support import RunningWorker, slow_steps, start_worker, terminal

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # real Redis processes of their own


@pytest.fixture(scope="module")
def tcp_redis() -> Iterator[RedisServer]:
    with RedisServer(tcp=True) as server:
        yield server


@pytest.fixture
async def proxy(tcp_redis: RedisServer) -> AsyncIterator[FaultProxy]:
    import redis

    redis.Redis.from_url(tcp_redis.url).flushall()
    p = await FaultProxy(tcp_redis.port).start()
    try:
        yield p
    finally:
        await p.close()


async def _worker(url: str, tiny_model: Path, lease_ttl_s: float) -> RunningWorker:
    config = WorkerConfig(model=str(tiny_model), model_name="tiny", redis_url=url, capacity=2, poll_delay_s=0.25,
                          cancel_poll_s=0.1, drain_timeout_s=5.0, lease_ttl_s=lease_ttl_s, reap_interval_s=0.5)
    running = await start_worker(config)
    slow_steps(running, 0.03)
    return running


async def _run_jobs(client: Client, n: int, fault: Any, max_tokens: int = 32) -> dict[str, list[Any]]:
    """Submit ``n`` jobs, let them start streaming, apply ``fault``, and follow each to its end (bounded)."""
    rids = [await client.submit(model="tiny", prompt=f"job {i}", max_tokens=max_tokens, temperature=0.0)
            for i in range(n)]
    followers = [asyncio.create_task(_collect(client, rid)) for rid in rids]
    await asyncio.sleep(0.5)
    await fault()
    async with asyncio.timeout(60):
        return dict(zip(rids, await asyncio.gather(*followers), strict=True))


async def _collect(client: Client, rid: str) -> list[Any]:
    return [ev async for ev in client.events(rid, timeout=50)]


def _figures(name: str, worker: RunningWorker, runs: dict[str, list[Any]]) -> dict[str, int]:
    ends = [terminal(evs) for evs in runs.values()]  # exactly one terminal event, the last, seqs without gap or repeat
    w = worker.worker
    figures = {"jobs": len(runs), "done": sum(e.type == "done" for e in ends),
               "error": sum(e.type == "error" for e in ends), "runs complete": w.jobs_complete,
               "runs re-run": w.jobs_retried, "runs failed": w.jobs_failed}
    print(f"\n{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return figures


async def _logged_terminals(url: str, runs: dict[str, list[Any]]) -> list[int]:
    """How many terminal events each job's replay log holds in Redis (what a late subscriber replays); a run
    that lost its lease and wrote on would show as a repeated seq."""
    keys = Keys("mlxq")
    async with Client(url) as c:
        counts = []
        for rid in runs:
            logged = [decode_event(f[b"e"]) for _, f in await c._redis.xrange(keys.log(rid))]
            assert [e.seq for e in logged] == list(range(len(logged)))
            counts.append(sum(is_terminal(e) for e in logged))
        return counts


async def _recovers(client: Client) -> None:
    """A job submitted after the fault runs to its end on the same worker: nothing to restart."""
    rid = await client.submit(model="tiny", prompt="after", max_tokens=4)
    assert terminal([ev async for ev in client.events(rid, timeout=30)]).type == "done"


async def test_fifty_ms_on_every_reply_slows_jobs_and_loses_none(proxy: FaultProxy, tcp_redis: RedisServer,
                                                                 tiny_model: Path) -> None:
    worker = await _worker(proxy.url, tiny_model, lease_ttl_s=3.0)
    try:
        async with Client(proxy.url, retry_deadline=10) as client:

            async def latency() -> None:
                proxy.delay_s = 0.05

            runs = await _run_jobs(client, 4, latency)
            figures = _figures("50 ms on every reply", worker, runs)
            assert figures["done"] == 4 and figures["runs re-run"] == 0
            await _recovers(client)
    finally:
        proxy.delay_s = 0.0
        await worker.close()
    assert await _logged_terminals(tcp_redis.url, runs) == [1] * 4


async def test_a_three_second_stall_within_the_lease_ends_every_job_once(proxy: FaultProxy, tcp_redis: RedisServer,
                                                                         tiny_model: Path) -> None:
    worker = await _worker(proxy.url, tiny_model, lease_ttl_s=10.0)
    refused: list[str] = []
    try:
        async with Client(proxy.url, retry_deadline=10) as client, Client(proxy.url, retry_deadline=1) as hasty:

            async def stall() -> None:
                stalled = asyncio.create_task(proxy.stall(3.0))
                await asyncio.sleep(0.2)
                start = time.monotonic()
                with pytest.raises(QueueUnavailable) as caught:  # a submit during the stall: the deadline's error
                    await hasty.submit(model="tiny", prompt="during", max_tokens=4)
                refused.append(f"{caught.value} after {time.monotonic() - start:.1f}s")
                await stalled

            runs = await _run_jobs(client, 4, stall)
            figures = _figures("3 s stall", worker, runs)
            print(f"a submit during the stall: {refused[0]}")
            assert figures["done"] == 4 and figures["runs re-run"] == 0  # the leases outlived the stall
            assert "unreachable within the 1s deadline (MLXQ_RETRY_DEADLINE; " in refused[0]
            await _recovers(client)
    finally:
        await worker.close()
    assert await _logged_terminals(tcp_redis.url, runs) == [1] * 4


async def test_a_stall_longer_than_the_lease_re_runs_jobs_and_each_ends_once(proxy: FaultProxy,
                                                                             tcp_redis: RedisServer,
                                                                             tiny_model: Path) -> None:
    worker = await _worker(proxy.url, tiny_model, lease_ttl_s=1.0)
    try:
        async with Client(proxy.url, retry_deadline=15) as client:

            async def stall() -> None:
                await proxy.stall(3.0)

            runs = await _run_jobs(client, 4, stall, max_tokens=48)
            figures = _figures("3 s stall, lease 1 s", worker, runs)
            assert figures["done"] + figures["error"] == 4
            await _recovers(client)
    finally:
        with contextlib.suppress(Exception):
            await worker.close()
    assert await _logged_terminals(tcp_redis.url, runs) == [1] * 4
