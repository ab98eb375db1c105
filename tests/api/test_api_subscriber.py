"""The shared pub/sub connection: batched subscribes, and waits that end at their own deadline with one timer."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import fakeredis
import pytest
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

from mlxq.api.subscriber import Subscriber, Subscription, own_pubsub


async def test_each_wait_ends_at_its_own_deadline() -> None:
    sub = Subscription(cast(Subscriber, None), "c")
    assert await sub.get(0.01) is None
    asyncio.get_running_loop().call_later(0.01, sub.put, b"x")
    assert await sub.get(30.0) == b"x"
    async with asyncio.timeout(10.0):  # a hang guard: the 30 s timer armed above must not decide this wait
        assert await sub.get(0.01) is None


async def test_messages_waiting_are_returned_without_a_wait_and_in_order() -> None:
    sub = Subscription(cast(Subscriber, None), "c")
    for data in (b"a", b"b"):
        sub.put(data)
    assert [await sub.get(0.0), await sub.get(0.0)] == [b"a", b"b"]
    assert await sub.get(0.0) is None


async def test_one_timer_serves_many_waits() -> None:
    sub = Subscription(cast(Subscriber, None), "c")
    loop = asyncio.get_running_loop()
    timers = []
    for i in range(50):
        loop.call_soon(sub.put, b"%d" % i)
        assert await sub.get(1.0) == b"%d" % i
        timers.append(sub._timer)
    assert len({id(t) for t in timers}) == 1  # armed once, not per message


# --- the shared connection: a burst of opens subscribes in one command ------------------------------------


async def test_a_burst_of_opens_subscribes_in_one_command_and_every_reader_gets_its_messages() -> None:
    redis = fakeredis.FakeAsyncRedis()
    hub = Subscriber(redis)
    sent: list[tuple[str, ...]] = []
    try:
        subs = await asyncio.gather(*(_recording_open(hub, f"ch{i}", sent) for i in range(20)))
        assert sent == [tuple(sorted(f"ch{i}" for i in range(20)))]
        extra = await hub.open("ch3")  # a second reader of a subscribed channel sends nothing
        assert len(sent) == 1
        for i in range(20):
            await redis.publish(f"ch{i}", b"m%d" % i)
        assert [await s.get(5.0) for s in subs] == [b"m%d" % i for i in range(20)]
        assert await extra.get(5.0) == b"m3"
        for s in [*subs, extra]:
            await s.close()
    finally:
        await hub.aclose()
        await redis.aclose()


async def assert_a_new_open_receives(hub: Subscriber, redis: Any, channel: str, data: bytes) -> None:
    """After a failure, a fresh open of ``channel`` subscribes again and gets what is published on it."""
    sub = await hub.open(channel)
    await redis.publish(channel, data)
    assert await sub.get(5.0) == data
    await sub.close()


async def test_a_failed_subscribe_fails_its_burst_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    redis = fakeredis.FakeAsyncRedis()
    hub = Subscriber(redis)
    try:
        async def refuse(self: Any, *channels: str) -> None:
            raise RedisConnectionError("refused")

        with monkeypatch.context() as m:
            m.setattr(PubSub, "subscribe", refuse)
            results = await asyncio.gather(*(hub.open(f"ch{i}") for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results)
        assert hub._subs == {} and hub._unsent == set()
        await assert_a_new_open_receives(hub, redis, "ch0", b"ok")  # the next burst subscribes again
    finally:
        await hub.aclose()
        await redis.aclose()


async def test_a_burst_of_releases_unsubscribes_in_one_command_and_keeps_reopened_channels() -> None:
    redis = fakeredis.FakeAsyncRedis()
    hub = Subscriber(redis)
    sent: list[tuple[str, ...]] = []
    try:
        subs = await asyncio.gather(*(hub.open(f"ch{i}") for i in range(6)))
        unsubscribe = hub._pubsub.unsubscribe

        async def recording(*channels: str) -> Any:
            sent.append(channels)
            return await unsubscribe(*channels)

        hub._pubsub.unsubscribe = recording
        # ch0 is opened again in the same pass, before the burst's UNSUBSCRIBE goes out.
        *_, again = await asyncio.gather(*(s.close() for s in subs[:5]), hub.open("ch0"))
        await asyncio.sleep(0.01)
        assert sent == [("ch1", "ch2", "ch3", "ch4")]
        await redis.publish("ch0", b"still here")
        assert await again.get(5.0) == b"still here"
        hub.idle_close_s = 0.05
        await again.close()
        await subs[5].close()
        await asyncio.sleep(0.01)
        assert hub._pubsub is not None  # idle, but kept a while for the next burst
        reopened = await hub.open("ch5")
        await asyncio.sleep(0.1)
        assert hub._pubsub is not None  # a reader came back before the idle close
        await redis.publish("ch5", b"back")
        assert await reopened.get(5.0) == b"back"
        await reopened.close()
        await asyncio.sleep(0.1)
        assert hub._pubsub is None and hub._subs == {}  # idle for idle_close_s: the connection is closed
    finally:
        await hub.aclose()
        await redis.aclose()


async def _recording_open(hub: Subscriber, channel: str, sent: list[tuple[str, ...]]) -> Subscription:
    if hub._pubsub is None:
        hub._pubsub = own_pubsub(hub.redis)
        subscribe = hub._pubsub.subscribe

        async def recording(*channels: str) -> Any:
            sent.append(channels)
            return await subscribe(*channels)

        hub._pubsub.subscribe = recording
    return await hub.open(channel)


async def test_a_killed_connection_breaks_every_stream_and_the_next_open_reconnects(redis_url: str) -> None:
    import redis.asyncio as aredis

    redis = aredis.Redis.from_url(redis_url)
    hub = Subscriber(redis)
    try:
        subs = await asyncio.gather(*(hub.open(f"k{i}") for i in range(3)))
        await redis.publish("k1", b"before")
        assert await subs[1].get(5.0) == b"before"
        await redis.client_kill_filter(_type="pubsub")  # as a Redis restart or a network cut would
        for sub in subs:
            with pytest.raises(RedisConnectionError):
                while await sub.get(5.0) is not None:
                    pass
        await assert_a_new_open_receives(hub, redis, "k1", b"after")  # readers replay from the log, subscribe again
    finally:
        await hub.aclose()
        await redis.aclose()


async def test_a_break_during_unsubscribes_leaves_the_command_pool_clean(redis_url: str) -> None:
    """A pub/sub connection that breaks while UNSUBSCRIBEs are in flight never ends up among the connections
    commands use (redis-py's retry used to reconnect it there, and a GET then read an ``unsubscribe`` reply
    or raced the hub's reader for the socket)."""
    import redis.asyncio as aredis

    from mlxq.api.connection import redis_client

    redis = redis_client(redis_url)
    admin = aredis.Redis.from_url(redis_url)
    hub = Subscriber(redis)
    await redis.set("race:k", b"v")
    try:
        for i in range(100):
            subs = await asyncio.gather(*(hub.open(f"race{i}-{j}") for j in range(4)))
            assert hub._pubsub is not None and hub._pubsub.connection_pool is not redis.connection_pool
            kill = asyncio.create_task(admin.client_kill_filter(_type="pubsub"))
            await asyncio.sleep(0)
            closes = [asyncio.create_task(s.close()) for s in subs[:2]]
            await asyncio.gather(kill, *closes)
            await asyncio.sleep(0.01 * (i % 5))  # lets redis-py's retries and the hub's break interleave
            for s in subs[2:]:
                await s.close()
            assert await asyncio.gather(*(redis.get("race:k") for _ in range(8))) == [b"v"] * 8
    finally:
        await hub.aclose()
        await redis.aclose()
        await admin.aclose()
