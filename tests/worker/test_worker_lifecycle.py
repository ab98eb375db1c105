"""A job's transitions (worker/jobs/transitions.py) on a real Redis: what each call writes, publishes and refuses, and
what the run table's verbs decide."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api.protocol.claim import EntryStatus, Outranking
from mlxq.api.protocol.emit import LogTTL, Write
from mlxq.api.protocol.jobrecord import JOB_FUNCTION, job_record, read_job
from mlxq.api.protocol.keys import Keys, queue_score
from mlxq.api.schema import DoneEvent, ErrorCode, Event, FinishReason, StartEvent, TokenEvent, decode_event
from mlxq.engine.core.request import FinishReason as EngineFinish
from mlxq.engine.core.request import RequestOutput
from mlxq.worker.jobs.run import Run, State, Wire
from mlxq.worker.jobs.table import RunTable
from mlxq.worker.jobs.transitions import Record, Transitions

KEYS = Keys("lc-test")
QUEUE = KEYS.queue("m")
TTL = LogTTL(live=600, done=30, result=20)
ODD_RID = "job 1\nwith newline, spaces and é"  # records are length-prefixed: they rely on no separator


def transitions(r: aredis.Redis, worker: str = "w1") -> Transitions:
    return Transitions(r, KEYS, worker, TTL, lease_ttl_s=5.0)


def run(rid: str, owner: str = "w1:1", seq: int = 0, attempt: int = 1, epoch: str = "") -> Run:
    return Run(rid, QUEUE, owner, attempt, seq=seq, epoch=epoch, model="m", enqueue_ms=1_700_000_000_250)


def tokens(r: Run, n: int) -> list[Any]:
    return [r.tokens(f"t{i}\n", [i], i + 1) for i in range(n)]


async def logged(r: aredis.Redis, rid: str) -> list[tuple[bytes, Event]]:
    return [(eid, decode_event(f[b"e"])) for eid, f in await r.xrange(KEYS.log(rid))]


async def queue_job(r: aredis.Redis, rid: str, score: int = 1) -> None:
    await r.set(KEYS.job(rid), job_record({"n": rid}, 1000))
    await r.zadd(QUEUE, {rid: score})


# --- append, end, hand back --------------------------------------------------------------------------
async def test_one_call_writes_several_jobs_and_refuses_the_one_whose_lease_is_not_its_own(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        a, odd, stale = run("a"), run(ODD_RID), run("stale", seq=5)
        for x, holder in ((a, "w1:1"), (odd, "w1:1"), (stale, "w2:2")):  # another run took "stale" over
            await r.set(KEYS.lease(x.rid), holder)
        evs_a, evs_odd = tokens(a, 3), [odd.start(1, "w1"), *tokens(odd, 2)]
        records = [Record(a, evs_a, Write.APPEND), Record(odd, evs_odd, Write.APPEND),
                   Record(stale, tokens(stale, 1), Write.APPEND)]
        assert await transitions(r).write(records) == [True, True, False]
        assert [(eid, ev.model_dump_json()) for eid, ev in await logged(r, "a")] == [
            (f"{i}-1".encode(), ev.model_dump_json()) for i, ev in enumerate(evs_a)]
        assert [ev.seq for _, ev in await logged(r, ODD_RID)] == [0, 1, 2]
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
        job = run(ODD_RID)
        evs = tokens(job, 3)
        assert await transitions(r).write([Record(job, evs[:2], Write.APPEND)]) == [True]
        assert await transitions(r).write([Record(job, evs, Write.APPEND)]) == [True]  # a retried write
        got = []
        while len(got) < 3:
            msg = await pubsub.get_message(timeout=5.0)
            assert msg is not None, f"only {len(got)} of 3 events published"
            got.append(decode_event(msg["data"]))
        assert [e.model_dump_json() for e in got] == [e.model_dump_json() for e in evs]
        assert await pubsub.get_message(timeout=0.2) is None  # nothing published twice
    finally:
        await pubsub.aclose()
        await r.aclose()


async def test_a_runs_token_appends_are_written_as_records_are_and_set_the_logs_ttl_a_tenth_as_often(
        redis_url: str) -> None:
    # A run's one-event appends after its first take EMIT's token path: the same lease check, log entries and
    # publishes (a duplicate not published again), answered in the caller's order among the other records
    r = aredis.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    try:
        await pubsub.subscribe(KEYS.events("a"))
        assert await pubsub.get_message(timeout=5.0) is not None  # the subscribe's ack
        a, b, stale = run("a"), run("b"), run("stale")
        for x, holder in ((a, "w1:1"), (b, "w1:1"), (stale, "w2:2")):
            await r.set(KEYS.lease(x.rid), holder)
        t = transitions(r)
        evs = tokens(a, 4)
        assert await t.write([Record(a, evs[:1], Write.APPEND), Record(stale, tokens(stale, 1), Write.APPEND)]) == [
            True, False]  # first appends: records, which set the log's TTL
        await r.expire(KEYS.log("a"), 100)  # to see whether the next appends set it again
        records = [Record(a, evs[1:2], Write.APPEND), Record(b, [b.start(1, "w1"), *tokens(b, 1)], Write.APPEND),
                   Record(stale, tokens(stale, 1), Write.APPEND)]
        assert await t.write(records) == [True, True, False]
        assert 90 < await r.ttl(KEYS.log("a")) <= 100  # left as the first append set it
        assert await t.write([Record(a, evs[1:3], Write.APPEND)]) == [True]  # a retried write and one more
        assert await t.write([Record(a, evs[2:3], Write.APPEND)]) == [True]  # a duplicate alone
        assert [eid for eid, _ in await logged(r, "a")] == [b"0-1", b"1-1", b"2-1"]
        a.log_ttl_at -= TTL.live / 10  # a tenth of the TTL later: the next append sets it again
        assert await t.write([Record(a, evs[3:], Write.APPEND)]) == [True]
        assert 590 < await r.ttl(KEYS.log("a")) <= 600
        await r.delete(KEYS.lease("a"))  # the lease lost: the token path refuses too
        assert await t.write([Record(a, tokens(a, 1), Write.APPEND)]) == [False]
        got = []
        while len(got) < 4:
            msg = await pubsub.get_message(timeout=5.0)
            assert msg is not None, f"only {len(got)} of 4 events published"
            got.append(msg["data"].decode())
        assert got == [e.model_dump_json() for e in evs]
        assert await pubsub.get_message(timeout=0.2) is None  # nothing published twice, nothing refused
        assert not await r.exists(KEYS.log("stale"))
    finally:
        await pubsub.aclose()
        await r.aclose()


async def test_end_finishes_the_job_keeps_arqs_result_record_and_shortens_the_log_ttl(redis_url: str) -> None:
    from mlxq.worker.arqseam import arq_job

    r = aredis.Redis.from_url(redis_url)
    try:
        job = run("a", attempt=2)
        await queue_job(r, "a")
        for key in (KEYS.lease("a"), KEYS.cancel("a"), KEYS.tries("a")):
            await r.set(key, "w1:1" if key == KEYS.lease("a") else "1")
        await r.hset(KEYS.running(), "a", QUEUE)
        end = job.done(FinishReason.STOP)
        assert await transitions(r).write([Record(job, [*tokens(job, 1), end], Write.END)]) == [True]
        assert not await r.exists(KEYS.lease("a"), KEYS.cancel("a"), KEYS.job("a"), KEYS.tries("a"))
        assert await r.zscore(QUEUE, "a") is None and not await r.hexists(KEYS.running(), "a")
        assert 0 < await r.ttl(KEYS.log("a")) <= TTL.done
        assert 0 < await r.pttl(KEYS.result("a")) <= TTL.result * 1000
        info = await arq_job(r, KEYS, "m", "a").result_info()  # arq's own record, read by arq's own Job
        assert info is not None and info.success and info.function == JOB_FUNCTION and info.job_try == 2
        assert list(info.args) == [] and DoneEvent.model_validate(info.result) == end
    finally:
        await r.aclose()


async def test_hand_back_queues_the_job_again_in_the_same_call(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        job = run(ODD_RID)
        await r.set(KEYS.lease(ODD_RID), "w1:1")
        await r.hset(KEYS.running(), ODD_RID, QUEUE)
        assert await transitions(r).write([Record(job, [job.reset("shutdown")], Write.HAND_BACK)]) == [True]
        assert await r.zscore(QUEUE, ODD_RID) is not None
        await r.set(KEYS.lease("scored"), "w1:1")
        await r.hset(KEYS.running(), "scored", f"-1234 {QUEUE}")  # as CLAIM lists a job: score, then queue
        scored = run("scored")
        assert await transitions(r).write([Record(scored, [scored.reset("shutdown")], Write.HAND_BACK)]) == [True]
        assert await r.zscore(QUEUE, "scored") == -1234  # back in its old place
        assert not await r.exists(KEYS.lease(ODD_RID)) and not await r.hexists(KEYS.running(), ODD_RID)
        ((_, reset),) = await logged(r, ODD_RID)
        assert reset.type == "reset" and reset.attempt == 2
    finally:
        await r.aclose()


async def test_a_run_that_wakes_after_its_job_ended_elsewhere_changes_nothing(redis_url: str) -> None:
    # Issue 13, scenario 1 in one call: the paused run's lease expired, another run finished the job, its
    # log expired; the paused run's late writes, even its terminal one, are refused and recreate nothing.
    r = aredis.Redis.from_url(redis_url)
    try:
        late = run("a", owner="paused:1", seq=7)
        lc = transitions(r, "paused")
        writes = [Record(late, tokens(late, 1), Write.APPEND), Record(late, [late.error(ErrorCode.INTERNAL, "x")],
                                                                       Write.END),
                  Record(late, [late.reset("shutdown")], Write.HAND_BACK)]
        assert [await lc.write([w]) for w in writes] == [[False]] * 3
        lost = Record(late, [late.error(ErrorCode.DATA_LOST, "lost")], Write.LOST)
        await r.set(KEYS.epoch(), "e1")
        late.epoch = "e1"  # the deployment's data is intact: the job ended, nothing was lost
        assert await lc.write([lost]) == [False]
        assert [k async for k in r.scan_iter()] == [KEYS.epoch().encode()]
    finally:
        await r.aclose()


async def test_the_lost_write_ends_a_job_only_when_redis_lost_its_data(redis_url: str) -> None:
    # Issue 13, scenario 3: the epoch changed (or vanished) and the job record is gone.
    r = aredis.Redis.from_url(redis_url)
    try:
        job = run("a", seq=4, epoch="before")
        lc = transitions(r)
        await r.set(KEYS.job("a"), b"{}")
        assert await lc.write([Record(job, [job.error(ErrorCode.DATA_LOST, "x")], Write.LOST)]) == [False]
        await r.delete(KEYS.job("a"))  # a restart without persistence: everything is gone
        end = job.error(ErrorCode.DATA_LOST, "lost")
        assert end.retryable
        assert await lc.write([Record(job, [end], Write.LOST)]) == [True]
        assert [ev for _, ev in await logged(r, "a")] == [end]
        assert 0 < await r.ttl(KEYS.log("a")) <= TTL.done
    finally:
        await r.aclose()


# --- claim ---------------------------------------------------------------------------------------------
async def test_claim_leases_counts_the_try_and_reads_the_history_of_each_job(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await queue_job(r, "odd", 1)
        await queue_job(r, "b", 2)
        await queue_job(r, "later", 1 << 50)
        await r.set(KEYS.tries("odd"), 1)  # one earlier run
        await r.set(KEYS.cancel("odd"), "1")
        earlier = run("odd")
        history = [earlier.start(3, "w0"), *tokens(earlier, 1)]
        for ev in history:
            await r.xadd(KEYS.log("odd"), {"e": ev.model_dump_json()}, id=f"{ev.seq}-1")
        due = await transitions(r).claim({QUEUE: 10}, 10)
        odd, b = due.entries  # "later" is not due yet
        assert not due.left
        assert (odd.rid, odd.status, odd.attempt, odd.cancelled) == ("odd", EntryStatus.STARTED, 2, True)
        assert read_job(odd.job, 1 << 20).payload == {"n": "odd"}
        assert odd.last is not None and odd.last.model_dump_json() == history[-1].model_dump_json()
        assert (b.status, b.attempt, b.last, b.cancelled) == (EntryStatus.STARTED, 1, None, False)
        assert odd.epoch == b.epoch and await r.get(KEYS.epoch()) == odd.epoch.encode()
        assert await r.get(KEYS.lease("odd")) == b"w1:2"  # the token names the worker and the try
        assert 0 < await r.pttl(KEYS.lease("odd")) <= 5000
        assert await r.get(KEYS.tries("odd")) == b"2" and await r.ttl(KEYS.tries("odd")) > 0
        assert await r.hget(KEYS.running(), "odd") == b"1 " + QUEUE.encode()  # its score: a hand-back keeps it
        assert await r.zscore(QUEUE, "odd") is None  # out of the queue while it runs
        assert await r.zscore(QUEUE, "later") == 1 << 50
        resumed = transitions(r).run(odd, "m", 1000)
        assert (resumed.seq, resumed.owner, resumed.attempt) == (2, "w1:2", 2)  # numbering goes on
    finally:
        await r.aclose()


async def test_claim_takes_at_most_the_free_slots_and_each_queues_quota(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        for rid in "abc":
            await queue_job(r, rid)
        due = await transitions(r).claim({QUEUE: 5}, 2)
        assert [s.rid for s in due.entries] == ["a", "b"] and due.left
        assert await r.zscore(QUEUE, "c") == 1 and not await r.exists(KEYS.lease("c"), KEYS.tries("c"))
        due = await transitions(r).claim({QUEUE: 0}, 5)  # no room: nothing read, yet it says jobs wait
        assert due.entries == [] and due.left
        due = await transitions(r).claim({QUEUE: 1}, 5)
        assert [s.rid for s in due.entries] == ["c"] and not due.left
    finally:
        await r.aclose()


async def test_claim_takes_the_lowest_scores_across_queues_each_within_its_quota(redis_url: str) -> None:
    other = KEYS.queue("other")
    r = aredis.Redis.from_url(redis_url)
    try:
        for rid, queue, score in (("a1", QUEUE, 10), ("a2", QUEUE, 30), ("a3", QUEUE, 50),
                                  ("b1", other, 20), ("b2", other, 40), ("b3", other, 5)):
            await r.set(KEYS.job(rid), job_record({"n": rid}, 1000))
            await r.zadd(queue, {rid: score})
        due = await transitions(r).claim({QUEUE: 3, other: 1}, 4)
        assert [(s.rid, s.queue) for s in due.entries] == [("b3", other), ("a1", QUEUE), ("a2", QUEUE),
                                                            ("a3", QUEUE)]
        assert due.left  # b1, b2: over the other queue's quota
        assert await r.zrange(other, 0, -1) == [b"b1", b"b2"]
    finally:
        await r.aclose()


async def test_claim_from_a_full_engines_queue_takes_only_a_job_that_outranks_its_running_ones(
        redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    now = int(time.time() * 1000)
    try:
        for rid, priority, waited_ms in (("normal", 0, 100), ("old-normal", 0, 9_000), ("urgent", 3, 50)):
            await r.set(KEYS.job(rid), job_record({"n": rid}, now - waited_ms))
            await r.zadd(QUEUE, {rid: queue_score(now - waited_ms, priority, 1000)})
        need = Outranking(priority=2, aging_ms=1000)  # the engine runs priority 1 at the lowest
        due = await transitions(r).claim({QUEUE: 1}, 4, {QUEUE: need})
        # "old-normal" comes first by score (it waited as long as two levels are worth), but would not preempt
        # anything once claimed (the engine preempts for a higher priority only): the full engine leaves it.
        assert [s.rid for s in due.entries] == ["urgent"] and due.left
        due = await transitions(r).claim({QUEUE: 1}, 4, {QUEUE: need})
        assert due.entries == [] and due.left
        assert await r.zrange(QUEUE, 0, -1) == [b"old-normal", b"normal"]
        due = await transitions(r).claim({QUEUE: 2}, 4)  # room again: by score, as ever
        assert [s.rid for s in due.entries] == ["old-normal", "normal"] and not due.left
    finally:
        await r.aclose()


async def test_claim_returns_entries_that_are_no_job_id_as_poison(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        poison = [b"\xff\xfe", b"has space", b"x" * 65, b"ok\n"]
        await r.zadd(QUEUE, {p: 1 for p in poison})
        await queue_job(r, "fine", 2)
        due = await transitions(r).claim({QUEUE: 5}, 5)
        assert sorted(s.entry for s in due.entries if s.status is EntryStatus.POISON) == sorted(poison)
        assert [s.rid for s in due.entries if s.status is EntryStatus.STARTED] == ["fine"]
    finally:
        await r.aclose()


async def test_claim_counts_no_try_for_a_job_whose_lease_another_run_holds(redis_url: str) -> None:
    # Issue 13, scenario 2: tries count runs that started, nothing else (it once counted every deferral).
    r = aredis.Redis.from_url(redis_url)
    try:
        await queue_job(r, "a")
        await queue_job(r, "b")
        await r.set(KEYS.tries("a"), 1)
        await r.set(KEYS.lease("a"), "w1:1")  # a live run holds it
        lc = transitions(r, "w2")
        for _ in range(5):
            await r.zadd(QUEUE, {"a": 1})
            a, *rest = (await lc.claim({QUEUE: 1}, 1)).entries
            assert a.status is EntryStatus.DEFERRED
        assert await r.get(KEYS.tries("a")) == b"1" and await r.get(KEYS.lease("a")) == b"w1:1"
        assert (await r.zscore(QUEUE, "a") or 0) > 1 and not await r.hexists(KEYS.running(), "a")
        assert [s.status for s in rest] == []  # "b" started on the first call: a deferred job takes no slot
    finally:
        await r.aclose()


async def test_claim_leaves_a_queue_entry_without_a_record_for_reject(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.zadd(QUEUE, {"gone": 1})
        lc = transitions(r)
        (gone,) = (await lc.claim({QUEUE: 5}, 5)).entries
        assert gone.status is EntryStatus.GONE and not await r.exists(KEYS.lease("gone"), KEYS.tries("gone"))
        assert await lc.reject(QUEUE, [b"gone", b"\xff\xfe not utf-8"], "no job record") == 1
        assert await r.zcard(QUEUE) == 0
        (letter,) = [json.loads(x) for x in await r.lrange(KEYS.dead_letters(), 0, -1)]
        assert letter["entry"] == "gone" and letter["reason"] == "no job record" and letter["queue"] == QUEUE
        assert await r.ttl(KEYS.dead_letters()) > 0
    finally:
        await r.aclose()


# --- the reaper's moves --------------------------------------------------------------------------------
async def test_sweep_lists_running_jobs_without_a_lease_and_drops_ended_ones(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.hset(KEYS.running(), mapping={"leased": QUEUE, "lost": QUEUE, "ended": "q2"})
        await r.set(KEYS.lease("leased"), "w1:1")
        await r.set(KEYS.tries("lost"), 2)
        await r.set(KEYS.job("lost"), b"{}")
        ended = run("ended")
        await r.xadd(KEYS.log("ended"), {"e": ended.done(FinishReason.STOP).model_dump_json()}, id="0-1")
        (lost,) = await transitions(r).sweep()
        assert (lost.rid, lost.queue, lost.next_seq, lost.tries, lost.has_record) == ("lost", QUEUE, 0, 2, True)
        assert not await r.hexists(KEYS.running(), "ended")
    finally:
        await r.aclose()


async def test_two_reapers_never_both_act_on_one_job_and_never_while_a_run_holds_it(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.hset(KEYS.running(), mapping={"lost": QUEUE, "held": QUEUE})
        await r.set(KEYS.lease("held"), "w1:1")
        lc = transitions(r)
        (lost,) = await lc.sweep()
        reapers = [lc.orphan(lost), lc.orphan(lost)]
        records = [Record(x, [x.reset("worker lost")], Write.HAND_BACK) for x in reapers]
        done = await asyncio.gather(*(lc.write([rec]) for rec in records))
        assert sorted(done) == [[False], [True]]
        held = lc.orphan(lost)
        held.rid = "held"
        assert await lc.write([Record(held, [held.reset("worker lost")], Write.HAND_BACK)]) == [False]
        assert len(await logged(r, "lost")) == 1 and await r.zscore(QUEUE, "lost") is not None
    finally:
        await r.aclose()


async def test_refresh_extends_only_leases_still_held_by_their_run(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(KEYS.lease("mine"), "w1:1", px=100)
        await r.set(KEYS.lease("taken"), "w2:2", px=100)
        held = await transitions(r).refresh([run("mine"), run("taken"), run("expired")])
        assert held == [True, False, False]
        assert await r.pttl(KEYS.lease("mine")) > 1000 and await r.pttl(KEYS.lease("taken")) <= 100
    finally:
        await r.aclose()


def test_a_run_numbers_its_events_and_builds_each_kind() -> None:
    async def build() -> list[Any]:
        job = run("r-1", seq=3)
        return [job.start(5, "w1"), *tokens(job, 2), job.reset("again"), job.done(FinishReason.LENGTH)]

    evs = asyncio.run(build())
    assert [e.seq for e in evs] == [3, 4, 5, 6, 7]
    assert isinstance(evs[0], StartEvent) and evs[0].prompt_tokens == 5
    assert TokenEvent.model_validate_json(evs[2].model_dump_json()).index == 1
    assert isinstance(evs[-1], DoneEvent) and evs[-1].usage.completion_tokens == 2


def test_a_runs_time_queued_ends_when_the_step_that_admitted_it_ended_not_when_its_start_was_sent() -> None:
    from mlxq.worker.jobs.translate import output_events

    async def build() -> list[Any]:
        job = run("r-2")  # enqueued at 1_700_000_000.250
        # the pacer held the start for its first token, two steps later: one output carries both
        out = RequestOutput("r-2", [7], "x", started=True, prompt_tokens=5, completion_tokens=1,
                            started_at=1_700_000_000.500)
        return [*output_events(out, job, "w1"), job.done(FinishReason.LENGTH)]

    start, _, done = asyncio.run(build())
    assert isinstance(start, StartEvent) and isinstance(done, DoneEvent)
    assert done.timings.queue_ms == pytest.approx(250.0)


def test_a_runs_usage_counts_the_prompt_tokens_its_engine_took_from_the_prefix_cache() -> None:
    from mlxq.worker.jobs.translate import output_events

    async def build(cached: int) -> DoneEvent:
        job = run("r-3")
        out = RequestOutput("r-3", [7], "x", started=True, prompt_tokens=90, completion_tokens=1,
                            cached_tokens=cached)
        output_events(out, job, "w1")
        return job.done(FinishReason.LENGTH)

    hit, miss = asyncio.run(build(64)), asyncio.run(build(0))
    assert (hit.usage.prompt_tokens, hit.usage.cached_tokens) == (90, 64)
    assert decode_event(hit.model_dump_json()) == hit
    # Without a hit the field stays off the wire: a producer of an earlier release reads the event as before.
    assert json.loads(miss.model_dump_json())["usage"] == {"prompt_tokens": 90, "completion_tokens": 1}


# --- expiry of queued jobs -------------------------------------------------------------------------------
async def test_a_queued_job_expires_once_and_one_started_meanwhile_does_not(redis_url: str) -> None:
    from mlxq.api.protocol.keys import deadline_member

    r = aredis.Redis.from_url(redis_url)
    try:
        for rid in ("late", "taken", "fresh"):
            await queue_job(r, rid)
        await r.zadd(KEYS.deadlines(), {deadline_member("late", QUEUE): 1, deadline_member("taken", QUEUE): 1,
                                        deadline_member("fresh", QUEUE): 1 << 50})
        lc = transitions(r)
        lapsed = await lc.lapsed()
        assert sorted((x.rid, x.queue, x.next_seq, x.enqueue_ms) for x in lapsed) == [
            ("late", QUEUE, 0, 1000), ("taken", QUEUE, 0, 1000)]
        await r.zrem(QUEUE, "taken")  # a worker started it since the read: starting wins
        records = [Record(x := lc.expiring(job), [x.error(ErrorCode.EXPIRED, "too late")], Write.EXPIRE)
                   for job in sorted(lapsed, key=lambda job: job.rid)]
        assert await lc.write(records) == [True, False]
        assert await lc.write(records[:1]) == [False]  # never twice
        ((_, end),) = await logged(r, "late")
        assert end.type == "error" and end.code is ErrorCode.EXPIRED
        assert not await r.exists(KEYS.job("late")) and await r.zscore(QUEUE, "late") is None
        assert await r.zrange(KEYS.deadlines(), 0, -1) == [deadline_member("taken", QUEUE).encode(),
                                                          deadline_member("fresh", QUEUE).encode()]
        assert await lc.lapsed() == []  # "taken" is not queued any more: its deadline is dropped
        assert await r.zrange(KEYS.deadlines(), 0, -1) == [deadline_member("fresh", QUEUE).encode()]
    finally:
        await r.aclose()


# --- the run table: one terminal event per job, nothing from a fenced run ------------------------------------
def outputs(out: RequestOutput, run: Run, worker: str) -> list[Wire]:
    """Engine outputs as events, as worker/jobs/translate.py makes them (text and ends only: enough here)."""
    events: list[Wire] = [run.tokens(out.text, out.token_ids, out.completion_tokens)] if out.token_ids else []
    if out.finish is not None:
        events.append(run.done(FinishReason(out.finish.value), generated=out.completion_tokens))
    return events


class _Service:
    """A model's service as the run table drops sequences through it: it records each job dropped."""

    def __init__(self, stopped: list[str]) -> None:
        self.stopped = stopped

    def abort(self, rid: str) -> None:
        self.stopped.append(rid)


def table(r: aredis.Redis, stopped: list[str]) -> RunTable:
    services: Any = {"m": _Service(stopped)}  # every run() here is of model "m"
    return RunTable(transitions(r), outputs, services, give_up_s=1.0)


async def running_job(r: aredis.Redis, rid: str, holder: str = "w1:1") -> Run:
    """A job CLAIM left running, its lease held by ``holder``; this worker's run of it (w1's first try)."""
    await r.set(KEYS.epoch(), "e1")
    await r.set(KEYS.job(rid), job_record({"n": rid}, 1000))
    await r.set(KEYS.lease(rid), holder)
    await r.hset(KEYS.running(), rid, QUEUE)
    return run(rid, epoch="e1")


async def test_a_job_gets_one_terminal_event_whichever_verbs_end_it_and_in_whatever_order(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    stopped: list[str] = []
    try:
        runs = table(r, stopped)
        early = await running_job(r, "early")  # ended before its engine: two verbs at once, then a third
        states = await asyncio.gather(runs.fail(early, ErrorCode.ENGINE_ERROR, "dead"), runs.reject(early, "bad"))
        assert states == [State.ENDED, State.ENDED]
        assert await runs.end_cancelled(early) is State.ENDED
        assert [ev.type for _, ev in await logged(r, "early")] == ["error"]

        engine = await running_job(r, "engine")  # in its engine: its output ends it; what follows finds it gone
        assert runs.admit(engine, None, None) and "engine" in runs
        done = RequestOutput("engine", [7], "x", completion_tokens=1, finish=EngineFinish.LENGTH)
        await runs.apply([done])
        assert "engine" not in runs and engine.state is State.ENDED
        await runs.apply([], ["engine"])  # a cancel that came late
        await runs.interrupt(engine, max_tries=3)
        assert await runs.fail(engine, ErrorCode.INTERNAL, "a bug") is State.ENDED
        assert [ev.type for _, ev in await logged(r, "engine")] == ["token", "done"]
        # One EMIT call each: no later verb even tried (Redis would have refused it, and the run been fenced).
        assert (runs.stats.writes, runs.stats.other_writes, runs.stats.fenced, runs.stats.lease_losses) == (1, 1, 0, 0)
    finally:
        await r.aclose()


async def test_a_fenced_run_writes_nothing_more(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    stopped: list[str] = []
    try:
        runs = table(r, stopped)
        taken = await running_job(r, "taken", holder="w2:2")  # another run owns the job now
        assert runs.admit(taken, None, None)
        await runs.apply([RequestOutput("taken", [1], "a", completion_tokens=1)])  # refused: fenced
        assert taken.state is State.FENCED and "taken" not in runs and stopped == ["taken"]
        assert (runs.stats.fenced, runs.stats.lease_losses, runs.stats.data_lost) == (1, 1, 0)
        await runs.apply([RequestOutput("taken", [2], "b", completion_tokens=2, finish=EngineFinish.STOP)])
        assert await runs.fail(taken, ErrorCode.INTERNAL, "late") is State.FENCED
        await runs.lose([taken])  # the lease keeper finds it too: nothing more to stop
        assert not runs.admit(taken, None, None)
        assert await logged(r, "taken") == [] and runs.stats.lease_losses == 1

        kept = await running_job(r, "kept")  # its lease is gone while it runs: the lease keeper's verdict
        assert runs.admit(kept, None, None)
        await asyncio.gather(runs.lose([kept]), runs.lose([kept]))
        await runs.apply([RequestOutput("kept", [3], "c", completion_tokens=1)])
        assert kept.state is State.FENCED and runs.stats.lease_losses == 2 and stopped == ["taken", "kept"]
        assert await logged(r, "kept") == []  # the LOST write is refused: Redis still has the job's data
    finally:
        await r.aclose()


async def test_a_cancel_ends_its_job_after_the_outputs_queued_before_it(redis_url: str) -> None:
    # The table queues a cancel in order with the engine's outputs: what was queued before it is written first,
    # what the step in flight makes after it is dropped, and an end the engine reported first stands. One EMIT
    # call for the batch.
    r = aredis.Redis.from_url(redis_url)
    stopped: list[str] = []
    try:
        runs = table(r, stopped)
        jobs = [await running_job(r, rid) for rid in ("a", "b", "c")]
        assert all(runs.admit(job, None, None) for job in jobs)
        runs.feed([RequestOutput("a", [1], "x", completion_tokens=1),
                   RequestOutput("b", [1], "y", completion_tokens=1, finish=EngineFinish.LENGTH)])
        for rid in ("a", "b", "c", "a"):
            runs.cancel(rid)
        runs.feed([RequestOutput("a", [2], "late", completion_tokens=2),
                   RequestOutput("c", [5], "late", completion_tokens=1)])
        publishing = asyncio.create_task(runs.publish())
        try:
            states = await asyncio.gather(*(asyncio.shield(job.finished) for job in jobs))
        finally:
            publishing.cancel()
        assert states == [State.ENDED] * 3 and stopped == ["a", "b", "c", "a"]
        a, b, c = [[ev for _, ev in await logged(r, rid)] for rid in ("a", "b", "c")]
        assert [ev.type for ev in a] == ["token", "done"] and isinstance(a[0], TokenEvent) and a[0].text == "x"
        assert isinstance(a[1], DoneEvent) and a[1].finish_reason is FinishReason.CANCELLED
        assert a[1].usage.completion_tokens == 1
        assert isinstance(b[1], DoneEvent) and b[1].finish_reason is FinishReason.LENGTH
        assert len(c) == 1 and isinstance(c[0], DoneEvent) and c[0].finish_reason is FinishReason.CANCELLED
        assert c[0].usage.completion_tokens == 0
        assert (runs.stats.writes, runs.stats.other_writes) == (1, 0)
    finally:
        await r.aclose()
