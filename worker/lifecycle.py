"""A job's life on the worker side: its states, its events, and the one atomic Redis call behind each move.

    queued ──start──▶ running ──end──▶ ended    (exactly one terminal event: done or error)
      ▲ │                │                 ▲
      │ └───lapse────────┼─────────────────┘    (expired while queued: error(expired))
      └───hand back──────┘                      (a reset event: shutdown, or the reaper after a worker died)

- **start** (``START``): a worker starts due jobs of its queues in one call, lowest score first, each queue up
  to its engine's room. Each takes a lease whose token names the run (``<worker id>:<try>``); only here is the
  try counted, so tries count runs that started.
- **append / end / hand back** (``EMIT``): a run's events, one call per engine step for all the worker's jobs;
  the terminal event's call also ends the job, a reset's hands it back to its queue.
- **refresh** (``REFRESH``): extends a worker's leases; a run whose lease is gone is fenced: it writes nothing more.
- **reap** (``SWEEP``, then ``EMIT`` as the empty owner): a running job whose lease expired (its worker died or
  froze) is handed back with a reset, or ended on its last try.
- **lost data** (``EMIT``, write ``LOST``): Redis lost its data under a running job (the epoch changed, the
  record is gone): the run ends it ``error(data_lost)``, retryable, instead of leaving its followers waiting.
- **lapse** (``LAPSE``, then ``EMIT`` as the empty owner, write ``EXPIRE``): a job still queued past its expiry
  ends ``error(expired)``, or ``done(cancelled)`` if a cancel waits; taking it out of its queue decides a race
  with a worker starting it.
- **reject** (``REJECT``): a queue entry no worker can run goes to the dead-letter list.

Every script checks its caller's right in Redis (worker/scripts.py), so a fenced run's writes are refused. The
:class:`RunTable` holds a worker's runs, decides each job's terminal event and sends EMIT calls one at a time
(each :class:`Run` builds and numbers its events); the other scripts are the :class:`Lifecycle`'s, which
changes no run.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from mlxq.api.jobrecord import result_record
from mlxq.api.keys import DONE_TTL_S, LIVE_TTL_S, Keys
from mlxq.api.schema import (
    PRIORITY_MIN,
    TERMINAL_TYPES,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    ResetEvent,
    StartEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    Usage,
    decode_event,
    token_event_json,
)

from .publisher import Publisher
from .scripts import EMIT, LAPSE, REFRESH, REJECT, START, SWEEP, Script

if TYPE_CHECKING:
    from mlxq.engine.request import RequestOutput

    from .toolcalls import ToolCalls

__all__ = ["Claim", "Lapsed", "Lifecycle", "LogTTL", "Lost", "Outputs", "Outranking", "Record", "Run", "RunStats",
           "RunTable", "Start", "Starts", "State", "TokenLine", "Wire", "Write"]

log = logging.getLogger(__name__)

_RETRYABLE = {ErrorCode.ENGINE_ERROR, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT, ErrorCode.DATA_LOST,
              ErrorCode.EXPIRED}
_LAPSED_PER_SWEEP = 500
_READ_MIN = 16  # due entries START reads per queue, at least (poison and deferred entries may come first)
_MAX_MESSAGE = 2000
_EPOCH_TTL_S = 7 * 86_400  # refreshed at every start
_TRIES_TTL_S = 86_400  # a job's record lives at most this long too (api.client.JOB_TTL_MS)
_DEAD_LETTERS_KEPT = 1000
_DEAD_LETTER_TTL_S = 7 * 86_400


class State(enum.Enum):
    """Where a run stands, as this worker knows it."""

    RUNNING = "running"
    CLOSING = "closing"  # its end or hand-back is being written: no other verb may end it
    ENDED = "ended"  # its terminal event is written
    HANDED_BACK = "handed_back"  # its reset is written and the job is queued again
    FENCED = "fenced"  # its lease is gone: another run (or nobody) owns the job now


class Write(enum.Enum):
    """What an EMIT call does with a job beyond logging and publishing its events."""

    APPEND = "a"
    END = "e"
    HAND_BACK = "h"
    LOST = "l"
    EXPIRE = "x"


class Claim(enum.Enum):
    """What START did with one due job."""

    STARTED = "started"
    DEFERRED = "deferred"  # another run still holds its lease: left queued, due later, no try counted
    GONE = "gone"  # queued, but its record is gone (expired or lost): for REJECT
    POISON = "poison"  # the queue entry is no job id a producer makes: for REJECT


@dataclass(frozen=True, slots=True)
class LogTTL:
    """Replay-log TTLs, and how long arq's result record of an ended job is kept (0: none); seconds."""

    live: int = LIVE_TTL_S
    done: int = DONE_TTL_S
    result: int = 0


@dataclass(slots=True)
class TokenLine:
    """A token event as its wire fields. A worker writes one per job per step it sends, so it skips building
    a pydantic ``TokenEvent``; :meth:`model_dump_json` renders exactly that event's JSON."""

    id: str
    seq: int
    text: str
    token_ids: list[int]
    index: int
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None
    type: Literal["token"] = "token"

    def model_dump_json(self) -> str:
        if self.logprobs is not None or self.tool_calls is not None:  # rare: pydantic's own JSON
            return TokenEvent(id=self.id, seq=self.seq, text=self.text, token_ids=self.token_ids, index=self.index,
                              reasoning=self.reasoning, logprobs=self.logprobs,
                              tool_calls=self.tool_calls).model_dump_json()
        return token_event_json(self.id, self.seq, self.text, self.token_ids, self.index, self.reasoning)


Wire = Event | TokenLine  # what a run writes


@dataclass(slots=True)
class Run:
    """One run of a job on this worker: its owner token, and the builder and numberer of the job's events.

    ``seq`` is the next event's number; it continues across runs (a run starts after the last logged event).
    """

    rid: str
    queue: str
    owner: str  # the lease's token ("<worker id>:<try>"); "" for the reaper, who owns no run
    attempt: int
    seq: int = 0
    epoch: str = ""  # the deployment's epoch when the run started
    model: str = ""
    enqueue_ms: int = 0
    state: State = State.RUNNING
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.time)  # epoch seconds, as the timings below
    admitted_at: float | None = None
    first_token_at: float | None = None
    # Its request asked for log-probabilities: its token events carry them, with each token's text from this
    token_text: Callable[[int], str] | None = None
    tools: ToolCalls | None = None  # its request gave tools: its calls, parsed as they complete
    finished: asyncio.Future[State] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    _wire: tuple[str, bytes, bytes] | None = field(default=None, repr=False, compare=False)  # see wire_names

    def _next(self) -> int:
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def wire_names(self) -> tuple[bytes, bytes]:
        """Its queue, id and owner as an EMIT record heads them: their lengths (``b"<q> <id> <owner> "``) and
        the three, encoded (once: the run writes a record per step it sends)."""
        cached = self._wire
        if cached is None or cached[0] != self.owner:
            queue, rid, owner = self.queue.encode(), self.rid.encode(), self.owner.encode()
            cached = self._wire = (self.owner, b"%d %d %d " % (len(queue), len(rid), len(owner)),
                                   b"".join((queue, rid, owner)))
        return cached[1], cached[2]

    def settle(self, state: State) -> None:
        """Record how the run left this worker, and wake whoever awaits it."""
        self.state = state
        if not self.finished.done():
            self.finished.set_result(state)

    def start(self, prompt_tokens: int, worker: str) -> StartEvent:
        """The engine admitted the job."""
        self.prompt_tokens = prompt_tokens
        if self.admitted_at is None:
            self.admitted_at = time.time()
        return StartEvent(id=self.rid, seq=self._next(), model=self.model, worker=worker,
                          prompt_tokens=prompt_tokens, attempt=self.attempt)

    def tokens(self, text: str, token_ids: list[int], completion_tokens: int, reasoning: str = "",
               logprobs: list[TokenLogprob] | None = None, tool_calls: list[ToolCall] | None = None) -> TokenLine:
        """New text (and reasoning, log-probabilities, tool calls): ``completion_tokens`` counts every token so
        far, ``token_ids`` included."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        self.completion_tokens = max(self.completion_tokens, completion_tokens)
        return TokenLine(self.rid, self._next(), text, token_ids, completion_tokens - len(token_ids), reasoning,
                         logprobs, tool_calls)

    def done(self, reason: FinishReason, *, generated: int = 0, stop_sequence: str | None = None) -> DoneEvent:
        """The job's end: ``generated`` tokens at least (the engine's count), ``stop_sequence`` the stop string
        that ended it, if one did; one that stopped after tool calls ends ``tool_calls``, with every call."""
        self.completion_tokens = max(self.completion_tokens, generated)
        calls = self.tools.calls if self.tools is not None and self.tools.calls else None
        if calls and reason is FinishReason.STOP:
            reason = FinishReason.TOOL_CALLS
        return DoneEvent(id=self.rid, seq=self._next(), finish_reason=reason, timings=self.timings(),
                         usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens),
                         stop_sequence=stop_sequence, tool_calls=list(calls) if calls else None)

    def error(self, code: ErrorCode, message: str) -> ErrorEvent:
        if len(message) > _MAX_MESSAGE:
            message = message[:_MAX_MESSAGE] + "..."
        return ErrorEvent(id=self.rid, seq=self._next(), code=code, message=message, retryable=code in _RETRYABLE)

    def reset(self, reason: str) -> ResetEvent:
        """The job starts again (in the next run, ``attempt + 1``): its followers drop the text so far."""
        return ResetEvent(id=self.rid, seq=self._next(), reason=reason, attempt=self.attempt + 1)

    def timings(self) -> Timings:
        now = time.time()
        enqueued = self.enqueue_ms / 1000
        ms = lambda t: max(0.0, (t - enqueued) * 1000.0)  # noqa: E731
        decode_s = now - self.first_token_at if self.first_token_at else 0.0
        tps = (self.completion_tokens - 1) / decode_s if decode_s > 0 and self.completion_tokens > 1 else None
        return Timings(queue_ms=ms(self.admitted_at or now), total_ms=ms(now), tokens_per_s=tps,
                       ttft_ms=ms(self.first_token_at) if self.first_token_at else None)


@dataclass(frozen=True, slots=True)
class Start:
    """One due job, as START left it; ``job``, ``attempt``, ``last`` and ``cancelled`` only when started."""

    rid: str
    queue: str
    claim: Claim
    epoch: str
    entry: bytes = b""  # the queue entry as stored (a poison one may not be text)
    job: bytes = b""
    attempt: int = 0
    last: Event | None = None  # the job's last logged event (an earlier run's)
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class Outranking:
    """What a queued job needs for a full engine to take it: at least ``priority`` (it then starts at once,
    preempting a running sequence of lower priority). A job of lower priority that only waited long is left
    for room: once claimed it would preempt nobody."""

    priority: int
    aging_ms: int
    count: int = 1  # jobs that would start at once: one per running sequence of the lowest priority

    def arg(self) -> str:
        """As START takes it (it recovers a queued job's priority from its score: ``api.keys.queue_score``)."""
        return f"{self.priority} {self.aging_ms} {PRIORITY_MIN}"


@dataclass(frozen=True, slots=True)
class Starts:
    """What one START call did: a row per due entry it looked at, and whether it left due jobs queued."""

    rows: list[Start]
    left: bool


@dataclass(frozen=True, slots=True)
class Lost:
    """A running job whose lease expired, as SWEEP read it."""

    rid: str
    queue: str
    next_seq: int
    tries: int
    has_record: bool


@dataclass(frozen=True, slots=True)
class Lapsed:
    """A queued job whose expiry passed, as LAPSE read it."""

    rid: str
    queue: str
    next_seq: int
    enqueue_ms: int  # 0 if its record is gone
    cancelled: bool


@dataclass(frozen=True, slots=True)
class Record:
    """One job's events for an EMIT call, and what the call does with the job."""

    run: Run
    events: Sequence[Wire]
    write: Write


class Lifecycle:
    """The transitions of a worker's jobs (of any of its queues), as typed calls of their scripts."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, ttl: LogTTL, lease_ttl_s: float,
                 writer: Redis | None = None) -> None:
        self.redis = redis
        self.writer = writer or redis  # EMIT calls' connection
        self.keys = keys
        self.worker_id = worker_id
        self.ttl = ttl
        self.lease_ms = int(lease_ttl_s * 1000)
        self._start, self._emit, self._refresh = Script.of(START), Script.of(EMIT), Script.of(REFRESH)
        self._sweep, self._reject, self._lapse = Script.of(SWEEP), Script.of(REJECT), Script.of(LAPSE)

    async def open(self) -> None:
        """Set the deployment's epoch unless Redis has one (a fresh or emptied server); START keeps it."""
        await self.redis.set(self.keys.epoch(), uuid.uuid4().hex, nx=True, ex=_EPOCH_TTL_S)

    async def start(self, quotas: dict[str, int], most: int, outranking: dict[str, Outranking] | None = None
                    ) -> Starts:
        """Start up to ``most`` due jobs, lowest score first across the queues, each queue up to its quota;
        from a queue in ``outranking``, only jobs of at least its priority (up to its quota)."""
        queues = list(quotas)
        now = int(time.time() * 1000)
        outranking = outranking or {}
        needs = [outranking[q].arg() if q in outranking else "" for q in queues]
        args = [now, most, self.worker_id, self.lease_ms, self.keys.prefix, uuid.uuid4().hex,
                _EPOCH_TTL_S, _TRIES_TTL_S, max(_READ_MIN, 2 * most), *(quotas[q] for q in queues), *needs]
        keys = [self.keys.running(), self.keys.epoch(), self.keys.deadlines(), *queues]
        epoch, left, *rows = await self._start.run(self.redis, keys, args)
        return Starts([_start_row(row, epoch.decode()) for row in rows], bool(left))

    def run(self, start: Start, model: str, enqueue_ms: int) -> Run:
        """This worker's run of a job START started."""
        last = start.last
        return Run(start.rid, start.queue, f"{self.worker_id}:{start.attempt}", start.attempt,
                   seq=last.seq + 1 if last is not None else 0, epoch=start.epoch, model=model, enqueue_ms=enqueue_ms)

    async def write(self, records: Sequence[Record]) -> list[bool]:
        """One EMIT call: each record's events, and its write; whether each was allowed. Only the run table
        calls it, one call at a time."""
        args: list[object] = [len(records), self.ttl.live, self.ttl.done, int(time.time() * 1000), self.keys.prefix,
                              max(1, self.ttl.result) * 1000]
        args.append(b"".join(b"%d\n%s" % (len(r), r) for r in map(self._record, records)))
        keys = [self.keys.running(), self.keys.epoch(), self.keys.deadlines()]
        result = await self._emit.run(self.writer, keys, args)
        return [r == 1 for r in result]

    def _record(self, r: Record) -> bytes:
        run, events, write = r.run, r.events, r.write
        if write is Write.APPEND and len(events) == 1:  # a job's token event of a step: N per step
            lengths, names = run.wire_names()
            return b"%sa %d 0\n%s\n%s" % (lengths, events[0].seq, names, events[0].model_dump_json().encode())
        queue, rid = run.queue.encode(), run.rid.encode()
        owner = (run.epoch if write is Write.LOST else run.owner).encode()
        result = self._result(run, events[-1]) if write is Write.END and events else b""
        head = b"%d %d %d %s %d %d\n" % (len(queue), len(rid), len(owner), write.value.encode(),
                                         events[0].seq if events else run.seq, len(result))
        body = "\n".join(ev.model_dump_json() for ev in events).encode()
        return b"".join((head, queue, rid, owner, result, b"\n", body))

    def _result(self, run: Run, end: Wire) -> bytes:
        if self.ttl.result <= 0 or not run.owner:
            return b""
        return result_record(run.rid, attempt=run.attempt, ok=end.type == "done", event_json=end.model_dump_json(),
                             enqueue_ms=run.enqueue_ms, start_ms=int(run.started_at * 1000), queue=run.queue)

    async def refresh(self, runs: Sequence[Run]) -> list[bool]:
        """Extend the leases of ``runs``; whether each is still theirs."""
        args: list[object] = [self.lease_ms, self.keys.prefix]
        for run in runs:
            args += (run.rid, run.owner)
        return [r == 1 for r in await self._refresh.run(self.redis, [], args)]

    async def sweep(self) -> list[Lost]:
        """Running jobs (of any queue) whose lease expired."""
        rows = await self._sweep.run(self.redis, [self.keys.running()], [self.keys.prefix])
        return [Lost(rid.decode(), queue.decode(), int(seq), int(tries), bool(has))
                for rid, queue, seq, tries, has in rows]

    def orphan(self, lost: Lost) -> Run:
        """The reaper's handle on a lost job: it owns no run, and its events follow the job's log."""
        return Run(lost.rid, lost.queue, "", lost.tries, seq=lost.next_seq)

    async def lapsed(self) -> list[Lapsed]:
        """Queued jobs (of any queue) whose expiry passed."""
        args = [int(time.time() * 1000), self.keys.prefix, _LAPSED_PER_SWEEP]
        rows = await self._lapse.run(self.redis, [self.keys.deadlines()], args)
        return [Lapsed(rid.decode(), queue.decode(), int(seq), int(et), bool(c)) for rid, queue, seq, et, c in rows]

    def expiring(self, lapsed: Lapsed) -> Run:
        """The reaper's handle on a job that expired while queued (no run owns it)."""
        return Run(lapsed.rid, lapsed.queue, "", 0, seq=lapsed.next_seq, enqueue_ms=lapsed.enqueue_ms)

    async def reject(self, queue: str, entries: Sequence[bytes | str], reason: str) -> int:
        """Move entries of ``queue`` aside to the dead-letter list; how many were still queued."""
        now = int(time.time() * 1000)
        args: list[object] = [_DEAD_LETTERS_KEPT, _DEAD_LETTER_TTL_S]
        for entry in entries:
            raw = entry.encode() if isinstance(entry, str) else entry
            record = {"queue": queue, "entry": raw.decode(errors="backslashreplace"), "hex": raw.hex(),
                      "reason": reason, "at_ms": now, "worker": self.worker_id}
            args += (raw, json.dumps(record))
        moved: int = await self._reject.run(self.redis, [queue, self.keys.dead_letters()], args)
        return moved


def _start_row(row: list[bytes], epoch: str) -> Start:
    rid, queue, claim = row[0].decode(errors="backslashreplace"), row[1].decode(), Claim(row[2].decode())
    if claim is not Claim.STARTED:
        return Start(rid, queue, claim, epoch, row[0])
    _score, job, attempt, last, cancelled = row[3:]
    return Start(rid, queue, claim, epoch, row[0], job, int(attempt), decode_event(last) if last else None,
                 bool(cancelled))


# --- the run table: who makes each move -------------------------------------------------------------------
_SETTLED = {Write.END: State.ENDED, Write.LOST: State.ENDED, Write.HAND_BACK: State.HANDED_BACK}
_LIVE = (State.RUNNING, State.CLOSING)  # states of a run whose lease may still be its own
_DATA_LOST = "Redis lost this job's data while it ran (restarted without persistence, or flushed); submit it again"

Outputs = Callable[["RequestOutput", Run, str], list[Wire]]  # an engine output's events (translate.output_events)


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

    def __init__(self, lifecycle: Lifecycle, outputs: Outputs, stop: Callable[[Run], None],
                 give_up_s: float = 10.0) -> None:
        self.lifecycle = lifecycle
        self.publisher = Publisher(self.apply)  # engine outputs and cancels, batched: one apply per batch
        self.stats = RunStats()
        self.on_ended: Callable[[Run, Wire], None] = _ignore  # a run's terminal event was written
        self.on_write: Callable[[float], None] = _ignore  # seconds one EMIT call took
        self._outputs = outputs  # injected: translating engine outputs loads the engine (MLX)
        self._stop = stop  # drops a run's sequence from its engine
        self._give_up_s = give_up_s  # past the lease TTL, other workers own these jobs anyway
        self._runs: dict[str, Run] = {}
        self._lock = asyncio.Lock()  # one EMIT call at a time keeps every job's events in seq order

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

    async def apply(self, outs: Sequence[RequestOutput], step: bool = True) -> None:
        """Engine outputs (one per job: ``engine.request.coalesce``) as their runs' events, in one EMIT call;
        the output of a run no longer here (ended, handed back, fenced) is dropped."""
        groups: dict[str, tuple[Run, list[Wire]]] = {}
        runs, outputs, worker = self._runs, self._outputs, self.lifecycle.worker_id
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
        await self._write_groups(groups, step=step)

    def cancel(self, rid: str) -> None:
        """A client cancelled: drop the job's sequence from its engine now, and end it ``done(cancelled)``
        after the outputs already queued for it, without waiting for the step in flight (the engine's own end
        then finds the run gone)."""
        run = self._runs.get(rid)
        if run is not None:
            self._stop(run)
            self.publisher.feed_cancel(rid)

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
        record, what = _reaped(self.lifecycle.orphan(lost), lost, max_tries)
        (ok,) = await self._emit([record])
        if ok:
            log.info("job %s: its worker was lost; %s", lost.rid, what)
        return ok

    async def expire(self, lapsed: Sequence[Lapsed]) -> list[Lapsed]:
        """End queued jobs whose expiry passed, ``error(expired)`` (``done(cancelled)`` if a cancel waits for
        one); those this call ended (a worker that started one meanwhile wins)."""
        if not lapsed:
            return []
        records = [_expired(self.lifecycle.expiring(job), job) for job in lapsed]
        ended = [job for job, ok in zip(lapsed, await self._emit(records)) if ok]
        for job in ended:
            log.info("job %s: still queued on %s when it expired; ended", job.rid, job.queue)
        return ended

    # --- how the verbs change runs and write ------------------------------------------------------------
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

    async def _emit(self, records: list[Record]) -> list[bool]:
        """One EMIT call for jobs no run owns, in turn with the runs' writes; Redis' errors go to the caller."""
        async with self._lock:
            return await self.lifecycle.write(records)

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
