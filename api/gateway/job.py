"""The job an HTTP request waits on: submitted, its start awaited, then its text and its end.

A streamed response is the job's deltas (``api/deltas.py``: a re-run's repeat of what was sent is skipped;
one that diverges ends the stream with :class:`JobFailed`, and the job is cancelled). A whole response keeps
the last run's text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import cast

from ..client import Client
from ..deltas import Delta, Deltas, Whole
from ..errors import AccessDenied, JobFailed, MlxqError, QueueUnavailable, WaitTimeout
from ..schema import (
    DoneEvent,
    ErrorEvent,
    Event,
    FinishReason,
    GenerateRequest,
    StartEvent,
    TokenLogprob,
    ToolCall,
)
from .errors import GatewayError, Kind, Problem

__all__ = ["Choices", "Delta", "JobStream"]

_CANCEL_WAIT_S = 2.0  # a cancel on the way out gives up after this (Redis unreachable): the job still ends
_UNSURE = (QueueUnavailable, AccessDenied, WaitTimeout)  # raised with the job perhaps queued: cancel it


class JobStream:
    """One job followed for one HTTP request. ``open``, then ``deltas`` (a stream) or ``whole``; ``close`` always."""

    def __init__(self, client: Client, request: GenerateRequest) -> None:
        self.client = client
        self.request = request
        self.rid = request.id
        self.prompt_tokens = 0
        self.done: DoneEvent | None = None  # the job's end, once reached
        self.submitted = False  # queued (its first event came), or perhaps queued (Redis failed under the submit)
        self._events: AsyncGenerator[Event, None] | None = None
        self._held: list[Event] = []  # read by open() past the start
        self._settled = False  # ended, or never queued: nothing to cancel
        self.reasoning = ""  # the whole reasoning of the last run, once whole() read it
        self.logprobs: list[TokenLogprob] = []  # and its tokens' log-probabilities (when asked for)
        self.tool_calls: list[ToolCall] = []  # and its tool calls

    async def open(self) -> None:
        """Submit the job and wait for its start. Raises what submitting raises (``NoWorker``, ``QueueFull``,
        ``BadRequest``, ...) and ``JobFailed`` when the job fails before it starts (the worker refused it)."""
        # An async generator: closing it unsubscribes at once.
        events = self._events = cast(AsyncGenerator[Event, None],
                                     self.client.submit_and_follow(self.request, require_worker=True))
        try:
            while True:
                ev = await anext(events)
                self.submitted = True
                if isinstance(ev, StartEvent):
                    self.prompt_tokens = ev.prompt_tokens
                    return
                if ev.type != "reset":  # the end (an error raises here), or a token (never before a start)
                    if not self._ends(ev):
                        self._held.append(ev)
                    return
        except MlxqError as exc:
            unsure = isinstance(exc, _UNSURE)
            self.submitted = self.submitted or unsure
            self._settled = not unsure  # refused, or ended: nothing queued to cancel
            raise

    async def deltas(self) -> AsyncIterator[Delta]:
        """What the job makes, as it is made, each piece once: a re-run's repeat of what was sent is skipped,
        and a re-run that diverges from it raises :class:`JobFailed`."""
        deltas = Deltas(self.rid)
        async for ev in self._rest():
            delta = deltas.feed(ev)
            if delta is not None:
                yield delta
        deltas.end(self.done.seq if self.done else 0)

    async def whole(self) -> str:
        """The whole text of the job's last run (its reasoning in :attr:`reasoning`)."""
        whole = Whole()
        async for ev in self._rest():
            whole.feed(ev)
        if self.done is not None:
            whole.feed(self.done)
        self.reasoning = whole.reasoning
        self.logprobs = list(whole.logprobs or ())
        self.tool_calls = whole.tool_calls
        return whole.text

    async def _rest(self) -> AsyncIterator[Event]:
        """Events after the start, up to the end (which sets ``done``, or raises ``JobFailed``)."""
        assert self._events is not None, "open() first"
        if self.done is not None:  # it ended before it started (cancelled while queued)
            return
        held, self._held = self._held, []
        for ev in held:
            if self._ends(ev):
                return
            yield ev
        async for ev in self._events:
            if self._ends(ev):
                return
            yield ev

    def _ends(self, ev: Event) -> bool:
        if isinstance(ev, ErrorEvent):
            self._settled = True
            raise JobFailed(ev)
        if isinstance(ev, DoneEvent):
            self._settled = True
            if ev.finish_reason is FinishReason.CANCELLED:  # someone else cancelled it (mlxq cancel)
                raise GatewayError(Problem(Kind.UNAVAILABLE, f"job {self.rid} was cancelled before it finished",
                                           "cancelled"))
            self.done = ev
            return True
        return False

    async def close(self) -> None:
        """Stop following; cancel the job unless it ended (the client went away, or the text diverged). Closing
        again does nothing."""
        events, self._events = self._events, None
        if events is not None:
            await events.aclose()  # it unsubscribes, which waits for nothing
        if not self._settled:
            self._settled = True
            with contextlib.suppress(MlxqError, TimeoutError):
                async with asyncio.timeout(_CANCEL_WAIT_S):
                    await self.client.cancel(self.rid)

    @property
    def ended(self) -> bool:
        """Whether the job reached its end (or was never queued)."""
        return self._settled


class Choices:
    """The jobs of one HTTP request, one per choice (OpenAI's ``n``; one for every other request), each followed
    by its own :class:`JobStream`: opened together, read together, closed together."""

    def __init__(self, client: Client, requests: Sequence[GenerateRequest]) -> None:
        self.jobs = [JobStream(client, r) for r in requests]
        self.first = self.jobs[0]
        self.rid = self.first.rid  # names the request in headers and logs
        self.request = self.first.request

    @property
    def submitted(self) -> bool:
        return any(job.submitted for job in self.jobs)

    async def open(self) -> None:
        """Submit every job and wait for each to start; when one fails, the others are closed (cancelled)."""
        if len(self.jobs) == 1:
            return await self.first.open()
        try:
            async with asyncio.TaskGroup() as group:
                for job in self.jobs:
                    group.create_task(job.open())
        except BaseExceptionGroup as failed:
            await self.close()
            raise failed.exceptions[0] from None

    async def whole(self) -> list[str]:
        """Each choice's whole text (see :meth:`JobStream.whole`)."""
        if len(self.jobs) == 1:
            return [await self.first.whole()]
        try:
            async with asyncio.TaskGroup() as group:
                texts = [group.create_task(job.whole()) for job in self.jobs]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [t.result() for t in texts]

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Each choice's deltas (see :meth:`JobStream.deltas`) with its index, as they come."""
        if len(self.jobs) == 1:
            async for delta in self.first.deltas():
                yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, Delta] | BaseException | None] = asyncio.Queue()

        async def follow(i: int, job: JobStream) -> None:
            try:
                async for delta in job.deltas():
                    queue.put_nowait((i, delta))
            except BaseException as exc:
                queue.put_nowait(exc)
                raise
            queue.put_nowait(None)

        tasks = [asyncio.ensure_future(follow(i, job)) for i, job in enumerate(self.jobs)]
        try:
            ended = 0
            while ended < len(tasks):
                item = await queue.get()
                if item is None:
                    ended += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def completion_tokens(self) -> int:
        return sum(job.done.usage.completion_tokens for job in self.jobs if job.done is not None)

    async def close(self) -> None:
        await asyncio.gather(*(job.close() for job in self.jobs))
