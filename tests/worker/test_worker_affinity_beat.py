"""A worker's heartbeat never waits for a model's MLX thread: with prefix affinity keys to check, a thread held busy
(a long step) for several heartbeat intervals leaves the health record and the advertisement refreshed all along,
and the cache's answer is taken once the thread is free; an answer asked before a key's job started again does not
drop the key."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.schema import WorkerStatus
from mlxq.worker.affinity import Holdings
from tests.support import config_with, start_worker, wait_for
from tests.worker.test_worker_affinity import conversation, run

BEATS = 3  # heartbeats written while the MLX thread is held


async def updated_at(r: aredis.Redis, key: str) -> float:
    raw = await r.get(key)
    assert raw is not None, "the health record lapsed: the heartbeat waited for the MLX thread"
    return WorkerStatus.model_validate_json(raw).updated_at


async def test_the_heartbeat_goes_on_while_the_mlx_thread_is_busy(worker_config: Any, client: Client,
                                                                  r: aredis.Redis) -> None:
    running = await start_worker(config_with(worker_config, worker_id="beat", kv_disk_gb=0.0, heartbeat_s=0.2))
    free = threading.Event()
    try:
        await run(client, conversation(0))  # its keys' prompts are in the prefix cache now, idle: each beat checks them
        host, engine = running.host, running.service.engine
        held = set(host.affinity.holdings["tiny"].keys())
        assert held
        busy = threading.Event()

        def long_step() -> None:
            busy.set()
            free.wait(60)

        blocked = engine.thread.submit(long_step)
        assert await asyncio.to_thread(busy.wait, 60)
        record, advertised = host.keys.worker("beat"), host.keys.affinity_keys("tiny", "beat")
        seen = [await updated_at(r, record)]
        for _ in range(BEATS):
            while (stamp := await updated_at(r, record)) == seen[-1]:
                assert not blocked.done(), "the heartbeat waited for the MLX thread"
                await asyncio.sleep(0.01)
            seen.append(stamp)
        assert not blocked.done() and engine.thread.queued >= 1  # every beat while the thread was held; a check asked
        assert {m.decode() for m in await r.smembers(advertised)} == held  # type: ignore[misc]
        free.set()
        await asyncio.wrap_future(blocked)
        await wait_for(lambda: engine.thread.queued == 0, "the cache's answer")
        await host.health.beat()
        assert set(host.affinity.holdings["tiny"].keys()) == held  # the cache still holds them
    finally:
        free.set()
        await running.close()


def test_an_answer_asked_before_a_keys_job_started_again_keeps_the_key() -> None:
    holdings = Holdings()
    holdings.started("a", [1, 2])
    holdings.started("b", [3, 4])
    holdings.ended("a")
    holdings.ended("b")
    asked = holdings.idle()
    holdings.started("a", [1, 2])  # a's job came back while the check was on its way: its prefill stores it again
    holdings.ended("a")
    holdings.keep(asked, [False, False])
    assert holdings.keys() == ["a"]
