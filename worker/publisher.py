"""Publishes job events to Redis: live on each job's pub/sub channel and into its replay log.

Engine outputs arrive from the MLX thread (via ``loop.call_soon_threadsafe``) and queue up while a write
is in flight; each write sends every queued event of every job in one fenced EMIT script call, so Redis
sees at most one round trip per engine step whatever the batch size, and the next step never waits for
Redis. A job whose lease is gone is fenced: its events are refused and it is handed to ``on_fenced``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring  # type: ignore[attr-defined]  # the C string escaper
from typing import Any

from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.connection import JOB_FUNCTION
from api.keys import DONE_TTL_S, LIVE_TTL_S, Keys
from api.schema import TERMINAL_TYPES, Event
from engine.request import FinishReason, RequestOutput, coalesce

from .job import Job
from .scripts import EMIT, Script
from .translate import TokenLine, Wire, output_events

__all__ = ["Batch", "LogTTL", "Publisher", "arq_result", "emit_args"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PublisherStats:
    """Counters for benchmarks and metrics."""

    writes: int = 0  # EMIT calls (Redis round trips) carrying engine step outputs
    other_writes: int = 0  # EMIT calls for single jobs: cancels, resets, rejections
    events: int = 0
    fenced: int = 0  # jobs whose events were refused (lease lost)


@dataclass(frozen=True, slots=True)
class LogTTL:
    """Replay-log TTLs, and how long arq's result key of an ended job is kept (0: none is written); seconds."""

    live: int = LIVE_TTL_S
    done: int = DONE_TTL_S
    result: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """Events of one job for an EMIT call; ``mode`` as the script defines it."""

    rid: str
    token: str
    events: Sequence[Wire]
    mode: str
    result: bytes = b""  # with mode "end": arq's result value for the job


def emit_args(keys: Keys, batches: Sequence[Batch], ttl: LogTTL, queue: str) -> tuple[list[str], list[Any]]:
    """Keys and arguments of one fenced EMIT call writing every batch (``queue``: the jobs' arq queue)."""
    args: list[Any] = [len(batches), ttl.live, ttl.done, queue, int(time.time() * 1000), in_progress_key_prefix,
                       keys.prefix, job_key_prefix, retry_key_prefix, result_key_prefix, max(1, ttl.result) * 1000]
    args.append(b"".join(b"%d\n%s" % (len(r), r) for r in map(_record, batches)))
    return [keys.running()], args


def _record(b: Batch) -> bytes:
    """One job's part of an EMIT call: ``<rid bytes> <token bytes> <mode> <first seq> <result bytes>``, then
    rid, token and result, then the events."""
    rid, token = b.rid.encode(), b.token.encode()
    head = b"%d %d %s %d %d\n" % (len(rid), len(token), b.mode.encode(), b.events[0].seq if b.events else 0,
                                  len(b.result))
    events = "\n".join(ev.model_dump_json() for ev in b.events).encode()
    return b"".join((head, rid, token, b.result, b"\n", events))


def arq_result(job: Job, end: Event, queue: str) -> bytes:
    """arq's result record for a job that ended with ``end`` (what ``arq.jobs.Job.result()`` reads), without
    the job's arguments: arq would keep the whole prompt again for the result TTL.

    Written around the event's own JSON: a dict dumped with ``json`` cost three times as much (15 us a job).
    """
    ok = "true" if end.type == "done" else "false"
    return (f'{{"t":{job.attempt},"f":{encode_basestring(JOB_FUNCTION)},"a":[],"k":{{}},'
            f'"et":{int(job.enqueue_time * 1000)},"s":{ok},"r":{end.model_dump_json()},'
            f'"st":{int(job.started_at * 1000)},"ft":{int(time.time() * 1000)},'
            f'"q":{encode_basestring(queue)},"id":{encode_basestring(job.rid)}}}').encode()


class Publisher:
    """Turns engine outputs into events and writes them, one EMIT call per batch of outputs."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, jobs: dict[str, Job],
                 ttl: LogTTL | None = None, give_up_s: float = 10.0, queue: str = "") -> None:
        self.redis = redis
        self.queue = queue  # this worker's arq queue: where released jobs go back
        self.keys = keys
        self.worker_id = worker_id
        self.jobs = jobs
        self.ttl = ttl or LogTTL()
        self.stats = PublisherStats()
        self.on_fenced: Callable[[Job], None] = lambda job: None
        self._give_up_s = give_up_s  # past the lease TTL, other workers own these jobs anyway
        self._script: Script | None = None
        self._pending: list[RequestOutput] = []
        self._cancels = 0  # of _pending, synthetic cancel ends
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one write at a time keeps every job's events in seq order

    async def start(self) -> None:
        self._script = await Script.load(self.redis, EMIT)

    def feed(self, outs: Sequence[RequestOutput]) -> None:
        """Queue engine outputs (call on the event loop thread)."""
        self._pending.extend(outs)
        self._wake.set()

    def feed_cancel(self, rid: str) -> None:
        """Queue a job's cancelled end, in order with its engine outputs."""
        self._pending.append(RequestOutput(rid, finish=FinishReason.CANCELLED))
        self._cancels += 1
        self._wake.set()

    async def run(self) -> None:
        """Write queued outputs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            only_cancels, self._cancels = len(batch) == self._cancels, 0
            await self.write(self._events_of(coalesce(batch)), step=not only_cancels)

    async def finish(self, job: Job) -> None:
        """End ``job``'s arq job and drop its lease without an event: an earlier run published its end."""
        async with self._lock:
            await self._send([Batch(job.rid, job.token, [], "end")])
        self.stats.other_writes += 1

    def _events_of(self, outs: list[RequestOutput]) -> list[tuple[Job, Wire]]:
        items: list[tuple[Job, Wire]] = []
        for out in outs:
            job = self.jobs.get(out.rid)
            if job is None:  # detached (re-queued, fenced) or already ended
                continue
            items.extend((job, ev) for ev in output_events(out, job, self.worker_id))
        return items

    async def write(self, items: Sequence[tuple[Job, Wire]], mode: str | None = None, step: bool = False) -> None:
        """Write events (grouped per job, in order), then release the jobs they end.

        ``mode`` overrides the per-job mode ("release" when handing a job back to the queue).
        """
        if not items:
            return
        groups: dict[str, tuple[Job, list[Wire]]] = {}
        for job, ev in items:
            groups.setdefault(job.rid, (job, []))[1].append(ev)
        batches = [self._batch(job, events, mode) for job, events in groups.values()]
        for b in batches:
            if b.mode:  # the write drops the lease: the lease keeper must not take that for a lost lease
                self.jobs.pop(b.rid, None)
        async with self._lock:
            written = await self._send(batches)
        if step:
            self.stats.writes += 1
        else:
            self.stats.other_writes += 1
        for (job, events), b, ok in zip(groups.values(), batches, written):
            if not ok:
                self._fence(job)
            elif b.mode:
                self._settle(job, events[-1].type)

    def _batch(self, job: Job, events: list[Wire], mode: str | None) -> Batch:
        end = events[-1]  # a job's terminal event is its last (engine.request.coalesce drops any after it)
        if mode is None and not isinstance(end, TokenLine) and end.type in TERMINAL_TYPES:
            result = arq_result(job, end, self.queue) if self.ttl.result > 0 else b""
            return Batch(job.rid, job.token, events, "end", result)
        return Batch(job.rid, job.token, events, mode or "")

    def _settle(self, job: Job, outcome: str) -> None:
        self.jobs.pop(job.rid, None)
        if not job.finished.done():
            job.finished.set_result(outcome)

    def _fence(self, job: Job) -> None:
        self.stats.fenced += 1
        log.warning("job %s: lease lost, its events are fenced off", job.rid)
        self.on_fenced(job)

    async def _send(self, batches: list[Batch]) -> list[bool]:
        assert self._script is not None, "Publisher.start() was not awaited"
        deadline = time.monotonic() + self._give_up_s
        attempt = 0
        while True:
            try:
                result = await self._script.run(self.redis, *emit_args(self.keys, batches, self.ttl, self.queue))
                self.stats.events += sum(len(b.events) for b in batches)
                return [r == 1 for r in result]
            except (RedisError, OSError) as exc:
                attempt += 1
                if time.monotonic() > deadline:
                    log.error("Redis unreachable for %.0fs: fencing %d jobs", self._give_up_s, len(batches))
                    return [False] * len(batches)
                log.warning("event write failed (attempt %d): %r", attempt, exc)
                await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
