"""``api.protocol.enqueuer``: submits made together reach Redis in one round trip, each with its own outcome.

On the session's real Redis server (``redis_url`` empties it before each test).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api.client import Client
from mlxq.api.errors import DuplicateJob
from mlxq.api.protocol.jobrecord import read_job

MODEL = "m"


async def queued(redis_url: str) -> dict[str, Any]:
    """Job id -> the payload stored for it, for every job on the model's queue."""
    r = aredis.Redis.from_url(redis_url)
    try:
        ids = [i.decode() for i in await r.zrange(f"mlxq:queue:{MODEL}", 0, -1)]
        return {i: read_job(await r.get(f"mlxq:{{{i}}}:job"), 1 << 20).payload for i in ids}
    finally:
        await r.aclose()


async def test_a_burst_of_submits_is_one_round_trip(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="warm")  # Redis has the script from now on
    before = client._enqueuer.round_trips
    ids = await asyncio.gather(*(client.submit(model=MODEL, prompt=f"p{i}", id=f"j{i}") for i in range(20)))
    assert ids == [f"j{i}" for i in range(20)]
    assert client._enqueuer.round_trips - before == 1
    jobs = await queued(redis_url)
    assert {i: p["prompt"] for i, p in jobs.items()} == {"warm": "p"} | {f"j{i}": f"p{i}" for i in range(20)}


async def test_a_burst_wakes_the_models_workers_once_even_if_its_last_id_is_refused(client: Client,
                                                                                   redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="dup")
    r = aredis.Redis.from_url(redis_url)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(client.keys.wake_channel(MODEL), client.keys.wake_channel("other"))
    try:
        ids = [f"w{i}" for i in range(5)] + ["dup"]
        outcomes = await asyncio.gather(*(client.submit(model=MODEL, prompt="p", id=i) for i in ids),
                                        client.submit(model="other", prompt="p", id="o1"), return_exceptions=True)
        assert isinstance(outcomes[5], DuplicateJob)
        wakes = []
        deadline = asyncio.get_running_loop().time() + 0.5
        while asyncio.get_running_loop().time() < deadline:  # (confirmations of the SUBSCRIBE read as None)
            msg = await pubsub.get_message(timeout=0.05)
            if msg is not None:
                wakes.append(msg["channel"].decode())
        assert sorted(wakes) == sorted([client.keys.wake_channel(MODEL), client.keys.wake_channel("other")])
    finally:
        await pubsub.aclose()
        await r.aclose()


async def test_sequential_submits_each_go_alone(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="s0")
    before = client._enqueuer.round_trips
    for i in (1, 2, 3):
        await client.submit(model=MODEL, prompt="p", id=f"s{i}")
    assert client._enqueuer.round_trips - before == 3
    assert set(await queued(redis_url)) == {"s0", "s1", "s2", "s3"}


async def test_submits_made_while_a_send_is_in_flight_go_out_together_next(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="warm")
    enq = client._enqueuer
    real, gate, sizes = enq._exchange, asyncio.Event(), []

    async def held(commands: list[tuple[Any, ...]]) -> list[Any]:  # the first send waits in flight
        sizes.append(len(commands))
        if len(sizes) == 1:
            await gate.wait()
        return await real(commands)

    enq._exchange = held  # type: ignore[method-assign]
    first = asyncio.ensure_future(client.submit(model=MODEL, prompt="p", id="first"))
    while not sizes:
        await asyncio.sleep(0)
    later = asyncio.gather(*(client.submit(model=MODEL, prompt="p", id=f"later{i}") for i in range(5)))
    for _ in range(3):
        await asyncio.sleep(0)  # every later submit is waiting for the sender
    gate.set()
    assert await first == "first" and await later == [f"later{i}" for i in range(5)]
    assert sizes == [1, 5]  # one pipeline for the five, sent when the first came back
    assert set(await queued(redis_url)) == {"warm", "first", *(f"later{i}" for i in range(5))}


async def test_a_send_cancelled_before_its_reply_leaves_none_to_misread(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="warm")
    enq = client._enqueuer
    conn = enq._conn
    assert conn is not None
    real_read, entered, gate = conn.read_response, asyncio.Event(), asyncio.Event()

    async def stuck(*args: Any, **kwargs: Any) -> Any:  # the reply sits unread on the connection
        entered.set()
        await gate.wait()
        return await real_read(*args, **kwargs)

    conn.read_response = stuck  # type: ignore[method-assign]
    first = asyncio.ensure_future(client.submit(model=MODEL, prompt="p", id="dup"))
    await entered.wait()
    assert enq._sender is not None
    enq._sender.cancel()  # as a closing event loop does
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()  # a reused connection would now read the first reply
    # Redis ran the first ENQUEUE; had its reply (1) been left for the next send, this would not fail
    with pytest.raises(DuplicateJob):
        await client.submit(model=MODEL, prompt="another job", id="dup")
    assert await client.submit(model=MODEL, prompt="p", id="next") == "next"
    assert enq._conn is not conn


async def test_a_duplicate_in_a_burst_fails_alone(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="first", id="taken")
    outcomes = await asyncio.gather(
        *(client.submit(model=MODEL, prompt="again" if i == 2 else "p", id="taken" if i == 2 else f"b{i}")
          for i in range(5)),
        return_exceptions=True,
    )
    assert isinstance(outcomes[2], DuplicateJob)
    assert [o for i, o in enumerate(outcomes) if i != 2] == ["b0", "b1", "b3", "b4"]
    jobs = await queued(redis_url)
    assert jobs["taken"]["prompt"] == "first"  # the duplicate overwrote nothing
    assert set(jobs) == {"taken", "b0", "b1", "b3", "b4"}


@pytest.mark.parametrize("burst", [1, 6])
async def test_submits_survive_redis_losing_its_scripts(client: Client, redis_url: str, burst: int) -> None:
    await client.submit(model=MODEL, prompt="p", id="before")
    r = aredis.Redis.from_url(redis_url)
    await r.script_flush()  # as a Redis restart does
    await r.aclose()
    ids = await asyncio.gather(*(client.submit(model=MODEL, prompt="p", id=f"f{i}") for i in range(burst)))
    assert set(await queued(redis_url)) == {"before", *ids}


async def test_a_submit_cancelled_before_the_send_enqueues_nothing(client: Client, redis_url: str) -> None:
    kept = asyncio.ensure_future(client.submit(model=MODEL, prompt="p", id="kept"))
    dropped = asyncio.ensure_future(client.submit(model=MODEL, prompt="p", id="dropped"))
    await asyncio.sleep(0)  # both have joined the pass's send, which has not run yet
    dropped.cancel()
    assert await kept == "kept"
    with pytest.raises(asyncio.CancelledError):
        await dropped
    assert set(await queued(redis_url)) == {"kept"}


async def test_a_failed_send_fails_every_submit_of_the_burst() -> None:
    from mlxq.api.errors import QueueUnavailable

    async with Client("redis://127.0.0.1:1", retry_deadline=0.3) as client:  # nothing listens there
        outcomes = await asyncio.gather(*(client.submit(model=MODEL, prompt="p") for _ in range(3)),
                                        return_exceptions=True)
    assert all(isinstance(o, QueueUnavailable) and "redis://127.0.0.1:1 unreachable" in str(o)
               for o in outcomes), outcomes


async def test_a_submits_writes_go_with_its_job_in_the_same_round_trip(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="warm")
    before = client._enqueuer.round_trips
    ids = await asyncio.gather(
        client.submit(model=MODEL, prompt="p", id="plain"),
        *(client.submit(model=MODEL, prompt="p", id=f"w{i}", writes=[("SET", f"mlxq:rec:{i}", f"r{i}", "EX", 60)])
          for i in range(3)))
    assert ids == ["plain", "w0", "w1", "w2"] and client._enqueuer.round_trips - before == 1
    r = aredis.Redis.from_url(redis_url)
    try:
        assert [await r.get(f"mlxq:rec:{i}") for i in range(3)] == [b"r0", b"r1", b"r2"]
        assert 0 < await r.ttl("mlxq:rec:0") <= 60
    finally:
        await r.aclose()
    assert set(await queued(redis_url)) == {"warm", "plain", "w0", "w1", "w2"}


async def test_a_write_redis_refuses_queues_nothing_and_fails_its_submit_alone(client: Client,
                                                                              redis_url: str) -> None:
    from redis.exceptions import ResponseError

    outcomes = await asyncio.gather(
        client.submit(model=MODEL, prompt="p", id="ok", writes=[("SET", "mlxq:rec:ok", "1")]),
        client.submit(model=MODEL, prompt="p", id="refused", writes=[("SET", "mlxq:rec:bad")]),  # refused: arity
        return_exceptions=True)
    assert outcomes[0] == "ok" and isinstance(outcomes[1], ResponseError) and "'set'" in str(outcomes[1])
    assert set(await queued(redis_url)) == {"ok"}  # the refused write's transaction ran nothing


async def test_writes_survive_redis_losing_its_scripts(client: Client, redis_url: str) -> None:
    await client.submit(model=MODEL, prompt="p", id="before")
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.script_flush()
        assert await client.submit(model=MODEL, prompt="p", id="after", writes=[("SET", "mlxq:rec:x", "1")]) == "after"
        assert await r.get("mlxq:rec:x") == b"1"
    finally:
        await r.aclose()
    assert set(await queued(redis_url)) == {"before", "after"}
