"""Subscription.get: each wait ends at its own deadline, with one timer re-armed lazily (not one per event)."""

from __future__ import annotations

import asyncio
from typing import cast

from api.subscriber import Subscriber, Subscription


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
