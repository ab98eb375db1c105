"""The EMIT and START scripts (worker/scripts.py) on a real Redis: what one call writes, publishes and refuses."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aredis
from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix

from api.keys import Keys
from api.schema import DoneEvent, Event, FinishReason, StartEvent, Timings, TokenEvent, Usage, decode_event
from worker.publisher import Batch, LogTTL, emit_args
from worker.scripts import EMIT, START, SWEEP, Script

KEYS = Keys("emit-test")
QUEUE = "emit-test:queue"
TTL = LogTTL(live=600, done=30, result=20)
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


# --- START: claim and start jobs -------------------------------------------------------------------------


async def _start(r: aredis.Redis, ids: list[str], most: int = 10, worker: str = "w1") -> list[Any]:
    args = [1000, 60_000, most, worker, 5000, 12345, KEYS.prefix, in_progress_key_prefix, job_key_prefix,
            retry_key_prefix, *ids]
    return list(await Script.of(START).run(r, [QUEUE, KEYS.running()], args))


async def test_start_claims_reads_counts_leases_and_reads_the_history_of_each_job(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zadd(QUEUE, {ODD_RID: 1, "b": 2, "later": 5000, "held": 3})
        await r.set(job_key_prefix + ODD_RID, b'{"job": 1}')
        await r.set(retry_key_prefix + ODD_RID, 1)  # one earlier try
        await r.set(in_progress_key_prefix + "held", "1")  # another worker claimed it
        await r.set(KEYS.cancel(ODD_RID), "1")
        history = _events(ODD_RID, 0, 2)
        for ev in history:
            await r.xadd(KEYS.log(ODD_RID), {"e": ev.model_dump_json()}, id=f"{ev.seq}-1")
        (odd, b) = await _start(r, [ODD_RID, "b", "later", "held", "gone"])  # "later" is not due, "gone" unqueued
        rid, score, job, attempt, taken, last, cancelled = odd
        assert (rid, score, job, attempt, taken, cancelled) == (ODD_RID.encode(), b"1", b'{"job": 1}', 2, 1, 1)
        assert decode_event(last) == history[-1]
        assert b == [b"b", b"2", None, 1, 1, None, 0]  # its job key is gone: the worker ends it with an error
        assert await r.get(KEYS.lease(ODD_RID)) == b"w1:2"  # token: worker id and try
        assert 0 < await r.pttl(KEYS.lease(ODD_RID)) <= 5000
        assert 0 < await r.pttl(in_progress_key_prefix + ODD_RID) <= 60_000  # arq's claim
        assert 88000 < await r.ttl(retry_key_prefix + ODD_RID) <= 88400  # as arq's run_job
        assert await r.hget(KEYS.running(), ODD_RID) == QUEUE.encode()
        assert await r.zscore(QUEUE, ODD_RID) is None  # out of arq's queue while it runs
        assert await r.zscore(QUEUE, "later") == 5000 and not await r.exists(in_progress_key_prefix + "later")
    finally:
        await r.aclose()


async def test_start_takes_at_most_the_free_slots(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zadd(QUEUE, {"a": 1, "b": 1, "c": 1})
        assert [row[0] for row in await _start(r, ["a", "b", "c"], most=2)] == [b"a", b"b"]
        assert await r.zscore(QUEUE, "c") == 1 and not await r.exists(in_progress_key_prefix + "c")
    finally:
        await r.aclose()


async def test_start_on_a_leased_job_defers_it_and_drops_the_claim(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zadd(QUEUE, {"a": 1, "b": 1})
        await r.set(KEYS.lease("a"), "w1:1")  # a live run holds it
        rows = await _start(r, ["a", "b"], most=1, worker="w2")
        assert [(row[0], row[4]) for row in rows] == [(b"a", 0), (b"b", 1)]  # a deferred job takes no slot
        assert await r.get(KEYS.lease("a")) == b"w1:1"
        assert await r.zscore(QUEUE, "a") == 12345
        assert not await r.exists(in_progress_key_prefix + "a")  # any worker may take it when it is due
        assert not await r.hexists(KEYS.running(), "a")
    finally:
        await r.aclose()


async def test_end_finishes_the_arq_job_and_keeps_its_result(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        rid = ODD_RID + " end"
        await r.set(KEYS.lease(rid), "w1:1")
        arq_keys = [in_progress_key_prefix + rid, job_key_prefix + rid, retry_key_prefix + rid]
        for key in arq_keys:
            await r.set(key, "1")
        await r.zadd(QUEUE, {rid: 1})
        await r.hset(KEYS.running(), rid, QUEUE)
        end = Batch(rid, "w1:1", _events(rid, 0, 2, end=True), "end", result=b'{"r": "done"}')
        assert await _emit(r, [end]) == [1]
        assert not await r.exists(*arq_keys, KEYS.lease(rid))
        assert await r.zscore(QUEUE, rid) is None and not await r.hexists(KEYS.running(), rid)
        assert await r.get(result_key_prefix + rid) == b'{"r": "done"}'
        assert 0 < await r.pttl(result_key_prefix + rid) <= 20_000
        assert len(await _log(r, rid)) == 3
    finally:
        await r.aclose()


async def test_sweep_lists_only_running_jobs_without_a_lease(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.hset(KEYS.running(), mapping={"leased": QUEUE, ODD_RID: QUEUE, "other": "q2"})
        await r.set(KEYS.lease("leased"), "w1:1")
        flat = await Script.of(SWEEP).run(r, [KEYS.running()], [KEYS.prefix])
        assert dict(zip(flat[::2], flat[1::2])) == {ODD_RID.encode(): QUEUE.encode(), b"other": b"q2"}
    finally:
        await r.aclose()


async def test_arq_result_is_the_record_arq_would_write_without_the_arguments() -> None:
    import json

    from api.connection import JOB_FUNCTION, loads_job
    from api.schema import ErrorCode, ErrorEvent
    from worker.job import Job
    from worker.publisher import arq_result

    job = Job("r-1", "tiny", 1_700_000_000.25, attempt=2, token="w1:2")
    error = ErrorEvent(id="r-1", seq=3, code=ErrorCode.TIMEOUT, message='ran "long" — ✗\n')
    for end in (_events("r-1", 0, 1, end=True)[-1], error):
        record = arq_result(job, end, "mlxq:queue:tiny")
        parsed = json.loads(record)
        assert loads_job(record) == parsed  # the worker's own job deserializer reads it
        assert parsed.pop("ft") >= parsed["st"]
        assert parsed == {"t": 2, "f": JOB_FUNCTION, "a": [], "k": {}, "et": 1_700_000_000_250,
                          "s": end.type == "done", "r": end.model_dump(mode="json"),
                          "st": int(job.started_at * 1000), "q": "mlxq:queue:tiny", "id": "r-1"}
