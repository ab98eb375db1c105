"""Publishes job events to Redis: live on each job's pub/sub channel and into its replay log.

Engine outputs arrive from the MLX thread (via ``loop.call_soon_threadsafe``) and queue up while a write
is in flight; each write sends every queued event of every job in one pipeline, so Redis sees at most one
round trip per engine step whatever the batch size, and the next step never waits for Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from api.keys import DONE_TTL_S, LIVE_TTL_S, Keys, log_entry_id
from api.schema import Event, is_terminal
from engine.request import RequestOutput

from .job import Job
from .translate import output_events

__all__ = ["Publisher"]

log = logging.getLogger(__name__)
_WRITE_ATTEMPTS = 8


@dataclass(slots=True)
class PublisherStats:
    """Counters for benchmarks and metrics."""

    writes: int = 0  # pipelines sent (Redis round trips)
    events: int = 0
    dropped: int = 0  # events lost after Redis stayed unreachable


class Publisher:
    """Turns engine outputs into events and writes them, one pipeline per batch of outputs."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, jobs: dict[str, Job]) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.jobs = jobs
        self.stats = PublisherStats()
        self._pending: list[RequestOutput] = []
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one write at a time keeps every job's events in seq order

    def feed(self, outs: Sequence[RequestOutput]) -> None:
        """Queue engine outputs (call on the event loop thread)."""
        self._pending.extend(outs)
        self._wake.set()

    async def run(self) -> None:
        """Write queued outputs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            await self.write(self._events_of(batch))

    def _events_of(self, outs: list[RequestOutput]) -> list[tuple[Job, Event]]:
        items: list[tuple[Job, Event]] = []
        for out in outs:
            job = self.jobs.get(out.rid)
            if job is None:  # detached (re-queued on shutdown) or already ended
                continue
            items.extend((job, ev) for ev in output_events(out, job, self.worker_id))
        return items

    async def write(self, items: list[tuple[Job, Event]]) -> None:
        """Write events in one pipeline, then release the jobs they end."""
        if not items:
            return
        async with self._lock:
            await self._send(items)
        for job, ev in items:
            if is_terminal(ev):
                self.jobs.pop(job.rid, None)
                if not job.finished.done():
                    job.finished.set_result(ev.type)

    async def _send(self, items: list[tuple[Job, Event]]) -> None:
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                await self._pipeline(items).execute(raise_on_error=False)
                self.stats.writes += 1
                self.stats.events += len(items)
                return
            except (RedisError, OSError) as exc:
                log.warning("event write failed (attempt %d): %r", attempt + 1, exc)
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
        self.stats.dropped += len(items)
        log.error("dropped %d events: Redis unreachable", len(items))

    def _pipeline(self, items: list[tuple[Job, Event]]) -> Pipeline:
        pipe = self.redis.pipeline(transaction=False)
        for job, ev in items:
            data = ev.model_dump_json()
            log_key = self.keys.log(job.rid)
            pipe.publish(self.keys.events(job.rid), data)
            pipe.xadd(log_key, {"e": data}, id=log_entry_id(ev.seq))
            pipe.expire(log_key, DONE_TTL_S if is_terminal(ev) else LIVE_TTL_S)
            if is_terminal(ev):
                pipe.delete(self.keys.cancel(job.rid))
        return pipe
