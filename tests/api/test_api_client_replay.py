"""``mlxq.api.client.Client`` delivery: pub/sub merged with the replay log, exactly once and in seq order.

Redis is fakeredis; a fake worker writes events the way ``worker/jobs/table.py`` does
(``PUBLISH <events channel> json`` and ``XADD <log key> {"e": json}`` with id ``<seq>-1``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import fakeredis
import pytest

import mlxq.api.client as client_mod
import mlxq.api.follow as follow_mod
from mlxq.api.client import Client
from mlxq.api.errors import JobFailed, JobNotFound, WaitTimeout
from mlxq.api.protocol.keys import CANCEL_TTL_S, log_entry_id
from mlxq.api.schema import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    Usage,
)

pytestmark = pytest.mark.unit

RID = "job-1"
PREFIX = "t"


# --- events ---------------------------------------------------------------------------------------------


def start(seq: int, attempt: int = 1) -> StartEvent:
    return StartEvent(id=RID, seq=seq, model="m", worker="w", prompt_tokens=3, attempt=attempt)


def token(seq: int, text: str, ids: list[int], index: int = 0) -> TokenEvent:
    return TokenEvent(id=RID, seq=seq, text=text, token_ids=ids, index=index)


def done(seq: int, completion: int = 0, reason: FinishReason = FinishReason.STOP) -> DoneEvent:
    return DoneEvent(
        id=RID,
        seq=seq,
        finish_reason=reason,
        usage=Usage(prompt_tokens=3, completion_tokens=completion),
        timings=Timings(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0, tokens_per_s=None),
    )


def simple_job() -> list[Event]:
    return [
        start(0),
        token(1, "Hel", [1, 2], 0),
        token(2, "lo", [3], 2),
        token(3, " wor", [4], 3),
        token(4, "ld", [5], 4),
        done(5, completion=5),
    ]


# --- fixtures -------------------------------------------------------------------------------------------


class FakeWorker:
    """Writes events like the run table: publish live, append to the log (entry id ``<seq>-1``)."""

    def __init__(self, redis: Any, fake_client: Client) -> None:
        self.redis = redis
        self.keys = fake_client.keys

    async def emit(self, ev: Event, *, log: bool = True, live: bool = True, publish_times: int = 1) -> None:
        data = ev.model_dump_json()
        pipe = self.redis.pipeline(transaction=False)
        if live:
            for _ in range(publish_times):
                pipe.publish(self.keys.events(ev.id), data)
        if log:
            pipe.xadd(self.keys.log(ev.id), {"e": data}, id=log_entry_id(ev.seq))
        await pipe.execute()

    async def emit_all(self, events: list[Event]) -> None:
        for ev in events:
            await self.emit(ev)

    async def subscribers(self, rid: str = RID) -> int:
        ((_, n),) = await self.redis.pubsub_numsub(self.keys.events(rid))
        return int(n)


@pytest.fixture
async def fake_redis() -> AsyncIterator[Any]:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer())
    yield redis
    await redis.aclose()


@pytest.fixture
async def fake_client(fake_redis: Any) -> AsyncIterator[Client]:
    c = Client(prefix=PREFIX, redis=fake_redis)
    yield c
    await c.aclose()


@pytest.fixture
async def fake_worker(fake_redis: Any, fake_client: Client) -> FakeWorker:
    await fake_redis.set(fake_client.keys.job(RID), b"{}")  # the job was submitted: its record exists
    return FakeWorker(fake_redis, fake_client)


@pytest.fixture
def xrange_calls(fake_client: Client) -> list[str]:
    """Records the ``min`` of every XRANGE the client makes (its replay reads)."""
    calls: list[str] = []
    original = fake_client._redis.xrange

    async def recording(name: str, min: str = "-", max: str = "+", count: int | None = None) -> Any:
        calls.append(min)
        return await original(name, min=min, max=max, count=count)

    fake_client._redis.xrange = recording
    return calls


def on_first_replay(
    fake_client: Client, hook: Callable[[], Awaitable[None]], *, before_read: bool = False
) -> asyncio.Event:
    """Run ``hook`` inside the client's first XRANGE (after the client subscribed): models events landing
    just before the log read (``before_read``: they are in the log *and* live) or just after it (live only).

    Returns an event set once that first replay read and the hook are done.
    """
    original = fake_client._redis.xrange
    replayed = asyncio.Event()

    async def xrange(name: str, min: str = "-", max: str = "+", count: int | None = None) -> Any:
        first = not replayed.is_set()
        if first and before_read:
            await hook()
        result = await original(name, min=min, max=max, count=count)
        if first:
            if not before_read:
                await hook()
            replayed.set()
        return result

    fake_client._redis.xrange = xrange
    return replayed


async def collect(fake_client: Client, rid: str = RID, timeout: float = 5.0) -> list[Event]:
    return [ev async for ev in fake_client.events(rid, timeout=timeout)]


# --- events() -------------------------------------------------------------------------------------------


async def test_late_subscriber_gets_full_sequence_once(fake_client: Client, fake_worker: FakeWorker) -> None:
    events = simple_job()
    await fake_worker.emit_all(events)  # no subscriber yet: only the log keeps them

    got = await collect(fake_client)

    assert got == events
    assert [e.seq for e in got] == list(range(6))
    assert got[-1].type == "done"


async def test_events_stop_at_terminal_event(fake_client: Client, fake_worker: FakeWorker) -> None:
    # Anything after the terminal event (should never happen) is not delivered.
    await fake_worker.emit_all([start(0), done(1)])
    await fake_worker.emit(token(2, "late", [9]))
    got = await collect(fake_client)
    assert [e.type for e in got] == ["start", "done"]


async def test_mid_stream_subscriber_merges_log_and_live_without_duplicates(
    fake_client: Client, fake_worker: FakeWorker
) -> None:
    events = simple_job()
    await fake_worker.emit_all(events[:3])  # before the client attaches: log only, in effect

    async def land_during_replay() -> None:
        # Written after the client's log read but while it is subscribed: these arrive live only.
        await fake_worker.emit(events[3], publish_times=2)

    replayed = on_first_replay(fake_client, land_during_replay)
    task = asyncio.create_task(collect(fake_client))
    await asyncio.wait_for(replayed.wait(), 5)
    assert await fake_worker.subscribers() == 1
    # Live duplicates, and a re-publish of an event already delivered from the log.
    await fake_worker.emit(events[4], publish_times=3)
    await fake_worker.emit(events[2], log=False)
    await fake_worker.emit(events[5], publish_times=2)

    got = await asyncio.wait_for(task, 5)
    assert got == events


async def test_event_in_both_log_and_channel_is_delivered_once(fake_client: Client, fake_worker: FakeWorker) -> None:
    events = simple_job()
    await fake_worker.emit_all(events[:2])

    async def land_before_read() -> None:
        # Published after the client subscribed, written before its log read: the read returns them
        # and the channel delivers them too.
        for ev in events[2:4]:
            await fake_worker.emit(ev)

    replayed = on_first_replay(fake_client, land_before_read, before_read=True)
    task = asyncio.create_task(collect(fake_client))
    await asyncio.wait_for(replayed.wait(), 5)
    for ev in events[4:]:
        await fake_worker.emit(ev)
    got = await asyncio.wait_for(task, 5)
    assert got == events


async def test_events_written_before_replay_and_published_again(fake_client: Client, fake_worker: FakeWorker) -> None:
    events = simple_job()
    await fake_worker.emit_all(events[:4])

    async def republish() -> None:
        # The log read returned 0..3; the same events now also arrive live.
        for ev in events[:4]:
            await fake_worker.emit(ev, log=False)

    replayed = on_first_replay(fake_client, republish)
    task = asyncio.create_task(collect(fake_client))
    await asyncio.wait_for(replayed.wait(), 5)
    for ev in events[4:]:
        await fake_worker.emit(ev, publish_times=2)
    got = await asyncio.wait_for(task, 5)
    assert got == events


async def test_gap_in_live_events_recovered_from_log(
    fake_client: Client, fake_worker: FakeWorker, xrange_calls: list[str]
) -> None:
    events = simple_job()
    task = asyncio.create_task(collect(fake_client))
    while not xrange_calls or await fake_worker.subscribers() == 0:
        await asyncio.sleep(0.005)
    calls_before = len(xrange_calls)

    await fake_worker.emit_all(events[:2])
    await fake_worker.emit(events[2], live=False)  # the live copy was lost
    await fake_worker.emit_all(events[3:])

    got = await asyncio.wait_for(task, 5)
    assert got == events
    # The gap was filled by a log read starting at the missing seq.
    assert log_entry_id(2) in xrange_calls[calls_before:]


async def test_lost_terminal_event_recovered_after_silence(
    fake_client: Client, fake_worker: FakeWorker, xrange_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_mod, "_RESYNC_S", 0.05)
    events = simple_job()
    task = asyncio.create_task(collect(fake_client))
    while not xrange_calls or await fake_worker.subscribers() == 0:
        await asyncio.sleep(0.005)
    await fake_worker.emit_all(events[:-1])
    await fake_worker.emit(events[-1], live=False)  # no later event reveals the gap: only silence does

    got = await asyncio.wait_for(task, 5)
    assert got == events
    assert xrange_calls[-1] == log_entry_id(5)


async def test_a_silent_job_is_read_again_ever_less_often_until_its_events_come(
    fake_client: Client, fake_worker: FakeWorker, xrange_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A queued job is silent by design: each re-read of its log that finds nothing doubles the next wait.
    monkeypatch.setattr(follow_mod, "_RESYNC_S", 0.004)
    monkeypatch.setattr(follow_mod, "_RESYNC_MAX_S", 10.0)
    times: list[float] = []
    recording = fake_client._redis.xrange

    async def timed(*args: Any, **kwargs: Any) -> Any:
        times.append(time.monotonic())
        return await recording(*args, **kwargs)

    fake_client._redis.xrange = timed
    events = simple_job()
    task = asyncio.create_task(collect(fake_client))
    while len(times) < 10:
        await asyncio.sleep(0.005)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # A wait never ends early (a loaded host only makes it longer): each is at least twice the one before.
    assert all(gap >= 0.9 * 0.004 * 2 ** i for i, gap in enumerate(gaps)), gaps
    # Its events come, the terminal's live copy lost. The first silence after them is the short one again: the
    # terminal is read from the log long before the 2 s the doubling had reached (the bound is only for safety).
    await fake_worker.emit_all(events[:-1])
    await fake_worker.emit(events[-1], live=False)
    assert await asyncio.wait_for(task, 1.0) == events
    assert xrange_calls[-1] == log_entry_id(5)


async def test_live_events_from_background_worker(fake_client: Client, fake_worker: FakeWorker) -> None:
    events = simple_job()

    async def run_worker() -> None:
        while await fake_worker.subscribers() == 0:
            await asyncio.sleep(0.005)
        for ev in events:
            await fake_worker.emit(ev, publish_times=2)
            await asyncio.sleep(0.002)

    bg = asyncio.create_task(run_worker())
    got = await collect(fake_client)
    await bg
    assert got == events


async def test_events_timeout_when_nothing_comes(fake_client: Client, fake_worker: FakeWorker) -> None:
    with pytest.raises(WaitTimeout):  # queued (its record exists), and no worker takes it
        await collect(fake_client, timeout=0.1)


async def test_events_of_an_unknown_job_raise_at_once(fake_client: Client, xrange_calls: list[str]) -> None:
    with pytest.raises(JobNotFound, match="job nope is unknown"):
        await fake_client.result("nope", timeout=60)
    assert len(xrange_calls) == 1  # one replay read, then the job's record was looked for: no wait


async def test_events_timeout_when_job_never_ends(fake_client: Client, fake_worker: FakeWorker) -> None:
    await fake_worker.emit_all([start(0), token(1, "x", [1])])
    got: list[Event] = []
    with pytest.raises(WaitTimeout):
        async for ev in fake_client.events(RID, timeout=0.15):
            got.append(ev)
    assert [e.seq for e in got] == [0, 1]


async def test_other_jobs_events_are_not_mixed_in(fake_client: Client, fake_worker: FakeWorker) -> None:
    other = [StartEvent(id="other", seq=0, model="m", worker="w", prompt_tokens=1)]
    await fake_worker.emit_all(other)
    await fake_worker.emit_all(simple_job())
    assert await collect(fake_client) == simple_job()


# --- result() / stream_text() ---------------------------------------------------------------------------


async def test_result_assembles_text_and_token_ids(fake_client: Client, fake_worker: FakeWorker) -> None:
    await fake_worker.emit_all(simple_job())
    res = await fake_client.result(RID, timeout=5)
    assert res.id == RID
    assert res.text == "Hello world"
    assert res.token_ids == [1, 2, 3, 4, 5]
    assert res.finish_reason is FinishReason.STOP
    assert res.usage == Usage(prompt_tokens=3, completion_tokens=5)
    assert res.timings.total_ms == 3.0


async def test_result_raises_job_failed_on_error_event(fake_client: Client, fake_worker: FakeWorker) -> None:
    err = ErrorEvent(id=RID, seq=2, code=ErrorCode.TIMEOUT, message="ran past its deadline", retryable=True)
    await fake_worker.emit_all([start(0), token(1, "partial", [1]), err])
    with pytest.raises(JobFailed) as exc:
        await fake_client.result(RID, timeout=5)
    assert exc.value.event == err
    assert exc.value.code is ErrorCode.TIMEOUT
    assert exc.value.retryable is True
    assert "ran past its deadline" in str(exc.value)


def rerun_job() -> list[Event]:
    """A job that streamed 'Hello', was reset, and re-ran to 'Hello world' (greedy: same prefix)."""
    return [
        start(0),
        token(1, "Hel", [1, 2], 0),
        token(2, "lo", [3], 2),
        ResetEvent(id=RID, seq=3, reason="worker lost", attempt=2),
        start(4, attempt=2),
        token(5, "Hello", [1, 2, 3], 0),
        token(6, " world", [4, 5], 3),
        done(7, completion=5),
    ]


async def test_result_after_reset_drops_earlier_text(fake_client: Client, fake_worker: FakeWorker) -> None:
    await fake_worker.emit_all(rerun_job())
    res = await fake_client.result(RID, timeout=5)
    assert res.text == "Hello world"
    assert res.token_ids == [1, 2, 3, 4, 5]


async def test_stream_text(fake_client: Client, fake_worker: FakeWorker) -> None:
    await fake_worker.emit_all(simple_job())
    deltas = [d async for d in fake_client.stream_text(RID, timeout=5)]
    assert deltas == ["Hel", "lo", " wor", "ld"]


async def test_stream_text_after_reset_yields_no_duplicate_text(fake_client: Client, fake_worker: FakeWorker) -> None:
    await fake_worker.emit_all(rerun_job())
    deltas = [d async for d in fake_client.stream_text(RID, timeout=5)]
    assert "".join(deltas) == "Hello world"
    assert deltas == ["Hel", "lo", " world"]


async def test_stream_text_after_reset_with_diverging_text_fails(fake_client: Client, fake_worker: FakeWorker) -> None:
    events = rerun_job()
    events[5] = token(5, "Help!", [1, 2, 9], 0)
    await fake_worker.emit_all(events)
    deltas: list[str] = []
    with pytest.raises(JobFailed) as exc:
        async for d in fake_client.stream_text(RID, timeout=5):
            deltas.append(d)
    assert deltas == ["Hel", "lo"]
    assert exc.value.retryable is True


async def test_stream_text_detects_divergence_of_a_shorter_rerun(fake_client: Client, fake_worker: FakeWorker) -> None:
    events = [*rerun_job()[:5], token(5, "Help", [1, 2, 9], 0), done(6, completion=3)]
    events[2] = token(2, "lo world", [3, 4, 5], 2)  # first run streamed "Hello world"
    await fake_worker.emit_all(events)
    deltas: list[str] = []
    with pytest.raises(JobFailed):
        async for d in fake_client.stream_text(RID, timeout=5):
            deltas.append(d)


async def test_stream_text_raises_on_error_event(fake_client: Client, fake_worker: FakeWorker) -> None:
    err = ErrorEvent(id=RID, seq=2, code=ErrorCode.ENGINE_ERROR, message="boom")
    await fake_worker.emit_all([start(0), token(1, "ab", [1]), err])
    deltas: list[str] = []
    with pytest.raises(JobFailed) as exc:
        async for d in fake_client.stream_text(RID, timeout=5):
            deltas.append(d)
    assert deltas == ["ab"]
    assert exc.value.code is ErrorCode.ENGINE_ERROR


# --- cancel() -------------------------------------------------------------------------------------------


async def test_a_client_given_a_connection_submits_and_cancels_on_it_and_leaves_it_open(fake_redis: Any) -> None:
    async with Client(prefix=PREFIX, redis=fake_redis) as c:
        rid = await c.submit(model="m", prompt="hi")  # the batched enqueue: a connection of the given pool
        assert await fake_redis.zrange(c.keys.queue("m"), 0, -1) == [rid.encode()]
        assert await c.cancel(rid) is True
        assert await fake_redis.get(c.keys.cancel(rid)) == b"1"
    assert await fake_redis.ping()  # its owner's to close


async def test_cancel_sets_key_with_ttl_and_publishes_id(fake_client: Client, fake_redis: Any) -> None:
    listener = fake_redis.pubsub(ignore_subscribe_messages=True)
    await listener.subscribe(fake_client.keys.cancel_channel())
    await fake_redis.set(fake_client.keys.job(RID), b"{}")  # queued or running
    try:
        assert await fake_client.cancel(RID) is True
        assert await fake_redis.get(fake_client.keys.cancel(RID)) == b"1"
        ttl = await fake_redis.ttl(fake_client.keys.cancel(RID))
        assert 0 < ttl <= CANCEL_TTL_S
        msg = None
        for _ in range(20):  # get_message returns None for the (ignored) subscribe confirmation
            msg = await listener.get_message(timeout=0.2)
            if msg is not None:
                break
        assert msg is not None
        assert msg["channel"] == f"{PREFIX}:cancel".encode()
        assert msg["data"] == RID.encode()
    finally:
        await listener.aclose()


async def test_cancel_of_an_ended_job_is_a_no_op_and_of_an_unknown_one_raises(fake_client: Client,
                                                                              fake_redis: Any) -> None:
    await fake_redis.xadd(fake_client.keys.log(RID), {"e": b"{}"}, id="0-1")  # ended: its record is gone, its log kept
    assert await fake_client.cancel(RID) is False
    with pytest.raises(JobNotFound, match="job nope is unknown"):
        await fake_client.cancel("nope")
    assert not await fake_redis.exists(fake_client.keys.cancel(RID), fake_client.keys.cancel("nope"))


# --- submit_and_follow() --------------------------------------------------------------------------------


def fake_submits(fake_client: Client, fake_worker: FakeWorker, live: list[bool]) -> list[str]:
    """Make ``submit`` record the id and have the fake worker run the job: ``simple_job`` events, the i-th
    published live only if ``live[i]`` (every one goes to the log)."""
    submitted: list[str] = []

    async def submit(request: Any, **_: Any) -> str:
        submitted.append(request.id)

        async def run() -> None:
            for ev, on_air in zip(simple_job(), live):
                await fake_worker.emit(ev, live=on_air)

        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(run()))
        return str(request.id)

    fake_client.submit = submit  # type: ignore[method-assign]
    return submitted


async def test_submit_and_follow_reads_no_log_when_every_event_comes_live(
    fake_client: Client, fake_worker: FakeWorker, xrange_calls: list[str]
) -> None:
    submitted = fake_submits(fake_client, fake_worker, [True] * 6)

    got = [ev async for ev in fake_client.submit_and_follow(id=RID, model="m", prompt="p", timeout=5)]

    assert submitted == [RID]
    assert got == simple_job()
    assert xrange_calls == []  # subscribed before the submit: nothing to replay
    assert fake_client._hub()._subs == {}  # unsubscribed at the end


async def test_submit_and_follow_recovers_a_lost_first_event_from_the_log(
    fake_client: Client, fake_worker: FakeWorker, xrange_calls: list[str]
) -> None:
    fake_submits(fake_client, fake_worker, [False] + [True] * 5)  # start's live copy is lost

    got = [ev async for ev in fake_client.submit_and_follow(id=RID, model="m", prompt="p", timeout=5)]

    assert got == simple_job()
    assert xrange_calls == [log_entry_id(0)]  # the gap (token 1 before start 0) triggered one replay


async def test_submit_and_follow_unsubscribes_when_the_submit_fails(fake_client: Client) -> None:
    async def refuse(request: Any, **_: Any) -> str:
        raise client_mod.DuplicateJob(request.id)

    fake_client.submit = refuse  # type: ignore[method-assign]
    with pytest.raises(client_mod.DuplicateJob):
        async for _ in fake_client.submit_and_follow(id=RID, model="m", prompt="p", timeout=5):
            pass
    assert fake_client._hub()._subs == {}


async def test_a_reader_that_stops_early_unsubscribes_when_it_closes_the_iterator(
    fake_client: Client, fake_worker: FakeWorker
) -> None:
    await fake_worker.emit_all(simple_job()[:2])
    events = fake_client.events(RID, timeout=5)
    assert (await events.__anext__()).type == "start"
    await events.aclose()
    assert fake_client._hub()._subs == {}  # at once, not when the generators are garbage-collected
