"""The seeds' hardest lesson: asyncio-side cancellation must never let a second call into MLX while the
first is still running. A deliberately slow fake step counts concurrent entries: it must stay 1."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import pytest

from mlxq.engine.core.backend import BatchToken
from mlxq.engine.core.engine import Engine
from mlxq.engine.core.request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.mlx.thread import MLXThread
from tests.engine.test_engine_claim import ManualClock

pytestmark = pytest.mark.unit


class EntryCounter:
    """Counts threads inside 'MLX' at once; the maximum must stay 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = 0
        self.max_inside = 0
        self.calls = 0

    def __enter__(self) -> None:
        with self._lock:
            self.inside += 1
            self.calls += 1
            self.max_inside = max(self.max_inside, self.inside)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.inside -= 1


class SlowBackend:
    """A fake batch whose every step takes ``delay`` seconds and emits one token per sequence."""

    def __init__(self, counter: EntryCounter, delay: float) -> None:
        self.counter = counter
        self.delay = delay
        self.uids: list[int] = []
        self.left: dict[int, int] = {}  # tokens each sequence may still make (BatchGenerator's max_tokens)
        self._next = 0
        self.fail_next = False
        self.steps = 0
        self.inserted_at_step: list[int] = []  # steps run before each insert

    def insert(self, prompt: list[int], max_tokens: int, sampler: Any, logits_processors: list[Any]) -> int:
        with self.counter:
            self._next += 1
            self.inserted_at_step.append(self.steps)
            self.uids.append(self._next)
            self.left[self._next] = max_tokens
            return self._next

    def remove(self, uids: Iterable[int]) -> None:
        with self.counter:
            gone = set(uids)
            self.uids = [u for u in self.uids if u not in gone]

    def step(self) -> list[BatchToken]:
        with self.counter:
            self.steps += 1
            time.sleep(self.delay)
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("simulated MLX failure")
            out = []
            for u in self.uids:
                self.left[u] -= 1
                out.append(BatchToken(u, 1, "length" if self.left[u] == 0 else None))
            self.uids = [u for u in self.uids if self.left[u] > 0]
            return out

    def close(self) -> None:
        pass


class Detok:
    def __init__(self) -> None:
        self._text = ""
        self._offset = 0

    def add_token(self, token: int) -> None:
        self._text += "x"

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        seg, self._offset = self._text[self._offset :], len(self._text)
        return seg


class Outputs:
    """Collects engine outputs on the event loop, as the worker's run table does."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.by_rid: dict[str, list[RequestOutput]] = {}
        self.changed = asyncio.Event()

    def sink(self, outs: list[RequestOutput]) -> None:
        self.loop.call_soon_threadsafe(self._add, outs)

    def _add(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self.by_rid.setdefault(out.rid, []).append(out)
        self.changed.set()

    def finish(self, rid: str) -> FinishReason | None:
        outs = self.by_rid.get(rid, [])
        return next((o.finish for o in outs if o.finish), None)

    async def wait_finished(self, rids: list[str], timeout: float = 30) -> None:
        async def all_done() -> None:
            while not all(self.finish(r) for r in rids):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(all_done(), timeout)


def make_engine(delay: float = 0.05, stream_interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                capacity: int = 4) -> tuple[Engine, SlowBackend, EntryCounter, Outputs]:
    counter = EntryCounter()
    backend = SlowBackend(counter, delay)
    outputs = Outputs(asyncio.get_running_loop())
    scheduler = Scheduler(backend, capacity=capacity, new_detokenizer=Detok)
    engine = Engine(MLXThread("test-mlx"), scheduler, outputs.sink, stream_interval_s=stream_interval_s, clock=clock)
    return engine, backend, counter, outputs


async def waiting_for_arrivals(engine: Engine) -> None:
    """Until the idle engine's thread has seen every request added so far and chose to wait for more (it
    clears the arrival signal just before it waits; an engine that stepped instead never does)."""
    async with asyncio.timeout(20):  # a safety timeout only
        while engine._arrived.is_set():
            await asyncio.sleep(0.002)


def request(rid: str, max_tokens: int = 1000) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


async def test_cancelled_callers_never_overlap_calls_on_the_mlx_thread() -> None:
    counter = EntryCounter()
    thread = MLXThread("race")
    finished: list[int] = []

    def slow_call(i: int) -> int:
        with counter:
            time.sleep(0.03)
        finished.append(i)
        return i

    async def impatient(i: int) -> None:
        # Like an arq job timeout: give up on the call long before it can finish.
        with pytest.raises((asyncio.TimeoutError, asyncio.CancelledError)):
            await asyncio.wait_for(thread.call(slow_call, i), timeout=0.001)
        # Cancel-safety: by the time the cancellation reaches us, our call has left "MLX".
        assert i in finished

    await asyncio.gather(*(impatient(i) for i in range(8)))
    assert counter.calls == 8
    assert counter.max_inside == 1
    await thread.aclose()


async def test_cancelling_aclose_still_waits_for_the_running_step() -> None:
    engine, backend, counter, outputs = make_engine(delay=0.1)
    engine.add(request("a"))
    await asyncio.sleep(0.05)  # a step is now inside the slow backend
    closing = asyncio.ensure_future(engine.aclose())
    await asyncio.sleep(0.01)
    closing.cancel()  # e.g. worker shutdown timing out
    with pytest.raises(asyncio.CancelledError):
        await closing
    # The cancelled close returned only after the MLX thread was joined: nothing is inside.
    assert counter.inside == 0
    calls = counter.calls
    await asyncio.sleep(0.2)
    assert counter.calls == calls  # and nothing runs afterwards
    assert counter.max_inside == 1


async def test_aborts_from_many_tasks_during_slow_steps_keep_one_entry() -> None:
    engine, backend, counter, outputs = make_engine(delay=0.02)
    rids = [f"r{i}" for i in range(12)]
    for rid in rids:
        engine.add(request(rid))

    async def job(rid: str, after: float) -> None:
        await asyncio.sleep(after)
        engine.abort(rid)

    await asyncio.gather(*(job(rid, 0.005 * i) for i, rid in enumerate(rids)))
    await outputs.wait_finished(rids)
    assert all(outputs.finish(r) is FinishReason.CANCELLED for r in rids)
    assert counter.max_inside == 1
    assert backend.uids == []
    await engine.aclose()


async def test_abort_takes_effect_within_one_step() -> None:
    engine, backend, counter, outputs = make_engine(delay=0.05)
    engine.add(request("a"))
    engine.add(request("b"))
    while len(outputs.by_rid.get("a", [])) < 3:
        await asyncio.sleep(0.005)
    steps_before = engine.stats.steps
    engine.abort("a")
    await outputs.wait_finished(["a"])
    assert engine.stats.steps - steps_before <= 1
    assert outputs.finish("b") is None  # the other sequence keeps going
    engine.abort("b")
    await outputs.wait_finished(["b"])
    await engine.aclose()


async def test_a_busy_engine_lets_other_calls_onto_its_thread_between_steps() -> None:
    # Steps run back to back in one call on the MLX thread, but only while nothing else waits for it.
    engine, backend, counter, outputs = make_engine(delay=0.01)
    engine.add(request("a"))
    while "a" not in outputs.by_rid:
        await asyncio.sleep(0.005)

    def other_work() -> int:
        with counter:
            return backend.steps

    steps_then = backend.steps
    ran_at = await engine.thread.call(other_work)
    assert ran_at - steps_then <= 2  # it waited for the step in flight (and one more at most), not for "a"
    assert outputs.finish("a") is None
    # Nothing stays queued: the engine's next step was queued behind the other call and starts at once.
    for _ in range(200):
        if engine.thread.queued == 0:
            break
        await asyncio.sleep(0.005)
    assert engine.thread.queued == 0
    assert counter.max_inside == 1
    engine.abort("a")
    await outputs.wait_finished(["a"])
    await engine.aclose()


async def test_step_failure_fails_in_flight_requests_then_serves_again() -> None:
    engine, backend, counter, outputs = make_engine(delay=0.01)
    engine.add(request("a"))
    engine.add(request("b"))
    while "b" not in outputs.by_rid:
        await asyncio.sleep(0.005)
    backend.fail_next = True
    await outputs.wait_finished(["a", "b"])
    for rid in ("a", "b"):
        last = outputs.by_rid[rid][-1]
        assert last.finish is FinishReason.ERROR and last.error_code == "engine_error"
    engine.add(request("c", max_tokens=3))
    await outputs.wait_finished(["c"])
    assert outputs.finish("c") is FinishReason.LENGTH
    assert engine.stats.failures == 1
    await engine.aclose()


async def test_mlx_arrays_made_on_the_mlx_thread_stay_there() -> None:
    thread = MLXThread("owner")
    lazy = await thread.call(lambda: mx.arange(4) * 2)  # not evaluated: bound to the thread's stream
    # Evaluating it from another thread is the bug class the MLX thread exists to prevent.
    with pytest.raises(RuntimeError, match="no Stream"):
        await asyncio.to_thread(lambda: lazy.tolist())
    assert await thread.call(lambda: lazy.tolist()) == [0, 2, 4, 6]
    await thread.aclose()


async def test_engine_that_cannot_rebuild_its_batch_declares_itself_dead() -> None:
    engine, backend, counter, outputs = make_engine(delay=0.01)
    deaths: list[bool] = []

    def cannot_rebuild() -> Any:
        raise RuntimeError("[metal] device lost")

    engine._make_backend = cannot_rebuild
    engine.on_dead = lambda: deaths.append(True)
    engine.add(request("a"))
    while "a" not in outputs.by_rid:
        await asyncio.sleep(0.005)
    backend.fail_next = True
    await outputs.wait_finished(["a"])
    assert outputs.by_rid["a"][-1].error_code == "engine_error"
    for _ in range(1000):  # the rebuild is tried on the MLX thread right after the jobs were failed
        if engine.dead:
            break
        await asyncio.sleep(0.005)
    assert deaths == [True] and engine.dead
    engine.add(request("b"))  # nothing will ever step again: refused at once
    await outputs.wait_finished(["b"])
    assert outputs.by_rid["b"][-1].finish is FinishReason.ERROR
    await engine.aclose()


async def test_paced_engine_sends_first_token_then_the_rest_with_the_end() -> None:
    engine, backend, _, outputs = make_engine(delay=0.001, stream_interval_s=60.0)
    try:
        for rid in ("a", "b"):
            engine.add(request(rid, max_tokens=20))
        await outputs.wait_finished(["a", "b"])
        for rid in ("a", "b"):
            first, last = outputs.by_rid[rid]  # 20 steps, two outputs
            assert (first.started, len(first.token_ids), first.finish) == (True, 1, None)
            assert (len(last.token_ids), last.completion_tokens, last.finish) == (19, 20, FinishReason.LENGTH)
            assert first.text + last.text == "x" * 20
        assert backend.steps >= 20
    finally:
        await engine.aclose()


async def test_idle_engine_waits_for_announced_requests_and_admits_them_together() -> None:
    # The window moves only when the test says: however slow the machine, it cannot close before "c" is in.
    # Once all are in, the burst lingers a fifth of it (0.1 s of its thread's sleep) until the test ends it.
    clock = ManualClock()
    engine, backend, _, outputs = make_engine(delay=0.001, clock=clock)
    try:
        engine.expect(3, within_s=0.5)
        engine.add(request("a", max_tokens=5))
        await waiting_for_arrivals(engine)  # two more are announced: it waits instead of stepping
        assert backend.steps == 0
        engine.add(request("b", max_tokens=5))
        engine.add(request("c", max_tokens=5))
        clock.advance(0.5)  # the window closes: the engine steps once its thread looks again
        await outputs.wait_finished(["a", "b", "c"])
        assert backend.inserted_at_step == [0, 0, 0]
    finally:
        await engine.aclose()


async def test_announced_requests_that_never_come_do_not_stall_the_engine() -> None:
    engine, backend, _, outputs = make_engine(delay=0.001)
    try:
        engine.expect(5, within_s=0.05)  # four of them are rejected before reaching the engine
        engine.add(request("a", max_tokens=3))
        await outputs.wait_finished(["a"])
        engine.add(request("b", max_tokens=3))  # the stale announcement is gone: no wait at all
        await outputs.wait_finished(["b"])
        assert backend.inserted_at_step == [0, 3]
    finally:
        await engine.aclose()


async def test_idle_engine_waits_for_no_more_than_one_prefill_batch() -> None:
    engine, backend, _, outputs = make_engine(delay=0.001, capacity=8)
    try:
        engine.expect(20, within_s=60.0)  # 12 of them are still on their way when the first 8 are in
        rids = [f"r{i}" for i in range(8)]  # the default prefill batch
        for rid in rids:
            engine.add(request(rid, max_tokens=3))
        await outputs.wait_finished(rids)
        assert backend.inserted_at_step == [0] * 8
    finally:
        await engine.aclose()


async def test_idle_engine_keeps_waiting_while_a_burst_keeps_arriving() -> None:
    clock = ManualClock()  # its steps are exact binary fractions: a lull lands exactly on its bound
    engine, backend, _, outputs = make_engine(delay=0.001, clock=clock)
    try:
        engine.expect(2, within_s=1.25)  # a lull of a fifth of that (0.25 s) ends the wait
        engine.add(request("a", max_tokens=3))
        engine.add(request("b", max_tokens=3))
        await waiting_for_arrivals(engine)
        for rid in ("c", "d"):  # claimed later, each less than a lull after the last: still part of the burst
            clock.advance(0.1875)
            engine.expect(1, within_s=1.25)
            engine.add(request(rid, max_tokens=3))
            await waiting_for_arrivals(engine)
        assert backend.steps == 0  # 0.375 s since the first arrival, more than a lull, but never a lull
        clock.advance(0.25)  # a lull: the wait ends (its thread sees it within the 0.25 s it sleeps at most)
        await outputs.wait_finished(["a", "b", "c", "d"])
        assert backend.inserted_at_step == [0, 0, 0, 0]
    finally:
        await engine.aclose()


async def test_a_lone_announced_request_does_not_linger() -> None:
    engine, backend, _, outputs = make_engine(delay=0.001)
    try:
        engine.expect(1, within_s=600.0)  # a linger would last a fifth of that: the test would time out
        engine.add(request("a", max_tokens=3))
        await outputs.wait_finished(["a"])
        assert backend.inserted_at_step == [0]
    finally:
        await engine.aclose()


async def test_a_lull_after_a_burst_starts_the_engine() -> None:
    engine, backend, _, outputs = make_engine(delay=0.001)
    try:
        engine.expect(2, within_s=0.05)  # lull: 10 ms
        engine.add(request("a", max_tokens=50))
        engine.add(request("b", max_tokens=50))
        while backend.steps == 0:  # the burst stopped coming: the engine does not wait out the window
            await asyncio.sleep(0.005)
        engine.add(request("c", max_tokens=3))
        await outputs.wait_finished(["a", "b", "c"])
        assert backend.inserted_at_step[:2] == [0, 0] and backend.inserted_at_step[2] > 0
    finally:
        await engine.aclose()


def _thread_stat(tid: int) -> tuple[int, int]:
    """(voluntary context switches, CPU clock ticks) of one of this process's threads."""
    with open(f"/proc/self/task/{tid}/status") as f:
        switches = int(f.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return switches, int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_streams_kernel_thread_runs_under_sched_batch() -> None:
    """The thread MLX runs the stream's kernels on (not the MLX thread itself) is found and set to SCHED_BATCH:
    it is the one the stream's evaluations wake and keep busy."""
    batched = MLXThread(name="mlx-batch")
    tasks_before = set(os.listdir("/proc/self/task"))
    plain = MLXThread(name="mlx-plain", batch_policy=False)
    try:
        batched.submit(lambda: None).result()
        plain.submit(lambda: mx.eval(mx.ones(2) + 1)).result()  # its stream's kernel thread starts too
        tid = batched.kernel_thread
        assert tid is not None and plain.kernel_thread is None
        assert tid != batched.submit(threading.get_native_id).result()
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        plains = set(os.listdir("/proc/self/task")) - tasks_before - {str(tid)}
        assert len(plains) >= 2 and all(os.sched_getscheduler(int(t)) == os.SCHED_OTHER for t in plains)

        def evaluate() -> None:
            a = mx.random.normal((128, 128))
            for _ in range(200):  # one evaluation at a time: each wakes the kernel thread
                a = mx.tanh(a @ a)
                mx.eval(a)

        before = _thread_stat(tid)
        batched.submit(evaluate).result()
        after = _thread_stat(tid)
        # It is the thread the evaluations keep busy: its CPU time grew (how often it slept between kernels
        # depends on timing: one that finds the next kernel already queued does not sleep). A thread the
        # evaluations do not use gains no CPU time.
        assert after[1] > before[1]
    finally:
        batched.shutdown()
        plain.shutdown()


async def test_beside_bulk_rows_no_step_starts_while_an_announced_interactive_request_is_on_its_way() -> None:
    # Claimed and being prepared, it would start at once: a step begun meanwhile would hold back its first token.
    # The window moves only when the test says, so the engine waits for it however slow the machine.
    engine, backend, _, outputs = make_engine(delay=0.001, clock=ManualClock())
    try:
        engine.add(EngineRequest("bulk", [1, 2, 3], SamplingParams(max_tokens=10_000), priority=-101, bulk=True))
        while backend.steps < 3:
            await asyncio.sleep(0.002)
        engine.expect(1, within_s=0.5, interactive=1)
        await waiting_for_arrivals(engine)
        held = backend.steps
        await asyncio.sleep(0.05)  # (time it would step in, if it did not wait)
        assert backend.steps == held
        engine.add(request("chat", max_tokens=3))
        await outputs.wait_finished(["chat"])
        assert backend.inserted_at_step == [0, held]  # in at the step held for it, before any more decoding
    finally:
        engine.abort("bulk")
        await engine.aclose()


async def test_an_engine_says_when_a_step_leaves_it_more_room_than_before() -> None:
    # (So a worker whose last claim left jobs queued claims again then, not at its next job's end.)
    clock = ManualClock()
    engine, backend, _, outputs = make_engine(delay=0.001, capacity=2, clock=clock)
    rooms: list[int] = []
    engine.on_claimable = lambda: rooms.append(engine.claim_capacity())  # on its thread, right after a step
    try:
        engine.expect(2, within_s=0.5)  # both join in its first step
        engine.add(request("a", max_tokens=3))
        engine.add(request("b", max_tokens=6))
        await waiting_for_arrivals(engine)
        clock.advance(0.5)
        await outputs.wait_finished(["a", "b"])
        await asyncio.wrap_future(engine.thread.submit(lambda: None))  # b's output goes out before its room
        assert rooms == [0, 1, 2]  # full (a job of higher priority would outrank), then a's slot, then b's
    finally:
        await engine.aclose()
