"""Writes a worker's job events: engine outputs of every job in one EMIT call per batch (worker/lifecycle.py).

Engine outputs arrive from the MLX thread (via ``loop.call_soon_threadsafe``) and queue up while a write is
in flight; each write carries every queued event of every job, so Redis sees at most one round trip per
engine step whatever the batch size, and the next step never waits for Redis. Writes are serial, so every
job's events reach Redis in seq order. A run whose write is refused has lost its lease: it is handed to
``on_fenced`` and writes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from mlxq.api.schema import TERMINAL_TYPES
from mlxq.engine.request import FinishReason, RequestOutput, coalesce

from .lifecycle import Lifecycle, Record, Run, State, Wire, Write
from .translate import output_events

__all__ = ["Publisher", "PublisherStats"]

log = logging.getLogger(__name__)

_SETTLED = {Write.END: State.ENDED, Write.LOST: State.ENDED, Write.HAND_BACK: State.HANDED_BACK}


@dataclass(slots=True)
class PublisherStats:
    """Counters for benchmarks and metrics."""

    writes: int = 0  # EMIT calls (Redis round trips) carrying engine step outputs
    other_writes: int = 0  # EMIT calls for single jobs: cancels, resets, rejections
    events: int = 0
    tokens: int = 0  # tokens generated (sent in token events)
    tokens_by_model: dict[str, int] = field(default_factory=dict)
    fenced: int = 0  # runs whose writes were refused (lease lost)


async def _nothing(runs: list[Run]) -> None:
    return None


def _ignore(*args: object) -> None:
    return None


class Publisher:
    """Turns engine outputs into events and writes them, one EMIT call per batch of outputs."""

    def __init__(self, lifecycle: Lifecycle, runs: dict[str, Run], worker_id: str, give_up_s: float = 10.0) -> None:
        self.lifecycle = lifecycle
        self.runs = runs  # the runs in the engine, by job id
        self.worker_id = worker_id
        self.stats = PublisherStats()
        self.on_fenced: Callable[[list[Run]], Awaitable[None]] = _nothing
        self.on_ended: Callable[[Run, Wire], None] = _ignore  # a run's terminal event was written
        self.on_write: Callable[[float], None] = _ignore  # seconds one EMIT call took
        self._give_up_s = give_up_s  # past the lease TTL, other workers own these jobs anyway
        self._pending: list[RequestOutput] = []
        self._cancels = 0  # of _pending, synthetic cancel ends
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one write at a time keeps every job's events in seq order

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

    def _events_of(self, outs: list[RequestOutput]) -> list[tuple[Run, Wire]]:
        items: list[tuple[Run, Wire]] = []
        for out in outs:
            run = self.runs.get(out.rid)
            if run is None:  # handed back, fenced or already ended
                continue
            if out.token_ids:
                n = len(out.token_ids)
                self.stats.tokens += n
                by_model = self.stats.tokens_by_model
                by_model[run.model] = by_model.get(run.model, 0) + n
            items.extend((run, ev) for ev in output_events(out, run, self.worker_id))
        return items

    async def write(self, items: Sequence[tuple[Run, Wire]], write: Write | None = None, step: bool = False) -> None:
        """Write events (grouped per job, in order) and settle the runs they end or hand back.

        ``write`` overrides the per-job write, which is END after a terminal event and APPEND otherwise.
        """
        if not items:
            return
        groups: dict[str, tuple[Run, list[Wire]]] = {}
        for run, ev in items:
            groups.setdefault(run.rid, (run, []))[1].append(ev)
        records = [Record(run, events, write or _write_of(events[-1])) for run, events in groups.values()]
        for r in records:
            if r.write is not Write.APPEND:  # its write drops the lease: the lease keeper must not see it go
                self.runs.pop(r.run.rid, None)
        async with self._lock:
            allowed = await self._send(records)
        if step:
            self.stats.writes += 1
        else:
            self.stats.other_writes += 1
        fenced = [r.run for r, ok in zip(records, allowed) if not ok and r.write is not Write.LOST]
        for r, ok in zip(records, allowed):
            if ok and r.write is not Write.APPEND:
                r.run.settle(_SETTLED[r.write])
                if r.write is not Write.HAND_BACK and r.events:
                    self.on_ended(r.run, r.events[-1])
            elif not ok and r.write is Write.LOST:
                r.run.settle(State.FENCED)
        if fenced:
            self.stats.fenced += len(fenced)
            await self.on_fenced(fenced)

    async def _send(self, records: list[Record]) -> list[bool]:
        deadline = time.monotonic() + self._give_up_s
        attempt = 0
        while True:
            try:
                t0 = time.perf_counter()
                allowed = await self.lifecycle.write(records)
                self.on_write(time.perf_counter() - t0)
                self.stats.events += sum(len(r.events) for r in records)
                return allowed
            except (RedisError, OSError) as exc:
                attempt += 1
                if time.monotonic() > deadline:
                    log.error("Redis unreachable for %.0fs: fencing %d jobs", self._give_up_s, len(records))
                    return [False] * len(records)
                log.warning("event write failed (attempt %d): %r", attempt, exc)
                await asyncio.sleep(min(1.0, 0.05 * 2**attempt))


def _write_of(last: Wire) -> Write:
    return Write.END if last.type in TERMINAL_TYPES else Write.APPEND
