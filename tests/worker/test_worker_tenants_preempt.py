"""Tenants in one worker's full batch (a real Redis, a real worker, the tiny model): a tenant below its share
there is claimed and starts at once in the place of a job of a tenant above it, ahead of that tenant's flood;
a tenant at its share preempts nobody else's job, whatever its priority (only its own). A preempted job's text
is what it makes alone."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.engine.core import scheduler
from tests.support import RunningWorker, config_with, slow_steps, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def events_of(client: Client, rids: list[str], after_first: Callable[[], None] = lambda: None
                    ) -> tuple[dict[str, list[Any]], dict[str, float], dict[str, float]]:
    """Each job's events to its end, and when its start and its end came (one subscription per job);
    ``after_first`` is called once the first job has ended."""
    events: dict[str, list[Any]] = {}
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}

    async def follow(rid: str) -> None:
        events[rid] = []
        async for ev in client.events(rid, timeout=120):
            events[rid].append(ev)
            if ev.type == "start":
                starts.setdefault(rid, time.monotonic())
        ends[rid] = time.monotonic()
        if len(ends) == 1:
            after_first()

    await asyncio.gather(*(follow(rid) for rid in rids))
    return events, starts, ends


async def full(running: RunningWorker, n: int) -> None:
    engine = running.service.engine
    async with asyncio.timeout(60):
        while engine.scheduler.num_running < n or engine.stats.steps < 5:
            await asyncio.sleep(0.01)
    assert running.service.room() == 0


async def assert_as_alone(client: Client, events: list[Any], prompt: str, max_tokens: int) -> None:
    types = [e.type for e in events]
    assert types.count("start") == 1 and "reset" not in types and types[-1] == "done"
    assert [e.seq for e in events] == list(range(len(events)))  # no gap, no duplicate
    alone = await client.generate(model="tiny", prompt=prompt, max_tokens=max_tokens, timeout=120)
    assert "".join(e.text for e in events if e.type == "token") == alone.text


async def test_a_tenant_below_its_share_starts_at_once_ahead_of_another_tenants_flood(
        worker_config: Any, redis_url: str) -> None:
    running = await start_worker(config_with(worker_config, capacity=2))
    full_speed = slow_steps(running, 0.01)
    try:
        async with Client(redis_url, tenant="acme") as acme, Client(redis_url, tenant="globex") as globex:
            prompts = [f"a long batch job {i}" for i in range(5)]
            flood = [await acme.submit(model="tiny", prompt=p, max_tokens=120) for p in prompts]
            await full(running, 2)
            first_two = [rid for rid, _ in running.service.active]
            assert len(first_two) == 2 and set(first_two) < set(flood)  # the rest of the flood waits in Redis
            probe = await globex.submit(model="tiny", prompt="a short question", max_tokens=8)
            # Full speed once the first job ended: the order the test checks is settled by then.
            events, starts, ends = await events_of(acme, [probe, *flood], full_speed)
            queued_before = [rid for rid in flood if rid not in first_two]
            assert all(starts[probe] < starts[rid] for rid in queued_before)  # not behind acme's flood
            assert ends[probe] < min(ends[rid] for rid in flood)  # nor behind the jobs running when it came
            assert all(evs[-1].type == "done" for evs in events.values())
            stats = running.service.engine.stats
            assert stats.preemptions >= 1 and stats.started_at_once >= 1
            for rid in first_two:  # one of them stepped aside and resumed
                await assert_as_alone(acme, events[rid], prompts[flood.index(rid)], 120)
    finally:
        await running.close()


async def test_a_tenant_at_its_share_preempts_only_its_own_jobs_whatever_its_priority(
        worker_config: Any, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    running = await start_worker(config_with(worker_config, capacity=2))
    full_speed = slow_steps(running, 0.01)
    try:
        async with Client(redis_url, tenant="acme") as acme, Client(redis_url, tenant="globex") as globex:
            theirs = await acme.submit(model="tiny", prompt="acme's long job", max_tokens=120)
            own = await globex.submit(model="tiny", prompt="globex's long job", max_tokens=120)
            await full(running, 2)  # one each: both at their share
            with caplog.at_level(logging.INFO, logger=scheduler.__name__):
                urgent = await globex.submit(model="tiny", prompt="urgent", max_tokens=8, priority=5)
                events, _, ends = await events_of(acme, [theirs, own, urgent], full_speed)  # as above: settled
            preempted = [r.getMessage() for r in caplog.records if " preempted " in r.getMessage()]
            assert len(preempted) == 1 and preempted[0].startswith(f"request {own} preempted")  # its own job
            assert running.service.engine.stats.preemptions == 1
            assert events[urgent][-1].type == "done" and ends[urgent] < min(ends[theirs], ends[own])
            await assert_as_alone(acme, events[theirs], "acme's long job", 120)
            await assert_as_alone(globex, events[own], "globex's long job", 120)
    finally:
        await running.close()


async def test_a_job_of_the_flood_on_its_way_does_not_hold_back_a_tenant_below_its_share(
        worker_config: Any, redis_url: str) -> None:
    # A flood refills each freed slot at once, so one of its jobs is nearly always between the claim and the
    # engine's next step; a full engine used to close its tenants' parts meanwhile, and a job of a tenant below
    # its share waited in Redis for the fallback poll.
    running = await start_worker(config_with(worker_config, capacity=2))
    slow_steps(running, 0.01)
    try:
        async with Client(redis_url, tenant="acme") as acme, Client(redis_url, tenant="globex") as globex:
            flood = [await acme.submit(model="tiny", prompt=f"a long batch job {i}", max_tokens=120) for i in range(2)]
            await full(running, 2)
            engine = running.service.engine
            engine.expect(1, 60.0, ["acme"])  # the flood's next job, claimed: on its way (it never comes)
            share = running.service.below_share()
            assert share is not None and share.spare == 1.0 and share.running == {"acme": 3}
            probe = await globex.submit(model="tiny", prompt="a short question", max_tokens=8)
            events, starts, ends = await events_of(acme, [probe, *flood])
            assert ends[probe] < min(ends[rid] for rid in flood)  # it took one of acme's places
            assert engine.stats.preemptions >= 1 and engine.stats.started_at_once >= 1
            assert all(evs[-1].type == "done" for evs in events.values())
    finally:
        await running.close()
