"""The bulk band through the queue: a real Redis, a real arq worker on the tiny model. Bulk jobs fill an idle engine
(a whole room in one claim, as interactive jobs do), wait while interactive jobs do, give their place at once to an
interactive job that finds the engine full, and resume to end exactly once with the text they make alone; ``mlxq
status`` counts them apart."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.protocol.claim import EntryStatus
from mlxq.api.status import collect
from mlxq.worker import arqseam
from tests.support import RunningWorker, config_with, slow_steps, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def record_claims(running: RunningWorker) -> list[str]:
    """The ids of the jobs the worker's claims start, in the order CLAIM started them (the claim itself is real)."""
    order: list[str] = []
    transitions = running.host.transitions
    real = transitions.claim

    async def claim(*args: Any, **kw: Any) -> Any:
        due = await real(*args, **kw)
        order.extend(e.rid for e in due.entries if e.status is EntryStatus.STARTED)
        return due

    transitions.claim = claim  # type: ignore[method-assign]
    return order


def record_calls(running: RunningWorker) -> list[tuple[list[str], bool]]:
    """Each of the worker's claims: the ids it started, and whether it left due jobs queued."""
    calls: list[tuple[list[str], bool]] = []
    transitions = running.host.transitions
    real = transitions.claim

    async def claim(*args: Any, **kw: Any) -> Any:
        due = await real(*args, **kw)
        calls.append(([e.rid for e in due.entries if e.status is EntryStatus.STARTED], due.left))
        return due

    transitions.claim = claim  # type: ignore[method-assign]
    return calls


async def follow(client: Client, rid: str) -> list[Any]:
    return [ev async for ev in client.events(rid, timeout=120)]


def assert_one_clean_run(events: list[Any]) -> str:
    """The job started once, never reset, its events gapless with one terminal ``done``: its text."""
    types = [e.type for e in events]
    assert types.count("start") == 1 and "reset" not in types, types
    assert [e.seq for e in events] == list(range(len(events)))
    assert types[-1] == "done" and types.count("done") == 1 and "error" not in types
    return "".join(e.text for e in events if e.type == "token")


async def test_while_interactive_jobs_wait_a_worker_claims_no_bulk_job(worker_config: Any, client: Client) -> None:
    running = await start_worker(config_with(worker_config, capacity=2))
    running.worker.allow_pick_jobs = False  # everything queues first
    order = record_claims(running)
    try:
        bulk = [await client.submit(model="tiny", prompt=f"bulk {i}", max_tokens=8, bulk=True) for i in range(3)]
        inter = [await client.submit(model="tiny", prompt=f"chat {i}", max_tokens=8, priority=-100)
                 for i in range(3)]
        running.worker.allow_pick_jobs = True
        arqseam.wake()
        for rid in [*inter, *bulk]:
            assert (await client.result(rid, timeout=120)).usage.completion_tokens == 8
        # bulk jobs were queued first and interactive ones have the lowest priority: still every interactive
        # job was claimed before any bulk one
        assert sorted(order[:3]) == sorted(inter) and sorted(order[3:]) == sorted(bulk)
    finally:
        await running.close()


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "interactive"])
async def test_a_lone_worker_claims_its_whole_room_in_one_claim_in_either_band(worker_config: Any, client: Client,
                                                                                bulk: bool) -> None:
    # No interactive job waits: a batch alone is claimed as the same jobs submitted interactively are, not fewer
    # per claim (its throughput is the engine's).
    running = await start_worker(config_with(worker_config, capacity=4))
    running.worker.allow_pick_jobs = False  # everything queues first
    calls = record_calls(running)
    try:
        room = running.service.room()
        assert room == 4
        jobs = [await client.submit(model="tiny", prompt=f"line {i}", max_tokens=8, bulk=bulk)
                for i in range(room + 2)]
        running.worker.allow_pick_jobs = True
        arqseam.wake()
        for rid in jobs:
            assert (await client.result(rid, timeout=120)).usage.completion_tokens == 8
        started = [(len(ids), left) for ids, left in calls if ids]
        assert started[0] == (room, True)  # the whole room at once; the rest left queued for the rows' ends
        assert sum(n for n, _ in started) == len(jobs)
    finally:
        await running.close()


async def test_an_interactive_job_takes_a_bulk_rows_place_at_once_and_the_bulk_job_resumes_exactly(
        worker_config: Any, client: Client) -> None:
    running = await start_worker(config_with(worker_config, capacity=2))
    full_speed = slow_steps(running, 0.01)  # the bulk rows are still decoding when the interactive job comes
    order = record_claims(running)
    try:
        prompts = [f"a long batch line number {i}" for i in range(4)]
        bulk = [await client.submit(model="tiny", prompt=p, max_tokens=120, bulk=True) for p in prompts]
        follows = {rid: asyncio.ensure_future(follow(client, rid)) for rid in bulk}
        engine = running.service.engine
        async with asyncio.timeout(60):  # nothing else waits: bulk jobs fill the engine
            while engine.scheduler.num_running < 2 or engine.stats.steps < 5:
                await asyncio.sleep(0.01)
        # two of them (jobs enqueued within one millisecond share a score and sort by id, not by submit order)
        assert len(order) == 2 and set(order) <= set(bulk) and running.service.room() == 0
        report = (await collect(client)).to_json()
        (tiny,) = [m for m in report["models"] if m["name"] == "tiny"]
        assert (tiny["bulk_queued"], tiny["bulk"], tiny["queued"]) == (2, 2, 0)  # status shows the band apart
        chat = await client.submit(model="tiny", prompt="an interactive question", max_tokens=20)
        chat_events = await follow(client, chat)
        assert order.index(chat) == 2  # claimed before any further bulk job
        assert engine.stats.preemptions >= 1 and engine.stats.started_at_once >= 1
        full_speed()  # what is left is not timed
        assert assert_one_clean_run(chat_events)
        texts = {rid: assert_one_clean_run(await fut) for rid, fut in follows.items()}
        assert engine.stats.resumes + engine.stats.recomputes >= 1
        for rid, prompt in zip(bulk, prompts):
            alone = await client.generate(model="tiny", prompt=prompt, max_tokens=120, timeout=120)
            assert texts[rid] == alone.text and alone.usage.completion_tokens == 120
    finally:
        await running.close()
