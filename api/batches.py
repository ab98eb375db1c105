"""OpenAI's batches over the queue: the batch records, their statuses, and each line's outcome, in Redis.

A batch is a hash (``Keys.batch``): OpenAI's batch object's fields, its owner (the tenant), and the feeder's
cursor (``next``: the first line not yet fed). Its lines run as ordinary jobs of its tenant (fair share and
quotas hold between tenants' batches), fed by a feeder (``api/feeder.py``) a window at a time. Each line's
outcome is recorded once (``BATCH_RECORD``: a hash field per line, set if absent), whichever feeder, and however
many times, sees it; the output and error files are written from those records when the batch ends.

Statuses: ``validating`` → ``in_progress`` → ``finalizing`` → ``completed``; or ``failed`` (the file itself
is unusable), ``expired`` (its window passed: what finished is kept, the rest ``batch_expired``), and
``cancelling`` → ``cancelled`` (what finished is kept, the rest ``batch_cancelled``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from .errors import BadRequest, NotFound
from .files import FileStore, page
from .protocol.keys import Keys
from .protocol.scripts import Layout, load
from .schema import PRIORITY_MIN, GenerateRequest, as_bulk

__all__ = [
    "BATCH_PRIORITY", "ENDPOINTS", "OUTPUT_EXPIRY_S", "BatchStatus", "BatchStore", "banded", "error_line", "job_id",
    "jsonl", "output_expiry_s", "output_line",
]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
COMPLETION_WINDOWS = ("24h",)  # OpenAI's only one
OUTPUT_EXPIRY_S = (3600, 2_592_000)  # output_expires_after.seconds: an hour to 30 days (OpenAI's bounds)
MAX_METADATA = 16  # pairs; keys up to 64 characters, values up to 512 (OpenAI's)
# Batch jobs run in the bulk band (GenerateRequest.bulk: idle capacity only, preempted by interactive jobs), at
# the lowest priority a request may have (which orders them among the band's jobs only): chosen here alone, by
# :func:`banded`.
BATCH_PRIORITY = PRIORITY_MIN


class BatchStatus(str, Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})
_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")

RECORD = load("batch_record", Layout(keys=("results_key", "inflight_key", "batch_key"),
                                     args=("line", "kind", "entry", "input_tokens", "output_tokens")))
STATUS = load("batch_status", Layout(keys=("batch_key", "open_key"),
                                     args=("batch_id", "from", "to", "now_s", "fields", "terminal")))
LEASE = load("batch_lease", Layout(keys=("lease_key",), args=("feeder", "ttl_ms")))


def banded(request: GenerateRequest, job: str, tenant: str, expires_in: float | None) -> GenerateRequest:
    """A batch line's job: its deterministic id, its batch's tenant, the bulk band at the batch priority, and no
    longer than the batch's window to wait in a queue. The one place a batch job's band is chosen."""
    return as_bulk(request.model_copy(update={"id": job, "tenant": tenant, "priority": BATCH_PRIORITY,
                                              "expires_in": expires_in}))


def job_id(batch_id: str, line: int) -> str:
    """Line ``line``'s job id: the same whoever feeds it, so a line fed twice is one job (ENQUEUE refuses an id
    it knows)."""
    return f"{batch_id}.L{line}"


def output_line(batch_id: str, line: int, custom_id: str, job: str, body: Any, status_code: int = 200) -> str:
    """One line of the output file (OpenAI's format)."""
    return json.dumps({"id": _request_id(batch_id, line), "custom_id": custom_id,
                       "response": {"status_code": status_code, "request_id": job, "body": body}, "error": None},
                      separators=(",", ":"), ensure_ascii=False)


def error_line(batch_id: str, line: int, custom_id: str | None, code: str, message: str) -> str:
    """One line of the error file (OpenAI's format: no response, the error's code and message)."""
    return json.dumps({"id": _request_id(batch_id, line), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, separators=(",", ":"), ensure_ascii=False)


def _request_id(batch_id: str, line: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class BatchStore:
    """The batches of one deployment, each its tenant's (another tenant's id is :class:`NotFound`)."""

    def __init__(self, redis: Redis, keys: Keys, files: FileStore, completion_window_s: int = 86_400) -> None:
        self.redis = redis
        self.keys = keys
        self.files = files
        self.completion_window_s = completion_window_s  # what "24h" lasts (tests shorten it)

    async def create(self, input_file_id: str, endpoint: str, tenant: str, *, completion_window: str = "24h",
                     metadata: Mapping[str, str] | None = None,
                     output_expires_after: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A new batch of the lines of ``input_file_id`` (the tenant's, purpose ``batch``), validating: any
        feeder picks it up. ``output_expires_after`` (``{"anchor": "created_at", "seconds": N}``): its output and
        error files expire N seconds after each is written (else, and at most, after ``MLXQ_FILE_RETENTION``).
        A request OpenAI refuses is a :class:`BadRequest`."""
        if endpoint not in ENDPOINTS:
            raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}", param="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise BadRequest(f"completion_window must be '24h', not {completion_window!r}",
                             param="completion_window")
        _check_metadata(metadata)
        output_ttl_s = output_expiry_s(output_expires_after)
        if output_ttl_s:  # the operator's bound on what Redis keeps holds over the caller's
            output_ttl_s = min(output_ttl_s, self.files.limits.retention_s)
        file = await self.files.get(input_file_id, tenant)
        if file["purpose"] != "batch":
            raise BadRequest(f"file {input_file_id} has purpose {file['purpose']!r}; a batch's input has 'batch'")
        bid, now = new_batch_id(), time.time()
        fields = {"id": bid, "endpoint": endpoint, "input_file_id": input_file_id,
                  "completion_window": completion_window, "created_at": int(now),
                  "expires_at": int(now + self.completion_window_s), "status": BatchStatus.VALIDATING.value,
                  "metadata": json.dumps(dict(metadata or {})), "tenant": tenant, "next": 0, "total": 0,
                  "completed": 0, "failed": 0, **({"output_ttl_s": output_ttl_s} if output_ttl_s else {})}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.batch(bid), mapping=fields)  # type: ignore[arg-type]
            pipe.expire(self.keys.batch(bid), self.files.limits.retention_s)
            pipe.zadd(self.keys.batches(tenant), {bid: int(now * 1000)})
            pipe.sadd(self.keys.batches_open(), bid)
            await pipe.execute()
        return await self.get(bid, tenant)

    async def record(self, batch_id: str) -> dict[str, str]:
        """The batch's hash as text (empty: no such batch)."""
        raw = await self.redis.hgetall(self.keys.batch(batch_id))  # type: ignore[misc]
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def get(self, batch_id: str, tenant: str) -> dict[str, Any]:
        """OpenAI's batch object now (its counts live); :class:`NotFound` for an unknown or another's id."""
        rec = await self.record(batch_id)
        if not rec or rec.get("tenant") != tenant:
            raise NotFound(f"no batch with id {batch_id!r}")
        return batch_object(rec)

    async def listing(self, tenant: str, *, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """One page of the tenant's batches, newest first (OpenAI's list object)."""
        index = self.keys.batches(tenant)
        ids = [r.decode() for r in await self.redis.zrevrange(index, 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1:]
        data: list[dict[str, Any]] = []
        gone: list[str] = []
        for bid in ids:
            if len(data) > limit:
                break
            rec = await self.record(bid)
            if rec:
                data.append(batch_object(rec))
            else:
                gone.append(bid)
        if gone:
            await self.redis.zrem(index, *gone)
        return page(data, limit)

    async def cancel(self, batch_id: str, tenant: str) -> dict[str, Any]:
        """Ask a batch to stop: ``cancelling`` now, ``cancelled`` once its feeder has stopped its jobs (what
        finished is kept). An ended batch is a :class:`BadRequest`, as OpenAI's 409."""
        await self.get(batch_id, tenant)  # another tenant's: NotFound
        if not await self.move(batch_id, (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
                               BatchStatus.CANCELLING):
            now = await self.get(batch_id, tenant)
            if now["status"] not in (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
                raise BadRequest(f"batch {batch_id} is {now['status']}: it cannot be cancelled")
            return now
        return await self.get(batch_id, tenant)

    async def move(self, batch_id: str, frm: tuple[BatchStatus, ...], to: BatchStatus,
                   fields: Mapping[str, Any] | None = None) -> bool:
        """Move the batch to ``to`` if its status is one of ``frm`` (with ``fields`` set too); whether it moved."""
        moved = await STATUS.run(self.redis, {"batch_key": self.keys.batch(batch_id),
                                              "open_key": self.keys.batches_open()},
                                 {"batch_id": batch_id, "from": " ".join(s.value for s in frm), "to": to.value,
                                  "now_s": int(time.time()), "fields": json.dumps(dict(fields or {})),
                                  "terminal": "1" if to in TERMINAL else "0"})
        return bool(moved)

    async def results(self, batch_id: str, tenant: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """An ended batch's output and error lines, parsed (empty while it runs)."""
        obj = await self.get(batch_id, tenant)
        out = []
        for key in ("output_file_id", "error_file_id"):
            lines: list[dict[str, Any]] = []
            if obj.get(key):
                data = b"".join([c async for c in self.files.content(obj[key], tenant)])
                lines = [json.loads(line) for line in data.splitlines() if line.strip()]
            out.append(lines)
        return out[0], out[1]


def batch_object(rec: Mapping[str, str]) -> dict[str, Any]:
    """OpenAI's batch object from a batch's hash."""
    errors = json.loads(rec["errors"]) if rec.get("errors") else None
    usage = None
    if rec.get("input_tokens") or rec.get("output_tokens"):
        i, o = int(rec.get("input_tokens", 0)), int(rec.get("output_tokens", 0))
        usage = {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": o,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}
    obj: dict[str, Any] = {
        "id": rec["id"], "object": "batch", "endpoint": rec["endpoint"], "input_file_id": rec["input_file_id"],
        "completion_window": rec["completion_window"], "status": rec["status"],
        "created_at": int(rec["created_at"]), "expires_at": int(rec["expires_at"]),
        "output_file_id": rec.get("output_file_id") or None, "error_file_id": rec.get("error_file_id") or None,
        "errors": errors, "model": rec.get("model") or None, "metadata": json.loads(rec.get("metadata") or "{}"),
        "request_counts": {"total": int(rec.get("total", 0)), "completed": int(rec.get("completed", 0)),
                           "failed": int(rec.get("failed", 0))},
        "usage": usage,
    }
    for stamp in _STAMPS:
        obj[stamp] = int(rec[stamp]) if rec.get(stamp) else None
    return obj


def output_expiry_s(policy: Mapping[str, Any] | None) -> int | None:
    """The seconds ``output_expires_after`` gives a batch's output and error files (anchored at each file's
    creation, as OpenAI's); None: not given. One OpenAI refuses is a :class:`BadRequest` naming the field."""
    if policy is None:
        return None
    name = "output_expires_after"
    if not isinstance(policy, Mapping):
        raise BadRequest(f"Invalid type for '{name}': expected an object, but got {type(policy).__name__} instead.",
                         param=name, code="invalid_type")
    unknown = sorted(set(policy) - {"anchor", "seconds"})
    if unknown:
        raise BadRequest(f"Unknown parameter: '{name}.{unknown[0]}'.", param=f"{name}.{unknown[0]}",
                         code="unknown_parameter")
    for field in ("anchor", "seconds"):
        if field not in policy:
            raise BadRequest(f"Missing required parameter: '{name}.{field}'.", param=f"{name}.{field}",
                             code="missing_required_parameter")
    if policy["anchor"] != "created_at":
        raise BadRequest(f"Invalid value: {policy['anchor']!r}. Supported values are: 'created_at'.",
                         param=f"{name}.anchor", code="invalid_value")
    seconds, (low, high) = policy["seconds"], OUTPUT_EXPIRY_S
    where = f"'{name}.seconds'"
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise BadRequest(f"Invalid type for {where}: expected an integer, but got {type(seconds).__name__} "
                         "instead.", param=f"{name}.seconds", code="invalid_type")
    if seconds < low:
        raise BadRequest(f"Invalid {where}: integer below minimum value. Expected a value >= {low}, but got "
                         f"{seconds} instead.", param=f"{name}.seconds", code="integer_below_min_value")
    if seconds > high:
        raise BadRequest(f"Invalid {where}: integer above maximum value. Expected a value <= {high}, but got "
                         f"{seconds} instead.", param=f"{name}.seconds", code="integer_above_max_value")
    return seconds


def _check_metadata(metadata: Mapping[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA:
        raise BadRequest(f"metadata holds at most {MAX_METADATA} pairs")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise BadRequest("metadata: keys are strings of up to 64 characters, values of up to 512")


def jsonl(lines: Sequence[dict[str, Any] | bytes] | bytes | str | Path) -> bytes:
    """A batch's input as JSONL bytes: given as such, a JSONL file's path, or its lines (dicts or bytes)."""
    if isinstance(lines, bytes):
        return lines
    if isinstance(lines, str | Path):
        return Path(lines).read_bytes()
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
