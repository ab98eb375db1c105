"""Sends the enqueues of submits made together in one round trip.

A web backend that fans a request out into 32 jobs submits them concurrently; one ENQUEUE call each took
32 round trips on up to 32 pooled connections, and the jobs landed in Redis over ~5 ms, each with its own
wake-up, so a worker saw the burst trickle in. Here the first submit of an event-loop pass schedules one
pipeline that carries every submit made in the same pass: the burst lands at once, with one wake-up per
model instead of one per job (each cost every worker of the model a pub/sub read). The price: a lone submit
waits one event-loop pass for company, and goes out from a task of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from .connection import ENQUEUE

__all__ = ["Enqueuer"]

_WAKE = 3  # ENQUEUE's argument naming the wake channel


@dataclass(slots=True)
class _Call:
    keys: list[str]
    args: list[Any]
    done: asyncio.Future[bool]


class Enqueuer:
    """Runs the ENQUEUE script for concurrent callers, one pipeline per event-loop pass."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.sha = hashlib.sha1(ENQUEUE.encode()).hexdigest()
        self.round_trips = 0  # pipelines and single calls sent (tests and benchmarks read it)
        self._pending: list[_Call] = []
        self._senders: set[asyncio.Task[None]] = set()

    async def enqueue(self, keys: list[str], args: list[Any]) -> bool:
        """Store and queue one job; False if its id is taken. A caller cancelled before the send is dropped."""
        loop = asyncio.get_running_loop()
        call = _Call(keys, args, loop.create_future())
        if not self._pending:  # the first of this pass: send once every caller of the pass has joined
            task = loop.create_task(self._send())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        self._pending.append(call)
        return await call.done

    async def aclose(self) -> None:
        """Wait for the sends in flight (their callers are waiting for them)."""
        await asyncio.gather(*self._senders, return_exceptions=True)

    async def _send(self) -> None:
        calls = [c for c in self._pending if not c.done.done()]
        self._pending = []
        if not calls:
            return
        try:
            results = await self._run(calls)
        except Exception as exc:
            results = [exc] * len(calls)
        except BaseException:
            for c in calls:
                c.done.cancel()
            raise
        for c, r in zip(calls, results):
            if c.done.done():
                continue
            if isinstance(r, Exception):
                c.done.set_exception(r)
            else:
                c.done.set_result(bool(r))

    async def _run(self, calls: list[_Call]) -> list[Any]:
        results = await self._evalsha(calls)
        lost = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if lost:  # Redis restarted or flushed its scripts: load once, run the refused calls again
            await self.redis.script_load(ENQUEUE)
            for i, r in zip(lost, await self._evalsha([calls[i] for i in lost])):
                results[i] = r
        return results

    async def _evalsha(self, calls: list[_Call]) -> list[Any]:
        self.round_trips += 1
        if len(calls) == 1:
            c = calls[0]
            try:
                return [await self.redis.evalsha(self.sha, len(c.keys), *c.keys, *c.args)]  # type: ignore[misc]
            except NoScriptError as exc:
                return [exc]
        pipe = self.redis.pipeline(transaction=False)
        last = {c.args[_WAKE]: i for i, c in enumerate(calls)}  # each wake channel's last call wakes it
        for i, c in enumerate(calls):
            args = c.args if last[c.args[_WAKE]] == i else [*c.args[:_WAKE], "", *c.args[_WAKE + 1:]]
            pipe.evalsha(self.sha, len(c.keys), *c.keys, *args)
        return list(await pipe.execute(raise_on_error=False))
