"""Prefix affinity for single-turn requests that share a system prompt (RAG, classification, agents), through real
workers: every later request starts on the worker holding the system prompt, from its prefix cache, although no
two requests share a conversation; and a worker restarted on its disk tier advertises the system prompt's key from
its first heartbeat (its checkpoint is kept on disk) and takes the next such request from there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from mlxq.api.affinity import affinity_keys
from mlxq.api.client import Client
from mlxq.api.schema import GenerateRequest
from tests.support import RunningWorker, config_with, start_worker
from tests.worker.test_worker_affinity import placed, run

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You classify support tickets by their product and their urgency. " * 9}


def ticket(i: int) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": f"Ticket {i}: the app stops at step {i}."}]


def system_key() -> str:
    keys = affinity_keys(GenerateRequest(model="tiny", messages=ticket(0)))  # type: ignore[arg-type]
    assert len(keys) == 2  # long enough for a key of its own
    return keys[1]


def hits(w: RunningWorker) -> int:
    engine = w.service.engine
    assert engine is not None
    return int(engine.stats.prefix_hits)


async def test_single_turn_requests_sharing_a_system_prompt_start_on_its_holder(worker_config: Any,
                                                                                client: Client) -> None:
    a = await start_worker(config_with(worker_config, worker_id="sys-a", kv_disk_gb=0.0))
    b = await start_worker(config_with(worker_config, worker_id="sys-b", kv_disk_gb=0.0))
    workers = {"sys-a": a, "sys-b": b}
    try:
        holder, _, _ = await run(client, ticket(0))
        for i in range(1, 4):  # one at a time, each a conversation of its own
            ran, _, _ = await run(client, ticket(i))
            assert ran == holder, f"request {i} ran on {ran}, not on {holder}, which held its system prompt"
        assert placed(workers[holder]) == (3, 0, 1) and hits(workers[holder]) >= 3
        other = next(w for name, w in workers.items() if name != holder)
        assert placed(other) == (0, 0, 0)
    finally:
        await a.close()
        await b.close()


async def test_a_restarted_worker_advertises_its_system_prompt_from_disk_and_takes_the_next_request(
        worker_config: Any, client: Client, redis_url: str, tmp_path: Path) -> None:
    def config(name: str) -> Any:
        return config_with(worker_config, worker_id=name, kv_disk_gb=0.25, kv_dir=str(tmp_path / name))

    workers = {"disk-a": await start_worker(config("disk-a")), "disk-b": await start_worker(config("disk-b"))}
    redis = Redis.from_url(redis_url)
    try:
        holder, _, _ = await run(client, ticket(0))
        await workers[holder].close()  # a graceful stop: its advertisement withdrawn
        key = system_key()
        assert key.encode() not in await redis.smembers(client.keys.affinity_keys("tiny", holder))
        workers[holder] = await start_worker(config(holder))
        # advertised by its first heartbeat, before any job of the key ran on it
        assert key.encode() in await redis.smembers(client.keys.affinity_keys("tiny", holder))
        ran, _, _ = await run(client, ticket(1))
        assert ran == holder and placed(workers[holder]) == (1, 0, 0)
        engine = workers[holder].service.engine
        assert engine is not None and engine.stats.prefix_disk_hits == 1  # its system prompt, from disk
    finally:
        await redis.aclose()
        for w in workers.values():
            await w.close()
