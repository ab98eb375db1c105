"""Prefix affinity through real workers: a conversation's next turn starts on the worker whose prefix cache holds
its start (in this process: two workers; the outcome counters of the health record and /metrics say so), with
mlx-lm's greedy tokens; a full holder leaves the next turn to the other worker at once, and (slow, two worker
processes) a killed or frozen one once it waited the bound."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from mlxq.api.client import Client
from mlxq.api.schema import StartEvent, TokenEvent, WorkerStatus
from mlxq.api.status import collect as collect_report
from mlxq.api.status import render
from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.worker.tools.process import WorkerProcess
from tests.support import RunningWorker, collect, config_with, free_port, reference, slow_steps, start_worker, terminal
from tests.worker.test_worker_metrics import scrape, value

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


def conversation(i: int) -> list[dict[str, str]]:
    system = {"role": "system", "content": f"Conversation {i}: you answer for a job queue that routes by cache. " * 5}
    return [system, {"role": "user", "content": f"What is turn one of conversation {i}?"}]


def next_turn(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the next?"}]


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


async def run(client: Client, messages: list[dict[str, str]], **fields: Any) -> tuple[str, list[int], str]:
    """One job: the worker that ran it, its tokens, its text."""
    rid = await client.submit(model="tiny", messages=messages, max_tokens=MAX_TOKENS, **fields)
    events = await collect(client, rid)
    assert terminal(events).type == "done"
    (start,) = [e for e in events if isinstance(e, StartEvent)]
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    return start.worker, tokens, "".join(e.text for e in events if isinstance(e, TokenEvent))


def placed(w: RunningWorker) -> tuple[int, int, int]:
    (m,) = w.host.status().models
    return m.affinity_holder, m.affinity_elsewhere, m.affinity_none


async def two_workers(worker_config: Any, **changes: Any) -> tuple[RunningWorker, RunningWorker]:
    a = await start_worker(config_with(worker_config, worker_id="aff-a", kv_disk_gb=0.0, **changes))
    b = await start_worker(config_with(worker_config, worker_id="aff-b", kv_disk_gb=0.0, **changes))
    return a, b


async def test_each_conversations_next_turn_starts_on_the_worker_holding_it(worker_config: Any, client: Client,
                                                                            lm: Any) -> None:
    a, b = await two_workers(worker_config)
    workers = {"aff-a": a, "aff-b": b}
    try:
        for i in range(4):
            first = conversation(i)
            holder, _, answer = await run(client, first)
            second = next_turn(first, answer)
            ran, tokens, _ = await run(client, second)
            assert ran == holder, f"conversation {i}'s next turn ran on {ran}, not on {holder}, which held it"
            assert tokens == reference(lm, encode_prompt_with_boundary(lm[1], None, second).tokens, MAX_TOKENS)
        # every first turn had a key no worker held; every second turn started on its holder, from its cache
        assert tuple(map(sum, zip(placed(a), placed(b)))) == (4, 0, 4)
        assert sum(w.service.engine.stats.prefix_hits for w in workers.values()) >= 4
        assert all(m.affinity_keys >= 1 for w in workers.values() if placed(w)[2] for m in w.host.status().models)
        await asyncio.gather(*(w.host.health.beat() for w in workers.values()))
        report = await collect_report(client)
        assert "AFFINITY" in render(report) and "PREFIX" in render(report)
        records = report.to_json()["workers"]
        assert sum(r["models"][0]["affinity_holder"] for r in records) == 4
        assert sum(r["models"][0]["affinity_none"] for r in records) == 4
    finally:
        await a.close()
        await b.close()


async def test_the_same_turn_gives_the_same_greedy_tokens_with_and_without_affinity(worker_config: Any,
                                                                                     client: Client) -> None:
    a, b = await two_workers(worker_config)
    try:
        first = conversation(9)
        _, _, answer = await run(client, first)
        second = next_turn(first, answer)
        _, cached, _ = await run(client, second)  # on the holder, from its prefix cache
        _, again, _ = await run(client, second, prompt_cache_key="unheld")  # a key nobody holds: anywhere
    finally:
        await a.close()
        await b.close()
    assert cached == again
    assert tuple(map(sum, zip(placed(a), placed(b)))) == (1, 0, 2)  # the third's key: held by nobody


async def full_mark(w: RunningWorker) -> float | None:
    """The worker's full mark for the model in Redis (its lapse time, ms), or None."""
    host = w.host
    score: float | None = await host.redis.zscore(host.keys.affinity_full("tiny"), host.config.worker_id)
    return score


async def until(check: Any) -> None:
    """Wait (polling) until ``check()`` is true: what a worker writes in the background lands."""
    while not await check():
        await asyncio.sleep(0.01)


async def test_a_full_holder_leaves_the_next_turn_to_the_other_worker_at_once(worker_config: Any,
                                                                              client: Client) -> None:
    # one job at a time (a running one fills it), and a wait longer than the test's: only the full mark lets
    # another worker take the holder's key
    a, b = await two_workers(worker_config, max_jobs=1, affinity_wait_ms=3_600_000.0)
    workers = {"aff-a": a, "aff-b": b}
    try:
        first = conversation(5)
        holder, _, answer = await run(client, first)
        other = next(w for name, w in workers.items() if name != holder)
        await until(lambda: _cleared(workers[holder]))  # full while it ran that turn, free once it ended
        slow_steps(workers[holder], 0.02)  # its next job runs long enough to keep it full
        # the holder takes it (greedy, the tiny model never stops before its max_tokens on these prompts)
        busy = await client.submit(model="tiny", messages=first, max_tokens=200)
        async for ev in client.events(busy, timeout=60):
            if isinstance(ev, StartEvent):
                assert ev.worker == holder
                break
        else:
            pytest.fail("the holder's long job ended without starting")
        await until(lambda: _marked(workers[holder]))
        ran, _, _ = await run(client, next_turn(first, answer))
        assert ran != holder
        assert placed(other) == (0, 1, placed(other)[2])  # taken elsewhere: its holder was full
        await client.cancel(busy)
        await until(lambda: _cleared(workers[holder]))  # freed: its mark goes (it takes its keys' jobs again)
        assert workers[holder].host.affinity.full_writes >= 2
    finally:
        await a.close()
        await b.close()


async def _marked(w: RunningWorker) -> bool:
    return await full_mark(w) is not None


async def _cleared(w: RunningWorker) -> bool:
    return await full_mark(w) is None


# --- two worker processes --------------------------------------------------------------------------------
def start_process(name: str, redis_url: str, tiny_model: Path, tmp_path: Path, port: int,
                  disk: bool = False) -> WorkerProcess:
    """A worker process; ``disk``: with its prefix cache's tier on disk, in a directory of its own."""
    env = {"MLXQ_MODEL": str(tiny_model), "MLXQ_MODEL_NAME": "tiny", "MLXQ_REDIS_URL": redis_url,
           "MLXQ_KV_DISK_GB": "0.25" if disk else "0", "MLXQ_KV_DIR": str(tmp_path / f"{name}-kv"),
           "MLXQ_METRICS_PORT": str(port), "MLXQ_METRICS_ADDR": "127.0.0.1", "MLXQ_LEASE_TTL": "2",
           "MLXQ_REAP_INTERVAL": "0.5"}
    return WorkerProcess(env, tmp_path / f"{name}.log").start()


@pytest.mark.slow
async def ready(procs: dict[str, WorkerProcess]) -> dict[str, str]:
    """Each started worker's name by its worker id, once all are ready."""
    ids: dict[str, str] = {}
    for name, proc in procs.items():
        status: WorkerStatus = await asyncio.to_thread(proc.wait_ready, 180)
        ids[status.id] = name
    return ids


@pytest.mark.slow  # a fault or a whole program: out of the everyday run
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
async def test_a_killed_or_frozen_holder_leaves_the_next_turn_to_the_other_worker(
        redis_url: str, tiny_model: Path, tmp_path: Path, client: Client, how: str) -> None:
    ports = {"one": free_port(), "two": free_port()}
    procs = {name: start_process(name, redis_url, tiny_model, tmp_path, port) for name, port in ports.items()}
    try:
        ids = await ready(procs)
        first = conversation(7)
        holder_id, _, answer = await run(client, first)
        holder = ids[holder_id]
        other = next(name for name in procs if name != holder)
        samples = await asyncio.to_thread(scrape, ports[holder])
        assert value(samples, "mlxq:affinity_keys", model_name="tiny") == 1
        procs[holder].signal(signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        ran, _, _ = await run(client, next_turn(first, answer))  # its advertisement is still live: waits the bound
        assert ids[ran] == other
        samples = await asyncio.to_thread(scrape, ports[other])
        assert value(samples, "mlxq:affinity_placements_total", model_name="tiny", outcome="elsewhere") == 1
        assert value(samples, "mlxq:affinity_placements_total", model_name="tiny", outcome="holder") == 0
        await asyncio.sleep(2.5)  # a heartbeat: the health record shows it too
        record = next(w for w in await client.workers() if ids.get(w.id) == other)
        assert record.models[0].affinity_elsewhere == 1
    finally:
        for proc in procs.values():
            proc.signal(signal.SIGCONT)
            proc.kill()


@pytest.mark.slow
async def test_a_restarted_holder_advertises_its_prefixes_on_disk_and_takes_their_next_turn(
        redis_url: str, tiny_model: Path, tmp_path: Path, client: Client) -> None:
    ports = {"one": free_port(), "two": free_port()}
    procs = {name: start_process(name, redis_url, tiny_model, tmp_path, port, disk=True)
             for name, port in ports.items()}
    redis = Redis.from_url(redis_url)
    try:
        ids = await ready(procs)
        first = conversation(8)
        holder_id, _, answer = await run(client, first)
        holder = ids[holder_id]
        held = await redis.smembers(client.keys.affinity_keys("tiny", holder_id))
        assert len(held) == 1
        assert await asyncio.to_thread(procs[holder].stop) == 0  # SIGTERM: its warm prefixes go to its disk
        procs[holder] = start_process(holder, redis_url, tiny_model, tmp_path, ports[holder], disk=True)
        status = await asyncio.to_thread(procs[holder].wait_ready, 180)
        ids[status.id] = holder
        # advertised by its first heartbeat, before any job of the key ran on it
        assert await redis.smembers(client.keys.affinity_keys("tiny", status.id)) == held
        samples = await asyncio.to_thread(scrape, ports[holder])
        assert value(samples, "mlxq:affinity_keys", model_name="tiny") == 1
        ran, _, _ = await run(client, next_turn(first, answer))
        assert ran == status.id
        samples = await asyncio.to_thread(scrape, ports[holder])
        assert value(samples, "mlxq:affinity_placements_total", model_name="tiny", outcome="holder") == 1
        assert value(samples, "mlxq:prefix_disk_hits_total", model_name="tiny") == 1  # its prefix, from disk
    finally:
        await redis.aclose()
        for proc in procs.values():
            proc.kill()
