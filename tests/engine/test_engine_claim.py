"""``Engine.claim_capacity``: how many more requests the worker may claim for this engine, from any thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from mlxq.engine.core.backend import BatchToken
from mlxq.engine.core.engine import Engine
from mlxq.engine.core.request import RequestOutput
from mlxq.engine.core.shares import GroupShare
from mlxq.engine.mlx.thread import MLXThread
from tests.engine.fakes import ToyBatch, req, scheduler, waiting

pytestmark = pytest.mark.unit


class SlowToyBatch(ToyBatch):
    def step(self) -> list[BatchToken]:
        time.sleep(0.002)  # a model step: the test's thread gets to look in between
        return super().step()


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


def sink(outs: list[RequestOutput]) -> None:
    pass


class ManualClock:
    """An engine's admission clock that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def test_free_slots_minus_waiting_added_and_announced_requests() -> None:
    clock = ManualClock()
    engine = Engine(MLXThread("claim"), scheduler(SlowToyBatch(), capacity=4), sink, clock=clock)
    try:
        assert engine.claim_capacity() == 4
        engine.expect(2, within_s=0.05)  # claimed, on their way
        assert engine.claim_capacity() == 2
        engine.add(req("a", max_tokens=10_000))  # one came: it counts as added, the other as announced
        assert engine.claim_capacity() == 2
        clock.advance(0.05)  # the window closes: the engine steps without waiting for the other
        engine.add(req("b", max_tokens=10_000))
        await until(lambda: engine.scheduler.num_running == 2)
        await until(lambda: engine.claim_capacity() == 2)
        for rid in ("c", "d", "e"):
            engine.add(req(rid, max_tokens=10_000))
        await until(lambda: engine.scheduler.num_running == 4 and len(waiting(engine.scheduler)) == 1)
        await until(lambda: engine.claim_capacity() == 0)
        for rid in "abcde":
            engine.abort(rid)
        await until(lambda: engine.claim_capacity() == 4)
        engine.dead = True
        assert engine.claim_capacity() == 0
    finally:
        await engine.aclose()


async def test_bounded_by_the_kv_headroom_for_a_typical_request() -> None:
    # Rows of 16 tokens are charged (16 + 3) x 10 bytes: 600 bytes hold three of them.
    engine = Engine(MLXThread("claim-kv"), scheduler(SlowToyBatch(), capacity=8, headroom=600), sink)
    try:
        engine.add(req("a", 6, max_tokens=10))
        await until(lambda: engine.scheduler.num_running == 1)
        await until(lambda: engine.claim_capacity() == 2)  # 8 free slots, but KV for two more like "a"
        engine.abort("a")
        await until(lambda: engine.scheduler.room.kv_rows == 3)
        assert engine.claim_capacity() == 3
    finally:
        await engine.aclose()


async def test_an_idle_engine_claims_one_even_when_a_typical_request_would_not_fit() -> None:
    # The default estimate of a typical request (one cache step, 3 tokens here) overflows 20 bytes of headroom:
    # were the room 0, the worker would claim nothing, ever. Alone, a request fits or is refused with an error.
    engine = Engine(MLXThread("claim-idle"), scheduler(SlowToyBatch(), capacity=8, headroom=20), sink)
    try:
        seen: list[RequestOutput] = []
        engine._sink = seen.extend
        engine.add(req("too-big", 6, max_tokens=10))
        await until(lambda: any(o.finish is not None for o in seen))
        assert seen[-1].error_code == "bad_request"
        await until(lambda: engine.claim_capacity() == 1)  # after a step with nothing running, not 0
    finally:
        await engine.aclose()


async def test_announced_requests_that_never_come_stop_counting_after_their_window() -> None:
    # A claimed job refused before it reaches the engine (bad request, cancelled while queued) is never added:
    # it must not hold a slot for ever, or a worker refusing many jobs would end up claiming none.
    clock = ManualClock()
    engine = Engine(MLXThread("claim-window"), scheduler(SlowToyBatch(), capacity=4), sink, clock=clock)
    try:
        engine.expect(3, within_s=0.05)
        assert engine.claim_capacity() == 1
        clock.advance(0.04)  # still within the window
        assert engine.claim_capacity() == 1
        clock.advance(0.02)
        assert engine.claim_capacity() == 4
    finally:
        await engine.aclose()


async def test_a_full_engine_names_the_priority_a_request_must_exceed_to_start_at_once() -> None:
    clock = ManualClock()
    engine = Engine(MLXThread("claim-outranked"), scheduler(SlowToyBatch(), capacity=2), sink, clock=clock)
    try:
        engine.add(req("low", max_tokens=10_000, priority=-3))
        assert engine.outranked_priority() is None  # not started yet: it has room anyway
        await until(lambda: engine.scheduler.num_running == 1)
        assert engine.claim_capacity() == 1 and engine.outranked_priority() is None  # room: no need to outrank
        engine.add(req("mid", max_tokens=10_000, priority=2))
        await until(lambda: engine.scheduler.num_running == 2 and engine.claim_capacity() == 0)
        await until(lambda: engine.outranked_priority() == -3)  # the lowest running
        assert engine.outranking_room() == 1  # one sequence of that priority: one request starts at once
        engine.expect(1, within_s=0.05)  # one claimed on that ground, on its way: no second one
        assert engine.outranked_priority() is None and engine.outranking_room() == 0
        clock.advance(0.05)
        assert engine.outranked_priority() == -3
        engine.add(req("vip", max_tokens=10_000, priority=5))  # preempts "low", which waits, started
        await until(lambda: engine.scheduler.stats.preemptions == 1 and len(waiting(engine.scheduler)) == 1)
        await until(lambda: engine.outranked_priority() == 2)
        engine.dead = True
        assert engine.outranked_priority() is None
    finally:
        await engine.aclose()


async def test_a_full_engine_takes_one_outranking_request_per_sequence_of_the_lowest_priority() -> None:
    clock = ManualClock()
    engine = Engine(MLXThread("claim-outranking-room"), scheduler(SlowToyBatch(), capacity=3), sink, clock=clock)
    try:
        for rid in ("a", "b", "c"):
            engine.add(req(rid, max_tokens=10_000, priority=0))
        await until(lambda: engine.scheduler.num_running == 3 and engine.outranking_room() == 3)
        engine.expect(2, within_s=0.05)  # two claimed on that ground: one more may come
        assert engine.outranking_room() == 1 and engine.outranked_priority() == 0
        clock.advance(0.05)
        engine.add(req("vip", max_tokens=10_000, priority=5))  # preempts one: two of priority 0 still run
        await until(lambda: engine.scheduler.stats.preemptions == 1 and engine.paused() == 1)
        await until(lambda: engine.outranking_room() == 2)
    finally:
        await engine.aclose()


async def test_a_full_engine_opens_its_groups_parts_counting_the_requests_on_their_way() -> None:
    # A flood refills every freed slot at once, so a request of its group is nearly always on its way; a tenant
    # below its share must still be claimable then (it used to wait for that request to be taken in).
    clock = ManualClock()
    engine = Engine(MLXThread("claim-groups"), scheduler(SlowToyBatch(), capacity=2), sink, clock=clock)
    a = GroupShare("a", 2, 1.0)
    gate, busy = threading.Event(), threading.Event()
    try:
        for rid in ("a1", "a2"):
            engine.add(req(rid, max_tokens=10_000, group="a"))
        await until(lambda: engine.claim_capacity() == 0 and engine.groups_open() == (a,))
        engine.expect(1, within_s=0.05, groups=["a"])  # the flood's next job, claimed: a's, on its way
        assert engine.groups_open() == (GroupShare("a", 2, 1.0, queued=1),)
        engine.expect(1, within_s=0.05, groups=["b"])  # one of b's, claimed on that ground: b's, on its way
        assert set(engine.groups_open()) == {GroupShare("a", 2, 1.0, queued=1), GroupShare("b", 0, 1.0, queued=1)}
        clock.advance(0.05)  # their window is over: they never came
        assert engine.groups_open() == (a,)
        engine.thread.submit(lambda: (busy.set(), gate.wait(20)))  # the MLX thread is mid-step
        await asyncio.to_thread(busy.wait, 20)
        engine.add(req("b1", max_tokens=10_000, group="b"))  # added, not taken in yet
        assert set(engine.groups_open()) == {a, GroupShare("b", 0, 1.0, queued=1)}
        gate.set()
        await until(lambda: engine.scheduler.stats.preemptions == 1)  # b1 took one of a's places
        await until(lambda: set(engine.groups_open()) == {GroupShare("a", 1, 1.0), GroupShare("b", 1, 1.0)})
    finally:
        gate.set()
        await engine.aclose()


class GatedToyBatch(SlowToyBatch):
    """Its steps wait for ``gate``: the test looks at the engine while the batch step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.stepping = threading.Event(), threading.Event()

    def step(self) -> list[BatchToken]:
        self.stepping.set()
        self.gate.wait(20)
        return super().step()


async def test_during_a_step_the_room_counts_what_that_step_admitted() -> None:
    # An idle engine's first batch prefill can be a long step; a claim meanwhile must see the batch full of the
    # group it admitted (a tenant below its share is claimed then, not after the step), and nothing on its way.
    batch = GatedToyBatch()
    engine = Engine(MLXThread("claim-mid-step"), scheduler(batch, capacity=2), sink)
    try:
        engine.expect(2, within_s=5.0)  # (both in its first step: else it may step as soon as the first is in)
        for rid in ("a1", "a2"):
            engine.add(req(rid, max_tokens=10_000, group="a"))
        await asyncio.to_thread(batch.stepping.wait, 20)  # the step that admitted both is in its batch step
        assert engine.scheduler.room.free_slots == 0 and engine.claim_capacity() == 0
        assert engine.groups_open() == (GroupShare("a", 2, 1.0),)  # both running; none counted on its way
        assert engine.scheduler.stats.steps == 0  # (still the first step)
    finally:
        batch.gate.set()
        await engine.aclose()
