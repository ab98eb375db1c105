"""The EMIT and BEGIN scripts (worker/scripts.py) on a real Redis: what one call writes, publishes and refuses."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aredis
from arq.constants import in_progress_key_prefix

from api.keys import Keys
from api.schema import DoneEvent, Event, FinishReason, StartEvent, Timings, TokenEvent, Usage, decode_event
from worker.publisher import Batch, LogTTL, emit_args
from worker.scripts import BEGIN, EMIT, Script

KEYS = Keys("emit-test")
QUEUE = "emit-test:queue"
TTL = LogTTL(live=600, done=30)
ODD_RID = "job 1\nwith newline, spaces and é"  # arq accepts any job id: records must not rely on separators


def _events(rid: str, first: int, n: int, end: bool = False) -> list[Event]:
    evs: list[Event] = [TokenEvent(id=rid, seq=first + i, text=f"t{i}\n", token_ids=[i], index=i) for i in range(n)]
    if end:
        evs.append(DoneEvent(id=rid, seq=first + n, finish_reason=FinishReason.STOP,
                             usage=Usage(prompt_tokens=1, completion_tokens=n),
                             timings=Timings(queue_ms=1, ttft_ms=2, total_ms=3, tokens_per_s=None)))
    return evs


async def _emit(r: aredis.Redis, batches: list[Batch]) -> list[int]:
    return [int(x) for x in await Script.of(EMIT).run(r, *emit_args(KEYS, batches, TTL, QUEUE))]


async def _log(r: aredis.Redis, rid: str) -> list[Any]:
    return [(eid, decode_event(f[b"e"])) for eid, f in await r.xrange(KEYS.log(rid))]


async def test_one_call_writes_several_jobs_and_fences_the_one_whose_lease_is_not_its_own(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(KEYS.lease("a"), "w1:1")
        await r.set(KEYS.lease(ODD_RID), "w1:1")
        await r.set(KEYS.lease("stale"), "w2:2")  # another run took this job over
        a, odd, stale = _events("a", 0, 3), [StartEvent(id=ODD_RID, seq=0, model="m", worker="w1", prompt_tokens=1),
                                             *_events(ODD_RID, 1, 2)], _events("stale", 5, 1)
        written = await _emit(r, [Batch("a", "w1:1", a, ""), Batch(ODD_RID, "w1:1", odd, ""),
                                  Batch("stale", "w1:1", stale, "")])
        assert written == [1, 1, 0]
        assert await _log(r, "a") == [(f"{i}-1".encode(), ev) for i, ev in enumerate(a)]
        assert await _log(r, ODD_RID) == [(f"{i}-1".encode(), ev) for i, ev in enumerate(odd)]
        assert not await r.exists(KEYS.log("stale"))
        assert 590 < await r.ttl(KEYS.log("a")) <= 600
        assert await r.get(KEYS.lease("a")) == b"w1:1"  # more to come: the lease stays
    finally:
        await r.aclose()


async def test_events_go_live_on_the_documented_channel_and_duplicates_are_not_republished(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    try:
        await pubsub.subscribe(KEYS.events(ODD_RID))
        ack = await pubsub.get_message(timeout=5.0)
        assert ack is not None and ack["type"] == "subscribe"
        await r.set(KEYS.lease(ODD_RID), "w1:1")
        evs = _events(ODD_RID, 0, 3)
        assert await _emit(r, [Batch(ODD_RID, "w1:1", evs[:2], "")]) == [1]
        assert await _emit(r, [Batch(ODD_RID, "w1:1", evs, "")]) == [1]  # a retried write: 0 and 1 are logged
        got = []
        while len(got) < 3:
            msg = await pubsub.get_message(timeout=5.0)
            assert msg is not None, f"only {len(got)} of 3 events published"
            got.append(decode_event(msg["data"]))
        assert got == evs
        assert await pubsub.get_message(timeout=0.2) is None  # nothing published twice
    finally:
        await pubsub.aclose()
        await r.aclose()


async def test_end_drops_lease_cancel_and_running_entry_and_shortens_the_log_ttl(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(KEYS.lease("a"), "w1:1")
        await r.set(KEYS.cancel("a"), "1")
        await r.hset(KEYS.running(), "a", QUEUE)
        assert await _emit(r, [Batch("a", "w1:1", _events("a", 0, 1, end=True), "end")]) == [1]
        assert not await r.exists(KEYS.lease("a"), KEYS.cancel("a"))
        assert not await r.hexists(KEYS.running(), "a")
        assert 0 < await r.ttl(KEYS.log("a")) <= TTL.done
    finally:
        await r.aclose()


async def test_release_hands_the_job_back_to_the_queue_in_the_same_call(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(KEYS.lease(ODD_RID), "w1:1")
        await r.set(in_progress_key_prefix + ODD_RID, "1")
        await r.hset(KEYS.running(), ODD_RID, QUEUE)
        assert await _emit(r, [Batch(ODD_RID, "w1:1", _events(ODD_RID, 0, 1), "release")]) == [1]
        assert await r.zscore(QUEUE, ODD_RID) is not None
        assert not await r.exists(KEYS.lease(ODD_RID), in_progress_key_prefix + ODD_RID)
        assert not await r.hexists(KEYS.running(), ODD_RID)
    finally:
        await r.aclose()


async def test_the_reaper_token_writes_only_while_nobody_holds_the_lease(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(KEYS.lease("held"), "w1:1")
        written = await asyncio.gather(_emit(r, [Batch("held", "", _events("held", 0, 1), "end")]),
                                       _emit(r, [Batch("free", "", _events("free", 0, 1), "end")]))
        assert written == [[0], [1]]
        assert await r.get(KEYS.lease("held")) == b"w1:1"
        assert len(await _log(r, "free")) == 1
    finally:
        await r.aclose()


# --- BEGIN: a run's start ---------------------------------------------------------------------------------


def _begin_keys(rid: str) -> list[str]:
    return [KEYS.lease(rid), KEYS.running(), QUEUE, KEYS.log(rid), KEYS.cancel(rid)]


async def test_begin_takes_the_lease_lists_the_job_running_and_reads_its_history(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zadd(QUEUE, {ODD_RID: 1})
        await r.set(KEYS.cancel(ODD_RID), "1")
        history = _events(ODD_RID, 0, 2)
        for ev in history:
            await r.xadd(KEYS.log(ODD_RID), {"e": ev.model_dump_json()}, id=f"{ev.seq}-1")
        taken, last, cancelled = await Script.of(BEGIN).run(r, _begin_keys(ODD_RID), ["w1:2", 5000, ODD_RID, 99])
        assert (taken, cancelled) == (1, 1)
        assert decode_event(last) == history[-1]
        assert await r.get(KEYS.lease(ODD_RID)) == b"w1:2"
        assert 0 < await r.pttl(KEYS.lease(ODD_RID)) <= 5000
        assert await r.hget(KEYS.running(), ODD_RID) == QUEUE.encode()
        assert await r.zscore(QUEUE, ODD_RID) is None  # out of arq's queue while it runs
    finally:
        await r.aclose()


async def test_begin_on_a_leased_job_defers_it_in_the_queue_and_touches_nothing_else(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(KEYS.lease("a"), "w1:1")  # a live run holds it
        taken, last, cancelled = await Script.of(BEGIN).run(r, _begin_keys("a"), ["w2:2", 5000, "a", 12345])
        assert (taken, last, cancelled) == (0, None, 0)
        assert await r.get(KEYS.lease("a")) == b"w1:1"
        assert await r.zscore(QUEUE, "a") == 12345
        assert not await r.hexists(KEYS.running(), "a")
    finally:
        await r.aclose()
