"""A lean HTTP/1.1 client for the bench's gateway runs: keep-alive connections on asyncio streams, one POST
at a time each, reading a server-sent event stream.

Why not httpx: the client shares the machine's cores with the worker it measures, and httpx (pure-Python h11
under anyio) takes several times the CPU per streamed request that ``mlxq.api.client.Client`` takes, so the
bench would measure its client library more than the gateway. This client speaks only what the gateway and
``mlx_lm.server`` answer: a status line, headers, a chunked or sized body, or (HTTP/1.0) a body that ends when
the server closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["SseClient"]


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class SseClient:
    """POSTs JSON to one server and yields the ``data:`` payloads of its event-stream answers. A response read
    to its end hands its connection back for the next request (``opened`` counts the connections made)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.opened = 0
        self._idle: list[_Connection] = []

    async def events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of one streamed response, in order; raises on a status other than 200. Read
        it to its end: a response left unfinished closes its connection."""
        request = (b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), self.port, len(body), body))
        conn, (status, chunked, length, keep) = await self._send(request)
        reusable = False
        try:
            if status != 200:
                raw = await conn.reader.read(2000)
                raise RuntimeError(f"the gateway answered {status}: {raw[:500]!r}")
            pending = b""
            async for data in _body(conn.reader, chunked, length):
                pending += data
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            yield line[6:]
            reusable = keep
        finally:
            if reusable:
                self._idle.append(conn)
            else:
                conn.close()

    async def _send(self, request: bytes) -> tuple[_Connection, tuple[int, bool, int | None, bool]]:
        """Write ``request`` and read its response's head: on an idle connection if one is still open (the
        server closes those idle past its keep-alive timeout: then the request goes on a new one)."""
        while self._idle:
            conn = self._idle.pop()
            try:
                conn.writer.write(request)
                return conn, await _head(conn.reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                conn.close()
        conn = await self._connect()
        try:
            conn.writer.write(request)
            return conn, await _head(conn.reader)
        except BaseException:
            conn.close()
            raise

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self.opened += 1
        return _Connection(reader, writer)

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.writer.wait_closed()
        self._idle.clear()


async def _head(reader: asyncio.StreamReader) -> tuple[int, bool, int | None, bool]:
    """Status, chunked, content length and keep-alive of a response, its head read."""
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection")
    version, status_text = line.split(b" ", 2)[:2]
    status = int(status_text)
    chunked, length, keep = False, None, version != b"HTTP/1.0"  # HTTP/1.0 closes after each response
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"transfer-encoding":
            chunked = value == b"chunked"
        elif name == b"content-length":
            length = int(value)
        elif name == b"connection":
            keep = value != b"close"
    return status, chunked, length, keep


async def _body(reader: asyncio.StreamReader, chunked: bool, length: int | None) -> AsyncIterator[bytes]:
    if not chunked and length is None:  # to the end of the connection
        while data := await reader.read(1 << 16):
            yield data
        return
    if not chunked:
        yield await reader.readexactly(length or 0)
        return
    while size := int((await reader.readline()).split(b";", 1)[0], 16):
        yield await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readline()  # the empty trailer
