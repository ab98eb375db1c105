"""Following a job's events, and what a follower makes of them: its :class:`Result`, its deltas, where it stands.

Delivery: a reader subscribes to the job's pub/sub channel *first*, then reads the replay log from the
next seq it needs, and drops duplicates by seq. So a reader that attaches late, or reconnects, gets every
event exactly once and in order. Silence or a gap in seq triggers another read of the log. A job whose log
expired is read from its kept result, as the events that make it (:func:`kept_events`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from .connection import Failures, RetryPolicy, with_retries
from .deltas import Delta, Deltas, Whole
from .errors import JobFailed, JobNotFound, MlxqError, WaitTimeout
from .protocol.jobrecord import KeptResult, read_result
from .protocol.keys import Keys, log_entry_id
from .schema import (
    DoneEvent,
    ErrorEvent,
    Event,
    FinishReason,
    StartEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    Usage,
    decode_event,
    is_terminal,
)
from .subscriber import Subscriber, Subscription
from .tenants import DEFAULT_TENANT

__all__ = ["Follower", "JobView", "Result", "deltas_of", "kept_events", "result_of", "text_of"]

_RESYNC_S = 1.0  # silence after which a reader re-reads the log (covers lost pub/sub messages)
# A re-read that found nothing new doubles the next wait, up to this: a job waiting in a deep queue (a batch's
# window of lines, a burst's backlog) is silent by design, and each re-read costs Redis two commands.
_RESYNC_MAX_S = 8.0

@dataclass(frozen=True, slots=True)
class Result:
    """A finished job: its text, why it ended, token counts and timings; ``reasoning``: a reasoning model's
    thinking, apart from the text (a request with ``reasoning="split"``); ``tool_calls``: the calls the model
    made of the request's tools (``finish_reason`` is then ``tool_calls``)."""

    id: str
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token, for a request with ``logprobs``
    tool_calls: list[ToolCall] = field(default_factory=list)
    tenant: str = DEFAULT_TENANT  # whose job it was (``GenerateRequest.tenant``)


class Follower:
    """Follows jobs' events for a :class:`~api.client.Client`: one shared subscription (:meth:`hub`), the
    replay log, and the kept results, on the client's connection and retry policy."""

    def __init__(self, redis: Redis, keys: Keys, retry: RetryPolicy, where: str) -> None:
        self._redis, self.keys, self.retry, self.where = redis, keys, retry, where
        self._subscriber: Subscriber | None = None

    async def aclose(self) -> None:
        """Close the shared subscription, if one was opened."""
        if self._subscriber is not None:
            await self._subscriber.aclose()

    async def events(self, rid: str, timeout: float | None, sub: Subscription | None
                     ) -> AsyncGenerator[Event, None]:
        """Every event of job ``rid`` exactly once, in seq order, ending with its terminal event; ``sub``: its
        channel, subscribed before the job was enqueued (else None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        next_seq = 0
        failures = Failures(self.retry, self.where)
        patient = sub is not None  # subscribed before its enqueue, the job exists: no need to ask at once
        while True:
            try:
                async with aclosing(self._follow(rid, next_seq, deadline, sub, failures, patient)) as follow:
                    async for ev in follow:
                        next_seq = ev.seq + 1
                        yield ev
                        if is_terminal(ev):
                            return
            except MlxqError:
                raise
            except Exception as exc:  # unreachable (retried within the policy's deadline) or refused
                await failures.failed(exc)
                check_deadline(deadline, rid)
                sub = None  # closed by _follow: resubscribe, then replay
                patient = True  # Redis may have lost the job: its worker says so within a lease refresh

    async def _follow(self, rid: str, next_seq: int, deadline: float | None, sub: Subscription | None,
                      failures: Failures, patient: bool) -> AsyncGenerator[Event, None]:
        """Replay, then live events; a job with neither a record nor a log is unknown (a patient follower
        asks only after its first wait for live events)."""
        fresh = sub is not None  # subscribed before the job was enqueued: nothing to replay yet
        if sub is None:  # each call cut short at the deadline: a Redis that never answers must not hang here
            sub = await failures.attempt(lambda: self.hub().open(self.keys.events(rid)))
        resync = _RESYNC_S
        try:
            while True:
                replayed = [] if fresh else await failures.attempt(functools.partial(self._replay, rid, next_seq))
                failures.ok()  # Redis answers again: a later failure starts a new deadline
                if not replayed and not patient and await failures.attempt(lambda: self._vanished(rid)):
                    kept = await failures.attempt(lambda: self.kept(rid))
                    if kept is not None:  # its log expired; its result is kept
                        for ev in kept_events(rid, kept):
                            if ev.seq >= next_seq:
                                yield ev
                        return
                    raise JobNotFound(f"job {rid} is unknown, or its events expired (they are kept "
                                      "a few minutes after its end)")
                fresh = patient = False
                seen = next_seq
                for ev in replayed:
                    next_seq = ev.seq + 1
                    yield ev
                if next_seq > seen:
                    resync = _RESYNC_S
                while (live := await self._live(sub, next_seq, deadline, rid, resync)) is not None:
                    next_seq += 1
                    resync = _RESYNC_S  # the job speaks: a silence from here on is worth a look soon
                    yield live
                if next_seq == seen:
                    resync = min(_RESYNC_MAX_S, 2 * resync)
        finally:
            await sub.close()

    def hub(self) -> Subscriber:
        """The shared subscription every follower's channel opens on (opened at first use)."""
        if self._subscriber is None:
            self._subscriber = Subscriber(self._redis)
        return self._subscriber

    async def _live(self, sub: Subscription, next_seq: int, deadline: float | None, rid: str, resync: float
                    ) -> Event | None:
        """The next event from the channel, if it is the one due (``next_seq``); None on silence or a gap.
        A coroutine per event, not a generator: one level less for every event to pass through."""
        while True:
            check_deadline(deadline, rid)
            wait = resync if deadline is None else max(0.0, min(resync, deadline - time.monotonic()))
            data = await sub.get(wait)
            if data is None:
                check_deadline(deadline, rid)
                return None  # silence: re-read the log (a message may have been lost)
            ev = decode_event(data)
            if ev.seq == next_seq:
                return ev
            if ev.seq > next_seq:
                return None  # a gap: re-read the log
            # an event already had (read from the log, then published): skip it

    async def _vanished(self, rid: str) -> bool:
        """Neither queued/running (its job record) nor logged: nothing will ever come."""
        return not await self._redis.exists(self.keys.job(rid), self.keys.log(rid))

    async def _replay(self, rid: str, from_seq: int) -> list[Event]:
        entries = await self._redis.xrange(self.keys.log(rid), min=log_entry_id(from_seq))
        return [decode_event(fields[b"e"]) for _, fields in entries]

    async def kept(self, rid: str) -> KeptResult | None:
        """Job ``rid``'s kept result, if it ended and its result is still kept (else None)."""
        data = await with_retries(lambda: self._redis.get(self.keys.result(rid)), self.retry, self.where)
        if data is None:
            return None
        try:
            return read_result(data)
        except ValueError:  # an arq result record of an earlier release, without our fields
            return None

    async def job(self, rid: str) -> JobView:
        """Where job ``rid`` stands now, without waiting (``mlxq job``): ended (its result, or its error),
        running or queued (its text so far), or unknown (never submitted, or nothing of it is kept any more)."""
        kept = await self.kept(rid)
        if kept is not None:
            view = JobView(rid, "done" if kept.end.get("type") == "done" else "failed", kept=kept)
            return viewed(view, kept_events(rid, kept))

        async def read() -> tuple[Any, int]:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xrange(self.keys.log(rid))
                pipe.exists(self.keys.job(rid))
                entries, queued = await pipe.execute()
            return entries, queued
        entries, queued = await with_retries(read, self.retry, self.where)
        events = [decode_event(fields[b"e"]) for _, fields in entries]
        if not events:
            return JobView(rid, "queued" if queued else "unknown")
        status = "running" if not is_terminal(events[-1]) else ("done" if events[-1].type == "done" else "failed")
        return viewed(JobView(rid, status), events)


@dataclass(slots=True)
class JobView:
    """A job as it stands (:meth:`Client.job`): ``status`` queued, running, done, failed or unknown; its text and
    reasoning so far (its last run's), its end (``done`` or ``error``) once it ended, and its kept result's
    times if it is read from that."""

    id: str
    status: str
    text: str = ""
    reasoning: str = ""
    done: DoneEvent | None = None
    error: ErrorEvent | None = None
    kept: KeptResult | None = None


def viewed(view: JobView, events: list[Event]) -> JobView:
    """``view`` filled from the job's ``events``: its text and reasoning so far, and its end."""
    whole = Whole()
    for ev in events:
        whole.feed(ev)
        if isinstance(ev, DoneEvent):
            view.done = ev
        elif isinstance(ev, ErrorEvent):
            view.error = ev
    view.text, view.reasoning = whole.text, whole.reasoning
    return view


def kept_events(rid: str, kept: KeptResult) -> list[Event]:
    """A kept result as the events that make it: its start (a job that ran), its text, reasoning and tool calls
    as one token event, and its terminal event, numbered before it. What a reader of the job's log would have
    made of it, for the reader that comes after the log expired."""
    end = decode_event(json.dumps(kept.end))
    events: list[Event] = []
    seq = max(0, end.seq - 2)
    calls = end.tool_calls if isinstance(end, DoneEvent) else None
    ran = kept.text or kept.reasoning or calls or (isinstance(end, DoneEvent) and end.usage.prompt_tokens > 0)
    if ran and end.seq >= 2:
        usage = end.usage.prompt_tokens if isinstance(end, DoneEvent) else 0
        events.append(StartEvent(id=rid, seq=seq, model="", worker="", prompt_tokens=usage))
    if kept.text or kept.reasoning or calls:
        events.append(TokenEvent(id=rid, seq=max(0, end.seq - 1), text=kept.text, token_ids=[], index=0,
                                 reasoning=kept.reasoning, tool_calls=list(calls) if calls else None))
    events.append(end)
    return events


async def deltas_of(rid: str, events: AsyncIterator[Event]) -> AsyncIterator[Delta]:
    """Job ``rid``'s :class:`Delta` s from its ``events``; :class:`JobFailed` on an error event."""
    deltas = Deltas(rid)
    async for ev in events:
        if isinstance(ev, ErrorEvent):
            raise JobFailed(ev)
        if ev.type == "done":
            deltas.end(ev.seq)
            return
        delta = deltas.feed(ev)
        if delta is not None:
            yield delta


async def text_of(rid: str, events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """Job ``rid``'s text deltas from its ``events``; :class:`JobFailed` on an error event."""
    async for delta in deltas_of(rid, events):
        if delta.text:
            yield delta.text


async def result_of(rid: str, events: AsyncIterator[Event]) -> Result:
    """Job ``rid``'s :class:`Result` from its ``events``; :class:`JobFailed` on an error event."""
    whole = Whole()
    async for ev in events:
        if isinstance(ev, ErrorEvent):
            raise JobFailed(ev)
        whole.feed(ev)
        if isinstance(ev, DoneEvent):
            return Result(rid, whole.text, ev.finish_reason, ev.usage, ev.timings, whole.token_ids, whole.reasoning,
                          whole.logprobs, whole.tool_calls, ev.tenant or DEFAULT_TENANT)
    raise AssertionError("unreachable: events() ends with a terminal event")


def check_deadline(deadline: float | None, rid: str) -> None:
    """:class:`WaitTimeout` once ``deadline`` (a monotonic time; None: none) passed."""
    if deadline is not None and time.monotonic() >= deadline:
        raise WaitTimeout(f"no terminal event for job {rid} in time")
