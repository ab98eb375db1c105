"""OpenAI's files, kept in the queue's Redis: a batch's input, and the output and error files it writes.

A file's bytes are a Redis list of chunks of about :data:`CHUNK_BYTES`, each ending at a line's end (a longer
line is one chunk), beside a hash holding OpenAI's file object, its owner (the tenant) and each chunk's line
count, so line ``i`` is one ``LINDEX`` away. Every key of a file carries a TTL (``FileLimits.retention_s``):
nothing outlives it without a service of its own to clean up. The bytes cost Redis about their size (measured:
deploy/README.md).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .errors import BadRequest, NotFound
from .protocol.keys import Keys

__all__ = ["CHUNK_BYTES", "FileLimits", "FileStore", "chunked", "new_file_id"]

CHUNK_BYTES = 1 << 20  # a chunk: one Redis string, read whole by whoever needs one of its lines
PURPOSES = ("batch", "batch_output", "batch_error")
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's batch input limit
DEFAULT_MAX_LINES = 50_000  # OpenAI's: requests per batch
DEFAULT_RETENTION_S = 30 * 86_400  # OpenAI's batch files expire after 30 days


@dataclass(frozen=True, slots=True)
class FileLimits:
    """What an upload may be: its bytes and lines; how long a file is kept."""

    max_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_lines: int = DEFAULT_MAX_LINES
    retention_s: int = DEFAULT_RETENTION_S


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def chunked(data: bytes, size: int = CHUNK_BYTES) -> tuple[list[bytes], list[int]]:
    """``data`` cut into chunks of about ``size`` bytes at line ends, and each chunk's line count (a last line
    without its newline counts)."""
    chunks: list[bytes] = []
    lines: list[int] = []
    start = 0
    while start < len(data):
        end = start + size
        if end < len(data):
            nl = data.rfind(b"\n", start, end)
            if nl < 0:  # one line longer than a chunk: the chunk is that line
                nl = data.find(b"\n", end)
            end = len(data) if nl < 0 else nl + 1
        chunk = data[start:end]
        chunks.append(chunk)
        lines.append(chunk.count(b"\n") + (0 if chunk.endswith(b"\n") else 1))
        start = end
    return chunks, lines


class FileStore:
    """Files of one deployment, each its tenant's: another tenant's id is :class:`NotFound`, as an unknown one."""

    def __init__(self, redis: Redis, keys: Keys, limits: FileLimits | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.limits = limits or FileLimits()

    async def create(self, data: bytes, filename: str, purpose: str, tenant: str, *,
                     file_id: str | None = None, expires_after_s: int | None = None) -> dict[str, Any]:
        """Store ``data``; OpenAI's file object. An upload (``purpose`` batch) over the limits is a
        :class:`BadRequest`; ``file_id`` names a file written by the queue (a batch's output: writing it again
        replaces it)."""
        if purpose not in PURPOSES:
            raise BadRequest(f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}")
        chunks, lines = chunked(data)
        if purpose == "batch":
            self.check(len(data), sum(lines))
        now = int(time.time())
        ttl_s = expires_after_s or self.limits.retention_s
        fid = file_id or new_file_id()
        record = {"id": fid, "object": "file", "bytes": len(data), "created_at": now, "filename": filename,
                  "purpose": purpose, "status": "processed", "expires_at": now + ttl_s, "status_details": None}
        fields = {"object": json.dumps(record), "tenant": tenant, "lines": json.dumps(lines)}
        key, body = self.keys.file(fid), self.keys.file_chunks(fid)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(body)
            for i in range(0, len(chunks), 64):  # bounded commands: a 200 MB file is 200 chunks
                pipe.rpush(body, *chunks[i:i + 64])
            pipe.hset(key, mapping=fields)
            pipe.expire(key, ttl_s)
            pipe.expire(body, ttl_s)
            pipe.zadd(self.keys.files(tenant), {fid: now * 1000})
            await pipe.execute()
        return record

    def check(self, size: int, lines: int) -> None:
        """A :class:`BadRequest` for a batch input over the limits."""
        if size > self.limits.max_bytes:
            raise BadRequest(f"the file has {size} bytes; the limit is {self.limits.max_bytes} "
                             "(MLXQ_BATCH_MAX_FILE_BYTES)")
        if lines > self.limits.max_lines:
            raise BadRequest(f"the file has {lines} lines; the limit is {self.limits.max_lines} "
                             "(MLXQ_BATCH_MAX_LINES)")

    async def get(self, file_id: str, tenant: str) -> dict[str, Any]:
        """OpenAI's file object; :class:`NotFound` for an unknown id or another tenant's file."""
        owner, obj = await self.redis.hmget(self.keys.file(file_id), ["tenant", "object"])  # type: ignore[misc]
        if obj is None or owner is None or owner.decode() != tenant:
            raise NotFound(f"no file with id {file_id!r}")
        return dict(json.loads(obj))

    async def line_counts(self, file_id: str) -> list[int]:
        """Each chunk's line count."""
        return (await self.layout(file_id))[1]

    async def layout(self, file_id: str) -> tuple[int, list[int]]:
        """A file's size in bytes and each chunk's line count."""
        obj, lines = await self.redis.hmget(self.keys.file(file_id), ["object", "lines"])  # type: ignore[misc]
        if obj is None or lines is None:
            raise NotFound(f"no file with id {file_id!r}")
        return int(json.loads(obj)["bytes"]), list(json.loads(lines))

    async def chunk(self, file_id: str, index: int) -> bytes:
        """Chunk ``index`` of a file's bytes."""
        data = await self.redis.lindex(self.keys.file_chunks(file_id), index)  # type: ignore[misc]
        if data is None:
            raise NotFound(f"file {file_id!r} has no chunk {index} (it expired?)")
        return bytes(data)

    async def content(self, file_id: str, tenant: str) -> AsyncIterator[bytes]:
        """A file's bytes, chunk by chunk."""
        await self.get(file_id, tenant)
        n = await self.redis.llen(self.keys.file_chunks(file_id))  # type: ignore[misc]
        for i in range(n):
            yield await self.chunk(file_id, i)

    async def delete(self, file_id: str, tenant: str) -> dict[str, Any]:
        """Remove a file; OpenAI's deletion object."""
        await self.get(file_id, tenant)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.file(file_id), self.keys.file_chunks(file_id))
            pipe.zrem(self.keys.files(tenant), file_id)
            await pipe.execute()
        return {"id": file_id, "object": "file", "deleted": True}

    async def listing(self, tenant: str, *, after: str | None = None, limit: int = 10_000, order: str = "desc",
                   purpose: str | None = None) -> dict[str, Any]:
        """One page of a tenant's files (OpenAI's list object); entries whose file expired are dropped."""
        ids = await _page_ids(self.redis, self.keys.files(tenant), after, order)
        data: list[dict[str, Any]] = []
        gone: list[str] = []
        for fid in ids:
            if len(data) > limit:
                break
            try:
                obj = await self.get(fid, tenant)
            except NotFound:
                gone.append(fid)
                continue
            if purpose is None or obj["purpose"] == purpose:
                data.append(obj)
        if gone:
            await self.redis.zrem(self.keys.files(tenant), *gone)
        return page(data, limit)


async def _page_ids(redis: Redis, index: str, after: str | None, order: str) -> list[str]:
    """The ids of an index (a zset by creation) after ``after``, newest first for ``desc``."""
    raw = await (redis.zrevrange(index, 0, -1) if order == "desc" else redis.zrange(index, 0, -1))
    ids = [r.decode() for r in raw]
    if after is not None and after in ids:
        ids = ids[ids.index(after) + 1:]
    return ids


def page(data: Sequence[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page of ``data`` (read one past ``limit``, to say whether there is more)."""
    shown = list(data[:limit])
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(data) > limit}
