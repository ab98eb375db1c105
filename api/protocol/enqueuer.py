"""Sends the enqueues of submits made together in one round trip, on a connection of its own.

A web backend fans a request out into many concurrent submits; one ENQUEUE each would land them one by one,
each with its own wake-up. Here the first submit of an event-loop pass starts a sender that carries every
submit of that pass in one pipeline, with one wake-up per model; submits made while it is in flight go in the
next, so a busy producer sends bigger batches, not more. The sender packs the pipeline itself and writes it
straight onto its connection, skipping redis-py's per-argument packer and per-checkout connection check. The
price: a lone submit waits one event-loop pass for company.

A submit may bring *writes* of its own (a record that must exist once its job does: the gateway's stored
response, its webhook request): they go in the same round trip, with its ENQUEUE in one MULTI/EXEC, so the job
is queued with them or not at all (a write Redis refuses, out of memory or by its ACL, aborts the ENQUEUE too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoScriptError, ResponseError

from .producer import ENQUEUE

__all__ = ["Command", "Enqueuer"]

Command = tuple[str | bytes | int, ...]  # one Redis command and its arguments, e.g. ("SET", key, value)
_WAKE = ENQUEUE.layout.index("wake_channel")  # a burst wakes each model once, from its last job


@dataclass(slots=True)
class _Call:
    keys: list[str]
    args: list[Any]
    done: asyncio.Future[int]
    writes: Sequence[Command] = ()


class Enqueuer:
    """Runs the ENQUEUE script for concurrent callers: one pipeline at a time, carrying every waiting call."""

    def __init__(self, redis: Redis) -> None:
        self.pool = redis.connection_pool  # its settings (address, timeouts, retries) make our connection
        self.sha = ENQUEUE.sha
        self.round_trips = 0  # pipelines sent (tests and benchmarks read it)
        self._pending: list[_Call] = []
        self._sending: list[_Call] = []  # the calls of the pipeline in flight
        self._sender: asyncio.Task[None] | None = None
        self._conn: AbstractConnection | None = None

    async def enqueue(self, keys: list[str], args: list[Any], writes: Sequence[Command] = ()) -> int:
        """Store and queue one job: ENQUEUE's reply (1 queued, 0 id taken, -1 queue full, -2 the tenant's queue
        full); ``writes`` run just before it, in one transaction with it (a refused write raises, and nothing
        was queued). A caller cancelled before the send is dropped."""
        loop = asyncio.get_running_loop()
        call = _Call(keys, args, loop.create_future(), writes)
        self._pending.append(call)
        if self._sender is None:  # it starts next pass: every call made in this one rides along
            self._sender = loop.create_task(self._send_all())
        return await call.done

    async def aclose(self) -> None:
        """Wait for the sends in flight whose callers still wait for them, then close the connection. A send
        nobody waits for any more (its callers gave up on an unresponsive Redis) is cancelled, not awaited."""
        if self._sender is not None:
            if all(c.done.done() for c in self._sending + self._pending):
                self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.disconnect()

    async def _send_all(self) -> None:
        try:
            while True:
                calls = [c for c in self._pending if not c.done.done()]
                self._pending = []
                if not calls:
                    return
                self._sending = calls
                await self._send(calls)
                self._sending = []
        except BaseException:  # cancelled (the loop is closing): so are the calls that were still to go
            for c in self._pending:
                c.done.cancel()
            self._pending = []
            raise
        finally:
            self._sender, self._sending = None, []

    async def _send(self, calls: list[_Call]) -> None:
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
                c.done.set_result(int(r))

    async def _run(self, calls: list[_Call]) -> list[Any]:
        results = await self._evalsha(calls, writes=True)
        lost = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if lost:  # Redis restarted or flushed its scripts: load once, run the refused calls again (their writes
            # were made: a NOSCRIPT is an error of the transaction's last command, not of the transaction)
            await self._exchange([("SCRIPT", "LOAD", ENQUEUE.source)])
            for i, r in zip(lost, await self._evalsha([calls[i] for i in lost], writes=False)):
                results[i] = r
        return results

    async def _evalsha(self, calls: list[_Call], *, writes: bool) -> list[Any]:
        """Each call's ENQUEUE reply (or its error); with ``writes``, a call that has some runs them first, in
        one MULTI/EXEC with its ENQUEUE."""
        self.round_trips += 1
        last = {c.args[_WAKE]: i for i, c in enumerate(calls)}  # each wake channel's last call wakes it
        commands: list[Command] = []
        for i, c in enumerate(calls):
            args = c.args if last[c.args[_WAKE]] == i else [*c.args[:_WAKE], "", *c.args[_WAKE + 1:]]
            enqueue = ("EVALSHA", self.sha, len(c.keys), *c.keys, *args)
            commands += [("MULTI",), *c.writes, enqueue, ("EXEC",)] if writes and c.writes else [enqueue]
        replies = iter(await self._exchange(commands))
        return [_transaction([next(replies) for _ in range(len(c.writes) + 3)]) if writes and c.writes
                else next(replies) for c in calls]

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in one write and read their replies (a refused command's reply is its error),
        retrying on connection errors as the pool's settings say."""
        if self._conn is None:
            self._conn = self.pool.make_connection()
        conn = self._conn

        async def exchange() -> list[Any]:
            await conn.send_packed_command(_packed(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies

        async def fail(error: Exception) -> None:
            await conn.disconnect()
            if conn.retry_on_error is None or not isinstance(error, tuple(conn.retry_on_error)):
                raise error

        try:
            result: list[Any] = await conn.retry.call_with_retry(exchange, fail)
        except BaseException:  # failed or cancelled mid-exchange: replies may still be due on it, never reuse it
            if self._conn is conn:
                self._conn = None
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
            raise
        return result


def _transaction(replies: list[Any]) -> Any:
    """ENQUEUE's reply (or the error to raise) from a MULTI, its writes, ENQUEUE and EXEC's replies."""
    refused = next((r for r in replies[:-1] if isinstance(r, Exception)), None)
    done = replies[-1]
    if refused is not None or isinstance(done, Exception):  # EXECABORT: the first refusal says why
        return refused or done
    failed = next((r for r in done[:-1] if isinstance(r, Exception)), None)
    return failed or done[-1]


def _packed(commands: list[tuple[Any, ...]]) -> bytes:
    """``commands`` in Redis's protocol (RESP), in one buffer. Their arguments are str, bytes or int."""
    out = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)
