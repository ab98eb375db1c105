"""A job's transitions, as the worker makes them: each one atomic Redis call of the protocol (api/protocol/: the
scripts and their typed calls), made here for this worker's runs.

    queued ──claim──▶ running ──end──▶ ended    (exactly one terminal event: done or error)
      ▲ │                │                 ▲
      │ └───lapse────────┼─────────────────┘    (expired while queued: error(expired))
      └───hand back──────┘                      (a reset event: shutdown, or the reaper after a worker died)

- **claim** (CLAIM, ``api.protocol.claim``): a worker claims due jobs of its queues in one call.
- **append / end / hand back** (EMIT, ``api.protocol.emit``): a run's events, one call per engine step for all the
  worker's jobs; the terminal event's call also ends the job, a reset's hands it back to its queue.
- **refresh**, **reap**, **lapse**, **reject** (``api.protocol.upkeep``).
- **lost data** (EMIT, write ``LOST``): Redis lost its data under a running job (the epoch changed, the record is
  gone): the run ends it ``error(data_lost)``, retryable, instead of leaving its followers waiting.

Each script checks in Redis that its caller may make the move: a run only while the job's lease holds that
run's token, the reaper only while nobody holds it and the job's log is where the reaper read it. A run that
lost its lease (paused, partitioned, reaped, or its job finished elsewhere) can therefore change nothing about
the job, whenever it wakes up. :class:`Transitions` changes no run: the run table (worker/jobs/table.py)
decides each job's moves and sends its EMIT calls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from mlxq.api.protocol import claim, emit, upkeep
from mlxq.api.protocol.claim import EPOCH_TTL_S, BelowShare, Due, DueEntry, Outranking
from mlxq.api.protocol.emit import LogTTL, Write, emit_record
from mlxq.api.protocol.jobrecord import result_record
from mlxq.api.protocol.keys import Keys, log_entry_id
from mlxq.api.protocol.upkeep import Lapsed, Lost

from .run import Run, Wire

__all__ = ["Record", "Transitions"]

# A run's token appends set its log's TTL (LogTTL.live) this many times a TTL, not on every append
_LOG_TTL_REFRESHES = 10


@dataclass(frozen=True, slots=True)
class Record:
    """One job's events for an EMIT call, and what the call does with the job."""

    run: Run
    events: Sequence[Wire]
    write: Write


class Transitions:
    """The transitions of a worker's jobs (of any of its queues), as typed calls of their scripts."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, ttl: LogTTL, lease_ttl_s: float,
                 writer: Redis | None = None, affinity_wait_ms: int = -1) -> None:
        self.redis = redis
        self.writer = writer or redis  # EMIT calls' connection
        self.keys = keys
        self.worker_id = worker_id
        self.ttl = ttl
        self.lease_ms = int(lease_ttl_s * 1000)
        self.affinity_wait_ms = affinity_wait_ms  # how long a job waits for the live worker with its prefix warm

    async def open(self) -> None:
        """Set the deployment's epoch unless Redis has one (a fresh or emptied server); CLAIM keeps it."""
        await self.redis.set(self.keys.epoch(), uuid.uuid4().hex, nx=True, ex=EPOCH_TTL_S)

    async def claim(self, quotas: dict[str, int], most: int, outranking: dict[str, Outranking] | None = None,
                    below_share: dict[str, BelowShare] | None = None) -> Due:
        """Claim up to ``most`` due jobs, lowest score first across the queues, each queue up to its quota;
        from a queue in ``outranking``, only jobs of at least its priority (up to its quota); from a queue in
        ``below_share``, jobs of the tenants below their share in its full engine (and the others' by priority,
        if it is in ``outranking`` too)."""
        return await claim.claim(self.redis, self.keys, self.worker_id, self.lease_ms, self.affinity_wait_ms,
                                 quotas, most, outranking, below_share)

    def run(self, entry: DueEntry, model: str, enqueue_ms: int) -> Run:
        """This worker's run of a job CLAIM started."""
        last = entry.last
        return Run(entry.rid, entry.queue, f"{self.worker_id}:{entry.attempt}", entry.attempt,
                   seq=last.seq + 1 if last is not None else 0, epoch=entry.epoch, model=model, enqueue_ms=enqueue_ms,
                   tenant=entry.tenant)

    async def write(self, records: Sequence[Record]) -> list[bool]:
        """One EMIT call: each record's events, and its write; whether each was allowed. Only the run table
        calls it, one call at a time."""
        now = time.monotonic()
        fresh = now - self.ttl.live / _LOG_TTL_REFRESHES  # a log whose TTL was set since needs none now
        general: list[Record] = []
        order: list[int] = []  # where each record's answer is: general ones first, then the token appends
        appends: list[object] = []
        for r in records:
            run = r.run
            if r.write is Write.APPEND and len(r.events) == 1 and run.owner and run.log_ttl_at > fresh:
                order.append(~(len(appends) // 4))
                rid, owner = run.wire_names()
                appends += (rid, owner, log_entry_id(r.events[0].seq), r.events[0].model_dump_json())
            else:
                order.append(len(general))
                general.append(r)
        result = await emit.emit(self.writer, self.keys, self.ttl, [self._record(r) for r in general], appends)
        for r, ok in zip(general, result):
            if ok == 1 and r.write is Write.APPEND:
                r.run.log_ttl_at = now  # it set the log's TTL
        return [result[i if i >= 0 else len(general) + ~i] == 1 for i in order]

    def _record(self, r: Record) -> bytes:
        run, events, write = r.run, r.events, r.write
        owner = run.epoch if write is Write.LOST else run.owner
        keep_s = self.ttl.result if run.keep_s is None else run.keep_s
        ends = write in (Write.END, Write.EXPIRE) and events and keep_s > 0
        result = self._result(run, events[-1]) if ends else b""
        return emit_record(run.queue, run.rid, owner, write, events[0].seq if events else run.seq, result,
                           [ev.model_dump_json() for ev in events], keep_s)

    @staticmethod
    def _result(run: Run, end: Wire) -> bytes:
        """The ended job's kept result (the reaper's ends too: a job that failed or expired unseen is read back
        as such); the run's text and reasoning, bounded by its max_tokens."""
        return result_record(run.rid, attempt=run.attempt, ok=end.type == "done", event_json=end.model_dump_json(),
                             enqueue_ms=run.enqueue_ms, start_ms=int(run.started_at * 1000), queue=run.queue,
                             text="".join(run.texts), reasoning="".join(run.thoughts))

    async def refresh(self, runs: Sequence[Run]) -> list[bool]:
        """Extend the leases of ``runs``; whether each is still theirs."""
        return await upkeep.refresh(self.redis, self.keys, self.lease_ms, [(run.rid, run.owner) for run in runs])

    async def sweep(self) -> list[Lost]:
        """Running jobs (of any queue) whose lease expired."""
        return await upkeep.sweep(self.redis, self.keys)

    def orphan(self, lost: Lost) -> Run:
        """The reaper's handle on a lost job: it owns no run, and its events follow the job's log."""
        return Run(lost.rid, lost.queue, "", lost.tries, seq=lost.next_seq, tenant=self.keys.queue_of(lost.queue)[1])

    async def lapsed(self) -> list[Lapsed]:
        """Queued jobs (of any queue) whose expiry passed."""
        return await upkeep.lapsed(self.redis, self.keys)

    def expiring(self, lapsed: Lapsed) -> Run:
        """The reaper's handle on a job that expired while queued (no run owns it)."""
        return Run(lapsed.rid, lapsed.queue, "", 0, seq=lapsed.next_seq, enqueue_ms=lapsed.enqueue_ms,
                   tenant=self.keys.queue_of(lapsed.queue)[1])

    async def reject(self, queue: str, entries: Sequence[bytes | str], reason: str) -> int:
        """Move entries of ``queue`` aside to the dead-letter list; how many were still queued."""
        return await upkeep.reject(self.redis, self.keys, self.worker_id, queue, entries, reason)
