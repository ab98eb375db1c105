"""Priority and KV-memory admission through the queue: a real Redis, a real arq worker on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.errors import JobFailed
from mlxq.api.schema import ErrorCode
from mlxq.worker import arqseam
from tests.support import config_with, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def _ends_in_order(client: Client, rids: list[str], after_first: Callable[[], None] = lambda: None
                         ) -> list[str]:
    """The jobs in the order they ended; ``after_first`` is called once the first has ended."""
    order: list[str] = []

    async def follow(rid: str) -> None:
        await client.result(rid, timeout=60)
        order.append(rid)
        if len(order) == 1:
            after_first()

    await asyncio.gather(*(follow(rid) for rid in rids))
    return order


async def test_higher_priority_jobs_are_claimed_first_and_aging_lets_an_old_job_through(
        worker_config: Any, redis_url: str) -> None:
    # One job at a time, so the order jobs end in is the order they were claimed in.
    running = await start_worker(config_with(worker_config, capacity=1, max_jobs=1, priority_aging_s=0.2))
    running.worker.allow_pick_jobs = False  # everything queues first
    try:
        async with Client(redis_url, config=ClientConfig(priority_aging_s=0.2)) as client:
            old = await client.submit(model="tiny", prompt="old, ordinary", max_tokens=3)
            await asyncio.sleep(1.0)  # five levels' worth of waiting
            low = await client.submit(model="tiny", prompt="ordinary", max_tokens=3)
            urgent = await client.submit(model="tiny", prompt="urgent", max_tokens=3, priority=10)
            higher = await client.submit(model="tiny", prompt="a little higher", max_tokens=3, priority=2)
            running.worker.allow_pick_jobs = True
            arqseam.wake()
            order = await _ends_in_order(client, [old, low, urgent, higher])
        # urgent (10 levels) beats old (waited 5 levels' worth); old beats higher (2 levels); low comes last.
        assert order == [urgent, old, higher, low]
    finally:
        await running.close()


async def test_a_job_that_can_never_fit_the_kv_headroom_ends_at_once_saying_by_how_much(
        worker_config: Any, client: Client) -> None:
    running = await start_worker(config_with(worker_config, kv_headroom_gb=0.0002))  # ~200 KiB of KV cache
    try:
        with pytest.raises(JobFailed) as failed:
            await client.generate(model="tiny", prompt="Hello " * 10, max_tokens=400, timeout=60)
        assert failed.value.code is ErrorCode.BAD_REQUEST
        assert "more than this worker's KV headroom" in str(failed.value)
        small = await client.generate(model="tiny", prompt="Hello", max_tokens=4, timeout=60)  # serves on
        assert small.usage.completion_tokens == 4
        assert running.service.engine.stats.rejected_too_large == 1
    finally:
        await running.close()


async def test_a_worker_claims_only_what_its_kv_headroom_can_start_and_another_takes_the_rest(
        worker_config: Any, client: Client) -> None:
    from tests.support import slow_steps

    # 1 MiB of KV holds a few of these jobs on the tiny model: the worker with it must leave the rest in Redis
    # for the other worker on the same queue, instead of holding them while its batch cannot start them.
    narrow = await start_worker(config_with(worker_config, kv_headroom_gb=0.001, worker_id="narrow"))
    wide = await start_worker(config_with(worker_config, worker_id="wide"))
    try:
        full_speeds = [slow_steps(w, 0.01) for w in (narrow, wide)]
        memory = narrow.service.engine.scheduler.memory
        assert memory is not None
        room = memory.rows_that_fit(12 + 400, 0)  # a job's prompt and max_tokens, as the engine charges it
        assert 0 < room < worker_config.capacity
        held: list[int] = []

        async def watch() -> None:
            while True:
                held.append(len(narrow.host.runs))
                await asyncio.sleep(0.002)

        watcher = asyncio.ensure_future(watch())
        rids = [await client.submit(model="tiny", prompt=f"job {i}", max_tokens=400) for i in range(12)]
        starts = [await _start(client, rid) for rid in rids]
        watcher.cancel()  # every job claimed: none is left to hold
        for full_speed in full_speeds:
            full_speed()  # what is left of the jobs is not timed
        ran_on = [s.worker for s in starts]
        assert max(held) <= room, (max(held), room)  # never more than it could start (arq's slots would allow 10)
        assert ran_on.count("narrow") >= 1 and ran_on.count("wide") >= 1
        for rid in rids:
            assert (await client.result(rid, timeout=120)).usage.completion_tokens == 400
    finally:
        await narrow.close()
        await wide.close()


async def _start(client: Client, rid: str) -> Any:
    """The job's start event, as soon as it comes."""
    async for ev in client.events(rid, timeout=120):
        if ev.type == "start":
            return ev
    raise AssertionError(f"job {rid} ended without a start event")


async def test_priority_moves_a_job_in_its_queue_without_shortening_its_keys_ttls(client: Client,
                                                                               redis_url: str) -> None:
    import json
    import time

    import redis.asyncio as aredis

    from mlxq.api.client import JOB_TTL_MS
    from mlxq.api.protocol.keys import Keys, queue_score

    keys, queue = Keys(), Keys().queue("ghost")  # nobody serves it: the jobs stay queued
    t0 = time.monotonic()
    rids = {p: await client.submit(model="ghost", prompt=f"priority {p}", priority=p) for p in (-100, 0, 100)}
    r = aredis.Redis.from_url(redis_url)
    try:
        ttls = [await r.pttl(keys.job(rid)) for rid in rids.values()]
        elapsed_ms = (time.monotonic() - t0) * 1000
        for ttl in [*ttls, await r.pttl(queue)]:  # what the job record was given, less the time since
            assert JOB_TTL_MS - elapsed_ms - 1 <= ttl <= JOB_TTL_MS
        assert [m.decode() for m in await r.zrange(queue, 0, -1)] == [rids[100], rids[0], rids[-100]]
        aging_ms = int(client.config.priority_aging_s * 1000)
        for p, rid in rids.items():
            enqueued = json.loads(await r.get(keys.job(rid)))["et"]
            score = await r.zscore(queue, rid)
            assert score == queue_score(enqueued, p, aging_ms) <= enqueued  # due at once, whatever the priority
    finally:
        await r.aclose()


async def test_a_preempted_job_streams_through_redis_with_no_gap_duplicate_or_reset(
        worker_config: Any, client: Client, tiny_model: Any) -> None:
    from mlx_lm import load

    from mlxq.engine.mlx.memory import measure_layout
    from tests.support import slow_steps

    # A worker claims only what its batch can start, so the urgent job must look as if it fits when claimed
    # and be short of KV when admitted: the headroom holds two rows of the low job (~110 tokens, each row
    # padded up to a 256-token step: about 360 tokens' worth) but not the low job beside the urgent one
    # (~410 tokens: two rows padded to it), and the urgent one alone.
    bytes_per_token = measure_layout(load(str(tiny_model))[0]).bytes_per_token
    headroom_gb = 800 * bytes_per_token / (1 << 30)
    running = await start_worker(config_with(worker_config, capacity=4, kv_headroom_gb=headroom_gb))
    full_speed = slow_steps(running, 0.01)  # the low job is still decoding when the urgent one comes
    try:
        prompt = "a job of low priority"
        low = await client.submit(model="tiny", prompt=prompt, max_tokens=100, priority=-5)
        events: list[Any] = []
        urgent: str | None = None
        stats = running.service.engine.stats

        async def full_speed_once_preempted() -> None:  # what follows the preemption is not timed
            while stats.preemptions < 1:
                await asyncio.sleep(0.01)
            full_speed()

        speed = asyncio.ensure_future(full_speed_once_preempted())
        async for ev in client.events(low, timeout=120):
            events.append(ev)
            if ev.type == "token" and urgent is None:
                urgent = await client.submit(model="tiny", prompt="urgent", max_tokens=400, priority=100)
        speed.cancel()
        assert urgent is not None
        assert (await client.result(urgent, timeout=120)).usage.completion_tokens == 400
        assert stats.preemptions >= 1 and stats.resumes + stats.recomputes >= 1
        types = [e.type for e in events]
        assert types.count("start") == 1 and types[0] == "start" and "reset" not in types
        assert types[-1] == "done" and types.count("done") == 1
        assert [e.seq for e in events] == list(range(len(events)))  # no gap, no duplicate
        text = "".join(e.text for e in events if e.type == "token")
        alone = await client.generate(model="tiny", prompt=prompt, max_tokens=100, timeout=120)
        assert text == alone.text and alone.usage.completion_tokens == 100
    finally:
        await running.close()


async def test_a_worker_whose_batch_is_full_still_claims_a_job_that_outranks_its_running_ones(
        worker_config: Any, client: Client) -> None:
    from tests.support import slow_steps

    # Every slot is busy with long low-priority jobs, so the worker has no room to claim by: an urgent job must
    # not wait in Redis until one ends. It is claimed, starts at once (a low job steps aside, holding its
    # cache) and ends long before them; the low jobs' text is what they make alone.
    running = await start_worker(config_with(worker_config, capacity=2))
    full_speed = slow_steps(running, 0.01)
    try:
        prompts = {"low 1": "a long job of low priority", "low 2": "another long job of low priority"}
        lows = {await client.submit(model="tiny", prompt=p, max_tokens=300, priority=-1): p for p in prompts.values()}
        engine = running.service.engine
        async with asyncio.timeout(60):
            while engine.scheduler.num_running < 2 or engine.stats.steps < 5:
                await asyncio.sleep(0.01)
        assert running.service.room() == 0
        urgent = await client.submit(model="tiny", prompt="urgent", max_tokens=20, priority=5)
        order = await _ends_in_order(client, [urgent, *lows], full_speed)  # the order is settled once one ended
        assert order[0] == urgent and engine.stats.preemptions >= 1
        for rid, prompt in lows.items():
            events = [ev async for ev in client.events(rid, timeout=60)]
            types = [e.type for e in events]
            assert types.count("start") == 1 and "reset" not in types
            assert [e.seq for e in events] == list(range(len(events)))
            alone = await client.generate(model="tiny", prompt=prompt, max_tokens=300, timeout=120)
            assert "".join(e.text for e in events if e.type == "token") == alone.text
    finally:
        await running.close()


async def test_a_burst_of_jobs_that_outrank_a_full_batch_all_start_before_any_slot_frees(
        worker_config: Any, client: Client) -> None:
    from tests.support import slow_steps

    # Four low jobs fill every slot and the model's job cap counts them; four priority-10 jobs come together.
    # Each would start at once by the engine's own rule (a low one steps aside), so each is claimed at once:
    # paused jobs do not fill the cap, and a claim takes every such job, not one per poll.
    running = await start_worker(config_with(worker_config, capacity=4))
    full_speed = slow_steps(running, 0.01)
    try:
        lows = [await client.submit(model="tiny", prompt=f"a long low job {i}", max_tokens=200) for i in range(4)]
        engine = running.service.engine
        async with asyncio.timeout(60):
            while engine.scheduler.num_running < 4 or engine.stats.steps < 5:
                await asyncio.sleep(0.01)
        highs = await asyncio.gather(*(client.submit(model="tiny", prompt=f"urgent {i}", max_tokens=8, priority=10)
                                       for i in range(4)))
        firsts: dict[str, float] = {}
        ends: dict[str, float] = {}
        events: dict[str, list[Any]] = {}

        async def follow(rid: str) -> None:
            events[rid] = []
            async for ev in client.events(rid, timeout=120):
                events[rid].append(ev)
                if ev.type == "token":
                    firsts.setdefault(rid, asyncio.get_running_loop().time())
            ends[rid] = asyncio.get_running_loop().time()
            if all(h in ends for h in highs):  # every first token is in: the rest is not timed
                full_speed()

        await asyncio.gather(*(follow(rid) for rid in [*highs, *lows]))
        assert max(firsts[h] for h in highs) < min(ends.values())  # every one before any job ended: no slot freed
        assert engine.stats.preemptions >= 4 and engine.stats.started_at_once >= 4
        for i, rid in enumerate([*highs, *lows]):
            evs = events[rid]
            assert [e.seq for e in evs] == list(range(len(evs))) and evs[-1].type == "done"  # gapless, one end
            prompt, n = (f"urgent {i}", 8) if i < 4 else (f"a long low job {i - 4}", 200)
            alone = await client.generate(model="tiny", prompt=prompt, max_tokens=n, timeout=120)
            assert "".join(e.text for e in evs if e.type == "token") == alone.text
    finally:
        await running.close()
