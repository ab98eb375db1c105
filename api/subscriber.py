"""One pub/sub connection shared by every event stream a client follows.

A web backend may follow thousands of jobs at once; a connection per job would cost Redis a client each
and the backend a reader task each. Here one reader task reads the shared connection and routes each
message to the queues of the streams following its channel. If the connection breaks, every stream is
told (its ``get`` raises), so it can replay what it missed from the job's log and subscribe again.

The pub/sub connection comes from a pool of its own, without redis-py's retries. redis-py's PubSub does not
serialize a command with ``aclose``: a SUBSCRIBE or UNSUBSCRIBE retrying after a break reconnected the
connection that ``aclose`` had just handed back to the pool commands share, and sent on it; the next
command taken from that pool read the stale ``unsubscribe`` reply (seen in the chaos test as an XRANGE that
failed to parse). Retries are not needed here: a break already makes every stream replay and subscribe anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Subscriber", "Subscription"]

log = logging.getLogger(__name__)
_BROKEN = object()  # queued to every subscription when the shared connection fails


_RETRY_KWARGS = ("retry", "retry_on_error", "retry_on_timeout")


def own_pubsub(redis: Redis) -> PubSub:
    """A PubSub on a one-connection pool of its own, with ``redis``'s address and timeouts, no retries."""
    shared = redis.connection_pool
    kwargs = {k: v for k, v in shared.connection_kwargs.items() if k not in _RETRY_KWARGS}
    pool = ConnectionPool(connection_class=shared.connection_class, max_connections=1, **kwargs)
    return PubSub(pool, ignore_subscribe_messages=True)


class Subscription:
    """Messages of one channel for one reader; close it when done."""

    def __init__(self, hub: Subscriber, channel: str) -> None:
        self.channel = channel
        self._hub = hub
        # Made on the loop it is read on: asking for the running loop at every wait costs a system call (getpid).
        self._loop = asyncio.get_running_loop()
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # One lazily re-armed timer instead of one per event: a timer scheduled and cancelled per message
        # stays in the loop's heap until its time comes, and every later timer pays for it.
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def put(self, data: Any) -> None:
        """Deliver a message (on the event loop)."""
        self._items.append(data)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout: float) -> bytes | None:
        """The next message, or None after ``timeout`` seconds; raises if the connection broke."""
        if not self._items:
            self._waiter = waiter = self._loop.create_future()
            self._deadline = self._loop.time() + timeout
            if self._timer is None or self._timer.when() > self._deadline:
                self._arm()
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._items:
                return None
        data = self._items.popleft()
        if data is _BROKEN:
            raise RedisConnectionError("the shared pub/sub connection was lost")
        return bytes(data)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._loop.time() >= self._deadline:
            waiter.set_result(None)
        else:
            self._arm()  # the reader waited again since: wait for its own deadline

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self._hub.release(self)


class Subscriber:
    """Routes messages from one pub/sub connection to per-channel subscriptions.

    Idle for ``idle_close_s`` (no subscription), it closes the connection and stops its reader: a client
    that submits bursts keeps one connection instead of opening one per burst (a connect and its set-up
    commands before each burst's enqueues).
    """

    idle_close_s = 5.0

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._subs: dict[str, set[Subscription]] = {}
        self._unsent: set[str] = set()  # channels with readers but no SUBSCRIBE sent yet
        self._batch: asyncio.Future[None] | None = None  # the next send of unsent channels, once scheduled
        self._sender: asyncio.Task[None] | None = None
        self._leaving: set[str] = set()  # channels whose last reader left, UNSUBSCRIBE not sent yet
        self._unsubscriber: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None  # closes an idle connection when it fires
        self._closer: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def open(self, channel: str) -> Subscription:
        """Subscribe to ``channel`` (the SUBSCRIBE is sent before this returns).

        Channels opened in the same burst go out in one command: concurrent submits taking turns on a lock,
        one SUBSCRIBE each, delayed the burst's enqueues.
        """
        sub = Subscription(self, channel)
        self._cancel_idle_close()
        if channel not in self._subs:
            self._unsent.add(channel)
        self._subs.setdefault(channel, set()).add(sub)
        if channel in self._unsent:
            try:
                await asyncio.shield(self._next_batch())
            except BaseException:
                self._forget(sub)
                raise
        return sub

    def _next_batch(self) -> asyncio.Future[None]:
        """The send that will carry the unsent channels; the first opener of a burst schedules it."""
        if self._batch is None:
            loop = asyncio.get_running_loop()
            self._batch = loop.create_future()
            self._sender = loop.create_task(self._send_batch(self._batch))
        return self._batch

    async def _send_batch(self, done: asyncio.Future[None]) -> None:
        # Serialized: concurrent first commands on a fresh PubSub would each take a pool connection.
        async with self._lock:
            self._batch = None  # openers from now on wait for the next send
            channels = sorted(self._unsent)
            try:
                if self._pubsub is None:
                    self._pubsub = own_pubsub(self.redis)
                if channels:
                    await self._pubsub.subscribe(*channels)
                self._unsent.difference_update(channels)
                # No SUBSCRIBE yet (its openers left before the send): no connection to read either.
                if self._pubsub.connection is not None and (self._reader is None or self._reader.done()):
                    self._reader = asyncio.create_task(self._read(self._pubsub))
            except asyncio.CancelledError:
                done.cancel()
                raise
            except Exception as exc:
                done.set_exception(exc)
                done.exception()  # its openers see it; never "exception was never retrieved"
                return
            done.set_result(None)

    def _forget(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.channel)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.channel]
                self._unsent.discard(sub.channel)

    async def release(self, sub: Subscription) -> None:
        """Stop delivering to ``sub``. Channels released in the same burst are unsubscribed in one command
        (one each would take the lock and a send per job)."""
        if sub not in self._subs.get(sub.channel, ()):
            return
        sent = sub.channel not in self._unsent
        self._forget(sub)
        if sub.channel in self._subs:
            return  # other readers still follow it
        if sent:
            self._leaving.add(sub.channel)
        if self._unsubscriber is None:
            self._unsubscriber = asyncio.get_running_loop().create_task(self._send_unsubscribes())

    async def _send_unsubscribes(self) -> None:
        async with self._lock:
            self._unsubscriber = None
            channels = sorted(c for c in self._leaving if c not in self._subs)  # not the ones opened again
            self._leaving.clear()
            if channels and self._pubsub is not None:
                with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
                    await self._pubsub.unsubscribe(*channels)
            if not self._subs and self._idle is None:
                self._idle = asyncio.get_running_loop().call_later(self.idle_close_s, self._close_if_idle)

    def _cancel_idle_close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _close_if_idle(self) -> None:
        self._idle = None
        self._closer = asyncio.get_running_loop().create_task(self._close_idle())

    async def _close_idle(self) -> None:
        async with self._lock:
            if not self._subs:  # nobody opened a subscription since the timer was set
                await self._drop_connection()

    async def _read(self, pubsub: PubSub) -> None:
        # The connection's own read rather than PubSub.get_message, whose health check, retry wrapper and
        # dict per message cost the client CPU on every message; replies other than messages
        # (subscribe confirmations) still go through redis-py's handler, which keeps its own books on them.
        conn = pubsub.connection  # made by the first SUBSCRIBE, which precedes this reader
        assert conn is not None
        while pubsub is self._pubsub:
            try:
                reply = await conn.read_response()  # blocks: no timer per message; close() cancels
                if not (isinstance(reply, list) and reply[0] == b"message"):
                    await pubsub.handle_message(reply, ignore_subscribe_messages=True)
                    continue
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("shared pub/sub connection lost: %r", exc)
                await self._break(pubsub)
                return
            channel = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            for sub in self._subs.get(channel, ()):
                sub.put(reply[2])

    async def _break(self, pubsub: PubSub) -> None:
        # Every stream replays from its log and subscribes again on a fresh connection.
        self._pubsub = None
        subs = [s for group in self._subs.values() for s in group]
        self._subs.clear()
        self._unsent.clear()
        self._leaving.clear()
        for sub in subs:
            sub.put(_BROKEN)
        await _close_pubsub(pubsub)

    async def aclose(self) -> None:
        """Stop reading and close the connection."""
        sender = self._sender
        if sender is not None and not sender.done():  # it holds the lock, maybe on a Redis that never answers
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        async with self._lock:
            await self._close()

    async def _close(self) -> None:
        self._cancel_idle_close()
        if self._batch is not None:  # openers still waiting for a send: there will be none
            self._batch.cancel()
            self._batch = None
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
        for task in (self._unsubscriber, self._closer):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self._unsubscriber = self._closer = None
        self._unsent.clear()
        self._leaving.clear()
        await self._drop_connection()

    async def _drop_connection(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if pubsub is not None:
            await _close_pubsub(pubsub)


async def _close_pubsub(pubsub: PubSub) -> None:
    with contextlib.suppress(Exception):
        await pubsub.aclose()
    await pubsub.connection_pool.aclose()
