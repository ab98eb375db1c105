"""A server-sent event stream as a Starlette response: frames (whole events, bytes) written as they come.

Each frame is one ASGI ``send``. A stream runs in its request's task and costs one task more: a watcher that
waits for the client to go away (and writes a comment line every ``PING_S``, so proxies keep a quiet
connection). sse-starlette's ``EventSourceResponse`` runs four tasks per stream and a cancel scope per send,
which a gateway streaming many short answers pays on every one. What the gateway needs of it stays: the stream
ends when its frames end, and its frames' iterator is closed (its job cancelled) when the client disconnects or
the server shuts down (:meth:`Streams.close_all`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["EventStream", "Last", "Streams"]

PING_S = 15.0  # a comment line this often (sse-starlette's interval)
_PING = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}
_END = {"type": "http.response.body", "body": b"", "more_body": False}


class Last(bytes):
    """A stream's last frame: it goes out with the end of the body, in one write (each write is a system call,
    and a wake-up of the reader)."""

    __slots__ = ()


class Streams:
    """The open streams of one gateway process, so a shutdown can end them all at once."""

    def __init__(self) -> None:
        self._open: set[EventStream] = set()

    def add(self, stream: EventStream) -> None:
        self._open.add(stream)

    def discard(self, stream: EventStream) -> None:
        self._open.discard(stream)

    def close_all(self) -> int:
        """End every open stream (its frames' iterator is closed); how many there were."""
        for stream in self._open:
            stream.cut()
        return len(self._open)

    def __len__(self) -> int:
        return len(self._open)


class EventStream(Response):
    """``text/event-stream``: ``frames`` written one ``send`` each, then the end of the body (with a :class:`Last`
    frame, if one comes; nothing after it is sent). ``background`` runs after the stream, however it ended (also
    when its frames never started)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncGenerator[bytes, None], streams: Streams, *,
                 headers: Mapping[str, str] | None = None, background: BackgroundTask | None = None) -> None:
        self.frames = frames
        self.streams = streams
        self.status_code = 200
        self.background = background
        self._task: asyncio.Task[object] | None = None
        self._ended = False  # the body's end was sent
        self._cut = False  # ended early (cut): the client went away, or the server shuts down
        # As sse-starlette sends them: no cache may keep the stream, no proxy may buffer it.
        self.init_headers({"cache-control": "no-store", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        task = self._task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.ensure_future(self._watch(receive, send))
        self.streams.add(self)
        try:
            await self._write(send)
        except asyncio.CancelledError:
            if not self._cut or task.uncancel() > 0:  # cancelled by another (the server) too
                raise
        except OSError:  # the client went away mid-write
            pass
        finally:
            self.streams.discard(self)
            watcher.cancel()
            if not self._ended:  # the body ends here (a no-op for a client that went away)
                with contextlib.suppress(OSError):
                    await send(_END)
            if self.background is not None:
                await self.background()

    def cut(self) -> None:
        """End the stream now: its frames' iterator is closed where it waits (its job cancelled). Once its body
        has ended, the frames may finish."""
        if self._task is not None and not self._ended and not self._cut:
            self._cut = True
            self._task.cancel()

    async def _write(self, send: Send) -> None:
        async with contextlib.aclosing(self.frames) as frames:
            async for frame in frames:  # after the last frame, to the iterator's end
                if not self._ended:
                    last = isinstance(frame, Last)
                    await send({"type": "http.response.body", "body": frame, "more_body": not last})
                    self._ended = last
        if not self._ended:
            await send(_END)
            self._ended = True

    async def _watch(self, receive: Receive, send: Send) -> None:
        """Cuts the stream when the client disconnects (the request body was read: nothing else can arrive;
        after the body's end, the server reports a disconnect too); a comment line goes out after each
        ``PING_S`` of waiting."""
        while True:
            try:
                async with asyncio.timeout(PING_S):
                    if (await receive())["type"] == "http.disconnect":
                        break
            except TimeoutError:
                await send(_PING)
        self.cut()
