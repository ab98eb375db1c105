"""Stored responses (OpenAI's Responses API): one Redis hash per response, under the deployment's prefix.

A response is one job (its id is ``resp_<job id>``), so its record shares the job's hash tag and lives in the
job's Redis Cluster slot: ``<prefix>:{<job id>}:response``. Every gateway of the fleet reads the same records,
so a response created by one is retrieved, cancelled or continued (``previous_response_id``) through another,
and a gateway's restart loses nothing. The hash holds:

- ``meta``: what the response was created with (its tenant, background or not, its input items, the chain's
  root, the response object as created): written once;
- ``status``: ``queued`` or ``in_progress`` until it ends, then its terminal status;
- ``final`` and ``steps``: the final response object and what its stream was made of, written once, by the
  first gateway to see the job end (:meth:`ResponseStore.settle`): from then on the response no longer depends
  on the job's own keys, which expire minutes after its end.

Every write sets the record's TTL to the retention (``MLXQ_RESPONSE_RETENTION``, 30 days by default, as
OpenAI keeps stored responses).

Where a job's end is read is :func:`job_events`: its log while it runs and minutes after, then its kept result.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .client import Client
from .connection import with_retries
from .follow import kept_events
from .protocol.enqueuer import Command
from .protocol.jobrecord import read_result
from .schema import Event, decode_event

__all__ = ["RESPONSE_ID_PREFIX", "TERMINAL", "ResponseStore", "StoredResponse", "job_events", "job_id_of",
           "response_id_of"]

RESPONSE_ID_PREFIX = "resp_"
TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
_ID = re.compile(r"^resp_([A-Za-z0-9_.:-]{1,64})$")

# Settle a response: KEYS the record. ARGV: status, final JSON, steps JSON, TTL s. 1: settled now; 0: it was
# settled already (another gateway was first); -1: no such record (deleted, or expired).
_SETTLE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'final', ARGV[2], 'steps', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


def response_id_of(job_id: str) -> str:
    """The response id of the job ``job_id``."""
    return RESPONSE_ID_PREFIX + job_id


def job_id_of(response_id: str) -> str | None:
    """The job id a response id names; None for what no response of ours is called."""
    m = _ID.match(response_id)
    return m.group(1) if m else None


@dataclass(slots=True)
class StoredResponse:
    """A response as stored: what it was created with, and its end once settled."""

    id: str
    tenant: str
    background: bool
    created: dict[str, Any]  # the response object as created (status queued or in_progress, no output)
    input_items: list[dict[str, Any]]  # its own input items, each with an id
    root: str  # the first response of its previous_response_id chain (its own id for the first)
    calls_tools: bool = False  # whether its job parses tool calls (how its text is streamed)
    status: str = "queued"
    final: dict[str, Any] | None = None  # the final response object, once settled
    steps: list[Any] = field(default_factory=list)  # what its stream was made of, once settled

    @property
    def job_id(self) -> str:
        job = job_id_of(self.id)
        assert job is not None
        return job

    @property
    def settled(self) -> bool:
        return self.final is not None

    def meta_json(self) -> str:
        return json.dumps({"tenant": self.tenant, "background": self.background, "created": self.created,
                           "input": self.input_items, "root": self.root, "calls_tools": self.calls_tools},
                          separators=(",", ":"))


class ResponseStore:
    """The stored responses of one deployment, read and written through ``client``'s connection."""

    def __init__(self, client: Client, retention_s: int) -> None:
        self.client = client
        self.retention_s = retention_s
        self._settle = client.redis.register_script(_SETTLE)

    def _key(self, response_id: str) -> str | None:
        job = job_id_of(response_id)
        return None if job is None else self.client.keys.response(job)

    def creation(self, response: StoredResponse) -> list[Command]:
        """The writes of a new response's record, for its job's submit to make just before it queues the job
        (``Client.submit``'s ``writes``: one round trip, one transaction), so any gateway finds it once the job
        exists. In one transaction with its EXPIRE (the record never lives without its TTL); each field only if
        absent: a submit retried after its reply was lost must not set back a status recorded since."""
        key = self._key(response.id)
        assert key is not None
        return [("HSETNX", key, "meta", response.meta_json()), ("HSETNX", key, "status", response.status),
                ("EXPIRE", key, self.retention_s)]

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response, if it exists and is ``tenant``'s (another tenant's is as good as absent)."""
        key = self._key(response_id)
        if key is None:
            return None
        fields: dict[bytes, bytes] = await self._retried(lambda: self.client.redis.hgetall(key))
        if b"meta" not in fields:
            return None
        meta = json.loads(fields[b"meta"])
        if meta["tenant"] != tenant:
            return None
        final = fields.get(b"final")
        return StoredResponse(response_id, meta["tenant"], meta["background"], meta["created"], meta["input"],
                              meta["root"], meta.get("calls_tools", False), fields[b"status"].decode(),
                              json.loads(final) if final else None, json.loads(fields.get(b"steps", b"[]")))

    async def settle(self, response: StoredResponse, final: dict[str, Any], steps: list[Any]) -> bool:
        """Record the response's end, once: True for the call that recorded it (the first to see the job end),
        False when another had (or the record is gone). ``response`` is updated either way."""
        key = self._key(response.id)
        assert key is not None
        args = [final["status"], json.dumps(final, separators=(",", ":")), json.dumps(steps, separators=(",", ":")),
                self.retention_s]
        outcome = await self._retried(lambda: self._settle([key], args, client=self.client.redis))
        response.status, response.final, response.steps = final["status"], final, steps
        return bool(outcome == 1)

    async def delete(self, response_id: str) -> bool:
        key = self._key(response_id)
        return key is not None and bool(await self._retried(lambda: self.client.redis.delete(key)))

    async def _retried(self, op: Any) -> Any:
        return await with_retries(op, self.client.retry, self.client.where)


async def job_events(client: Client, job_id: str) -> list[Event] | None:
    """Every event job ``job_id`` has logged so far, in order ([] while it waits in its queue); once its log
    expired, the events its kept result makes (``Client.kept``: hours after its end); None when the queue no
    longer knows it (neither queued, running, logged nor kept).

    The one place a response reads its job's end after the fact."""
    redis, keys = client.redis, client.keys

    async def read() -> tuple[Any, int, bytes | None]:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.xrange(keys.log(job_id))
            pipe.exists(keys.job(job_id))
            pipe.get(keys.result(job_id))
            entries, queued, kept = await pipe.execute()
        return entries, queued, kept

    entries, queued, kept = await with_retries(read, client.retry, client.where)
    if not entries and kept is not None:
        with contextlib.suppress(ValueError):
            return kept_events(job_id, read_result(kept))
    if not entries and not queued:
        return None
    return [decode_event(fields[b"e"]) for _, fields in entries]
