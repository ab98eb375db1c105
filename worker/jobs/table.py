"""A worker's runs, by job id: the one place that changes a run, decides each job's terminal event and writes.

Every move of a job a run of this worker holds is a verb of the :class:`RunTable`: an engine output's events
(``apply``), a client's cancel (``cancel``), an interrupt (shutdown or arq's timeout), a lost lease, a job
refused or failed before its engine, and the reaper's reaps and expiries. Each verb builds its events with the
job's :class:`~.run.Run` and writes them through the transitions (worker/jobs/transitions.py), one EMIT call at
a time. A run's sequence is dropped from its engine through its model's service, which the table is handed.

Engine outputs arrive from the MLX threads (``feed``, via ``loop.call_soon_threadsafe``) and queue up while a
write is in flight; :meth:`RunTable.publish` hands each batch to ``apply``: every queued output of every job,
coalesced to one per job, so Redis sees at most one round trip (one EMIT call) per engine step whatever the
batch size, and the next step never waits for Redis. A cancel is queued in order with the outputs: it comes
back with the batch, after the job's outputs queued before it; the job's outputs queued after it are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from mlxq.api.protocol.emit import Write
from mlxq.api.protocol.upkeep import Lapsed, Lost
from mlxq.api.schema import TERMINAL_TYPES, ErrorCode, FinishReason
from mlxq.engine.core.request import RequestOutput, coalesce

from .run import Run, State, Wire
from .transitions import Record, Transitions

if TYPE_CHECKING:
    from ..service import ModelService
    from .toolcalls import ToolCalls

__all__ = ["Outputs", "RunStats", "RunTable"]

log = logging.getLogger(__name__)

_SETTLED = {Write.END: State.ENDED, Write.LOST: State.ENDED, Write.HAND_BACK: State.HANDED_BACK}
_LIVE = (State.RUNNING, State.CLOSING)  # states of a run whose lease may still be its own
_DATA_LOST = "Redis lost this job's data while it ran (restarted without persistence, or flushed); submit it again"

Outputs = Callable[[RequestOutput, Run, str], list[Wire]]  # an engine output's events (translate.output_events)


@dataclass(slots=True)
class RunStats:
    """What a worker's runs wrote and how they left, for benchmarks and metrics."""

    writes: int = 0  # EMIT calls (Redis round trips) carrying engine step outputs
    other_writes: int = 0  # EMIT calls for single jobs: cancels, resets, rejections
    events: int = 0
    tokens: int = 0  # tokens generated (sent in token events)
    tokens_by_model: dict[str, int] = field(default_factory=dict)
    fenced: int = 0  # runs whose writes were refused (lease lost)
    lease_losses: int = 0  # runs stopped because their lease was gone, however that was found
    data_lost: int = 0  # runs ended with error(data_lost): Redis lost the job while it ran
    handed_back: int = 0  # runs handed back to their queue (shutdown)


def _ignore(*args: object) -> None:
    return None


class RunTable(Mapping[str, Run]):
    """A worker's runs in its engines, by job id; the one place that changes a run, ends a job or writes.

    It reads as a mapping; only its verbs change it. A verb that ends a job or hands it back takes the run out
    of the table and marks it ``CLOSING`` before its first await, so a second verb, or an engine output that
    arrives later, finds it gone and writes nothing: this worker gives a job one terminal event at most. A
    fenced run writes nothing more. EMIT calls go out one at a time, in the order the verbs made them, so each
    job's events reach Redis in seq order.
    """

    def __init__(self, transitions: Transitions, outputs: Outputs, services: Mapping[str, ModelService],
                 give_up_s: float = 10.0) -> None:
        self.transitions = transitions
        self.stats = RunStats()
        self.on_ended: Callable[[Run, Wire], None] = _ignore  # a run's terminal event was written
        self.on_write: Callable[[float], None] = _ignore  # seconds one EMIT call took
        self._outputs = outputs  # injected: translating engine outputs loads the engine (MLX)
        self._services = services  # by model name: a run's sequence is dropped from its model's engine
        self._give_up_s = give_up_s  # past the lease TTL, other workers own these jobs anyway
        self._runs: dict[str, Run] = {}
        self._lock = asyncio.Lock()  # one EMIT call at a time keeps every job's events in seq order
        self._pending: list[RequestOutput] = []  # engine outputs queued for the next batch
        self._cancels: dict[str, int] = {}  # job id -> how many of _pending were queued before its cancel
        self._wake = asyncio.Event()

    def __getitem__(self, rid: str) -> Run:
        return self._runs[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._runs

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    # --- a run in an engine --------------------------------------------------------------------------
    def admit(self, run: Run, token_text: Callable[[int], str] | None, tools: ToolCalls | None) -> bool:
        """The run's request enters its engine (the caller adds it next); False if the run left already."""
        if run.state is not State.RUNNING:
            return False
        run.token_text, run.tools = token_text, tools
        self._runs[run.rid] = run
        return True

    def feed(self, outs: Sequence[RequestOutput]) -> None:
        """Queue engine outputs for the next batch (call on the event loop thread)."""
        self._pending.extend(outs)
        self._wake.set()

    async def publish(self) -> None:
        """Hand queued outputs and cancels to :meth:`apply`, a batch at a time, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, cancels = self._pending, self._cancels
            self._pending, self._cancels = [], {}
            outs = [out for i, out in enumerate(batch) if i < cancels.get(out.rid, i + 1)] if cancels else batch
            await self.apply(coalesce(outs), list(cancels), bool(batch))

    async def apply(self, outs: Sequence[RequestOutput], cancelled: Collection[str] = (), step: bool = True) -> None:
        """Engine outputs (one per job: ``engine.request.coalesce``) as their runs' events, then the end of each
        job in ``cancelled`` (see :meth:`cancel`), in one EMIT call; the output or cancel of a run no longer here
        (ended, handed back, fenced) is dropped."""
        groups: dict[str, tuple[Run, list[Wire]]] = {}
        runs, outputs, worker = self._runs, self._outputs, self.transitions.worker_id
        for out in outs:
            run = runs.get(out.rid)
            if run is None:
                continue
            if out.token_ids:
                self._count(run, len(out.token_ids))
            events = outputs(out, run, worker)
            if not events:
                continue
            group = groups.get(run.rid)
            if group is None:
                groups[run.rid] = (run, events)
            else:
                group[1].extend(events)
        if cancelled:
            self._end_cancelled(cancelled, outs, groups)
        await self._write_groups(groups, step=step)

    def cancel(self, rid: str) -> None:
        """A client cancelled: drop the job's sequence from its engine now, and end it ``done(cancelled)``
        after the outputs already queued for it, without waiting for the step in flight (the engine's own end
        then finds the run gone). The cancel is queued in order with the engine's outputs, and :meth:`publish`
        brings it back to :meth:`apply` with its batch."""
        run = self._runs.get(rid)
        if run is not None:
            self._stop(run)
            self._cancels.setdefault(rid, len(self._pending))
            self._wake.set()

    def _end_cancelled(self, cancelled: Collection[str], outs: Sequence[RequestOutput],
                       groups: dict[str, tuple[Run, list[Wire]]]) -> None:
        """Each cancelled job's ``done(cancelled)``, after the events of its outputs queued before the cancel;
        an end its engine reported first stands."""
        generated = {out.rid: out.completion_tokens for out in outs}
        for rid in cancelled:
            run = self._runs.get(rid)
            if run is None:
                continue
            group = groups.get(rid)
            if group is None:
                groups[rid] = (run, [run.done(FinishReason.CANCELLED, generated=generated.get(rid, 0))])
            elif group[1][-1].type not in TERMINAL_TYPES:
                group[1].append(run.done(FinishReason.CANCELLED, generated=generated.get(rid, 0)))

    async def interrupt(self, run: Run, max_tries: int) -> None:
        """Shutdown or arq's timeout cancelled the run: hand the job back, or end it on its last try."""
        self._stop(run)
        if self._runs.get(run.rid) is not run:
            return  # it ended (or was fenced) meanwhile
        if run.attempt >= max_tries:
            msg = f"the job was interrupted on its last try ({run.attempt}/{max_tries})"
            await self._write([(run, run.error(ErrorCode.WORKER_LOST, msg))])
            return
        await self._write([(run, run.reset("worker shutting down; job re-queued"))], Write.HAND_BACK)
        self.stats.handed_back += 1
        log.info("job %s: interrupted; handed back to the queue", run.rid)

    async def lose(self, runs: Sequence[Run]) -> None:
        """Runs whose lease is gone, as the lease keeper found: fence them (a run whose end or hand-back is
        being written is left to that write's answer)."""
        await self._fence([run for run in runs if run.state is State.RUNNING])

    # --- a run before its engine ---------------------------------------------------------------------
    async def restart(self, run: Run) -> State:
        """Its last run left no reset (a partial loss of Redis' data): announce this run with one. RUNNING if
        it may go on, else how it left (fenced, or ended with data_lost)."""
        await self._write([(run, run.reset("job restarted"))])
        return run.state if run.state is State.RUNNING else await asyncio.shield(run.finished)

    async def finish(self, run: Run) -> State:
        """An earlier run ended the job, yet it is queued (only a partial loss of Redis' data): end it with no
        event; refused, the run is fenced and writes nothing."""
        self._close(run)
        (ok,) = await self._send([Record(run, [], Write.END)])
        run.settle(State.ENDED if ok else State.FENCED)
        return run.state

    async def end_cancelled(self, run: Run) -> State:
        """A cancel waited for the job when it started: end it ``done(cancelled)``."""
        return await self._end(run, lambda: run.done(FinishReason.CANCELLED))

    async def reject(self, run: Run, message: str) -> State:
        """The job's request is invalid: end it ``error(bad_request)``."""
        return await self._end(run, lambda: run.error(ErrorCode.BAD_REQUEST, message))

    async def fail(self, run: Run, code: ErrorCode, message: str) -> State:
        """The worker cannot run the job (no tries left, its engine dead, a bug): end it ``error(code)``."""
        if self._runs.get(run.rid) is run:  # a bug struck after it entered its engine
            self._stop(run)
        return await self._end(run, lambda: run.error(code, message))

    async def _end(self, run: Run, end: Callable[[], Wire]) -> State:
        """End the job with the event ``end`` builds, unless a verb ended, handed back or fenced its run
        already; how the run left."""
        if run.state is State.RUNNING:
            await self._write([(run, end())])
        return await asyncio.shield(run.finished)

    # --- jobs no run of this worker owns: the reaper's ---------------------------------------------------
    async def reap(self, lost: Lost, max_tries: int) -> bool:
        """A running job whose lease expired (its worker died or froze): hand it back while tries remain, else
        end it; whether this call did (another reaper, or its run coming back, may have first)."""
        record, what = _reaped(self.transitions.orphan(lost), lost, max_tries)
        (ok,) = await self._emit([record])
        if ok:
            log.info("job %s: its worker was lost; %s", lost.rid, what)
        return ok

    async def expire(self, lapsed: Sequence[Lapsed]) -> list[Lapsed]:
        """End queued jobs whose expiry passed, ``error(expired)`` (``done(cancelled)`` if a cancel waits for
        one); those this call ended (a worker that started one meanwhile wins)."""
        if not lapsed:
            return []
        records = [_expired(self.transitions.expiring(job), job) for job in lapsed]
        ended = [job for job, ok in zip(lapsed, await self._emit(records)) if ok]
        for job in ended:
            log.info("job %s: still queued on %s when it expired; ended", job.rid, job.queue)
        return ended

    # --- how the verbs change runs and write ------------------------------------------------------------
    def _stop(self, run: Run) -> None:
        """Drop the run's sequence from its engine (between steps; an id the engine lacks is ignored)."""
        self._services[run.model].abort(run.rid)

    def _close(self, run: Run) -> None:
        """The run's end or hand-back is decided: no other verb, nor a later engine output, writes for it."""
        self._runs.pop(run.rid, None)
        if run.state is State.RUNNING:
            run.state = State.CLOSING

    async def _fence(self, runs: Sequence[Run]) -> None:
        """Stop runs whose lease is gone. Each writes nothing more, unless Redis lost the job's data, when
        nobody else could end it: then it ends with ``error(data_lost)`` (the LOST write checks that)."""
        runs = [run for run in runs if run.state in _LIVE]  # the lease keeper and a refused write may both see it
        self.stats.lease_losses += len(runs)
        for run in runs:
            run.state = State.FENCED  # until the LOST write says otherwise
            self._runs.pop(run.rid, None)
            self._stop(run)
        await self._write([(run, run.error(ErrorCode.DATA_LOST, _DATA_LOST)) for run in runs], Write.LOST)
        for run in runs:
            if run.state is State.ENDED:
                self.stats.data_lost += 1
                log.warning("job %s: Redis lost its data while it ran; ended with error(data_lost)", run.rid)
            else:
                log.warning("job %s: fenced: its lease is gone (another run or the reaper owns the job); "
                            "this run writes nothing more", run.rid)

    async def _write(self, items: Sequence[tuple[Run, Wire]], write: Write | None = None, step: bool = False
                     ) -> None:
        """Write events (grouped per job, in order) and settle the runs they end or hand back; ``write``
        overrides each job's own (END after a terminal event, else APPEND). A refused run is fenced."""
        groups: dict[str, tuple[Run, list[Wire]]] = {}
        for run, ev in items:
            groups.setdefault(run.rid, (run, []))[1].append(ev)
        await self._write_groups(groups, write, step)

    async def _write_groups(self, groups: dict[str, tuple[Run, list[Wire]]], write: Write | None = None,
                            step: bool = False) -> None:
        """:meth:`_write` of events already grouped per job (each job's in order)."""
        if not groups:
            return
        records = [Record(run, events, write or _write_of(events[-1])) for run, events in groups.values()]
        for r in records:
            if r.write is not Write.APPEND:  # its write drops the lease: the lease keeper must not see it go
                self._close(r.run)
        allowed = await self._send(records)
        if step:
            self.stats.writes += 1
        else:
            self.stats.other_writes += 1
        self._settle(records, allowed)
        fenced = [r.run for r, ok in zip(records, allowed) if not ok and r.write is not Write.LOST]
        if fenced:
            self.stats.fenced += len(fenced)
            await self._fence(fenced)

    def _settle(self, records: Sequence[Record], allowed: Sequence[bool]) -> None:
        for r, ok in zip(records, allowed):
            if ok and r.write is not Write.APPEND:
                r.run.settle(_SETTLED[r.write])
                if r.write is not Write.HAND_BACK and r.events:
                    self.on_ended(r.run, r.events[-1])
            elif not ok and r.write is Write.LOST:
                r.run.settle(State.FENCED)

    async def _send(self, records: list[Record]) -> list[bool]:
        """One EMIT call, retried while Redis is unreachable; past ``give_up_s`` every record counts refused."""
        deadline = time.monotonic() + self._give_up_s
        attempt = 0
        async with self._lock:
            while True:
                try:
                    t0 = time.perf_counter()
                    allowed = await self.transitions.write(records)
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

    async def _emit(self, records: list[Record]) -> list[bool]:
        """One EMIT call for jobs no run owns, in turn with the runs' writes; Redis' errors go to the caller."""
        async with self._lock:
            return await self.transitions.write(records)

    def _count(self, run: Run, tokens: int) -> None:
        if tokens:
            self.stats.tokens += tokens
            self.stats.tokens_by_model[run.model] = self.stats.tokens_by_model.get(run.model, 0) + tokens


def _write_of(last: Wire) -> Write:
    return Write.END if last.type in TERMINAL_TYPES else Write.APPEND


def _reaped(run: Run, lost: Lost, max_tries: int) -> tuple[Record, str]:
    """A lost job's reset while tries remain, else its end; and what that does, for the log."""
    if lost.tries < max_tries and lost.has_record:
        return Record(run, [run.reset("worker lost; job re-queued")], Write.HAND_BACK), "re-queued"
    if lost.has_record:
        msg = f"the worker running this job was lost (try {lost.tries} of {max_tries})"
        return Record(run, [run.error(ErrorCode.WORKER_LOST, msg)], Write.END), "failed on its last try"
    msg = "the worker running this job was lost, and the job's record is gone from Redis: it cannot run again"
    return Record(run, [run.error(ErrorCode.DATA_LOST, msg)], Write.END), "failed (its record is gone)"


def _expired(run: Run, job: Lapsed) -> Record:
    if job.cancelled:
        return Record(run, [run.done(FinishReason.CANCELLED)], Write.EXPIRE)
    waited = f" {time.time() - job.enqueue_ms / 1000:.0f}s" if job.enqueue_ms else ""
    msg = f"no worker took the job before it expired (it waited{waited} on {job.queue}); see `mlxq status`"
    return Record(run, [run.error(ErrorCode.EXPIRED, msg)], Write.EXPIRE)
