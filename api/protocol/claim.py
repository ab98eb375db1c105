"""CLAIM: a worker claims due jobs of its queues in one call (``lua/claim.lua``, with its parts ``share``,
``outranking`` and ``affinity``), and what it did with each queue entry it looked at.

Each queue is taken up to its quota (its engine's room), lowest score first across the queues; each started job
takes a lease whose token names the run (``<worker id>:<try>``); only here is the try counted, so tries count runs
that started. A tenant's queued jobs wait for their fair share (``lua/share.lua``), a full engine takes only a job
that outranks its running sequences or one of a tenant below its share there, and a tenant's read entries are
taken in the order prefix affinity prefers (``lua/affinity.lua``). A model's bulk queues (``GenerateRequest.bulk``,
``lua/bulk.lua``) share its quota and give way to its interactive ones: a bulk job starts only on room no
interactive job could take.
"""

from __future__ import annotations

import enum
import re
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from ..affinity import MAX_KEYS
from ..schema import PRIORITY_MIN, Event, decode_event
from ..tenants import SHARE_TTL_S
from .keys import Keys, model_band
from .scripts import Layout, load

__all__ = ["CLAIM", "EPOCH_TTL_S", "TRIES_TTL_S", "Affinity", "BelowShare", "Due", "DueEntry", "EntryStatus",
           "Outranking", "claim"]

EPOCH_TTL_S = 7 * 86_400  # refreshed at every claim
TRIES_TTL_S = 86_400  # a job's record lives at most this long too (api.client.JOB_TTL_MS)
_TAIL = 128  # a job record's last bytes CLAIM reads for its affinity keys (affinity.lua's KEYS_TAIL)
_READ_MIN = 16  # due entries CLAIM reads per queue, at least (poison and deferred entries may come first)

CLAIM = load("claim", Layout(
    keys=("running_key", "epoch_key", "deadlines_key"), key_tail="model_queues",
    args=("now_ms", "most_jobs", "worker_id", "lease_ms", "prefix", "new_epoch", "read_limit", "affinity_wait_ms"),
    arg_tail="per_queue", row=("quota", "outrank", "below_share"),
), {
    "EPOCH_TTL_S": EPOCH_TTL_S, "TRIES_TTL_S": TRIES_TTL_S, "SHARE_TTL_S": SHARE_TTL_S, "PRIORITY_MIN": PRIORITY_MIN,
    "OUTRANK_READ": 128,  # queue entries CLAIM looks through for a job that outranks a full engine
    "MEAN_WORK": 256,  # tokens a tenant's job is assumed to cost before one of its jobs ends
    "MAX_KEYS": MAX_KEYS,  # affinity keys CLAIM looks at per job (a record carries no more)
    "KEYS_TAIL": _TAIL,  # room for MAX_KEYS keys and the enqueue time
})


class EntryStatus(enum.Enum):
    """What CLAIM did with one due queue entry."""

    STARTED = "started"
    DEFERRED = "deferred"  # another run still holds its lease: left queued, due later, no try counted
    GONE = "gone"  # queued, but its record is gone (expired or lost): for REJECT
    POISON = "poison"  # the queue entry is no job id a producer makes: for REJECT


class Affinity(enum.Enum):
    """How CLAIM's prefix affinity placed a started job (one with an affinity key): on a worker whose prefix cache
    has its key warm, elsewhere once it waited past the bound for the live one that has, or where no live worker
    had it."""

    HOLDER = "holder"
    ELSEWHERE = "elsewhere"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class DueEntry:
    """One due queue entry, as CLAIM left it; ``job``, ``attempt``, ``last`` and ``cancelled`` only when started.
    ``tenant``: whose queue it was in (CLAIM read it with the entry); ``model`` and ``bulk``: whose queue and which
    band (its queue's name, read once here)."""

    rid: str
    queue: str
    status: EntryStatus
    epoch: str
    entry: bytes = b""  # the queue entry as stored (a poison one may not be text)
    job: bytes = b""
    attempt: int = 0
    last: Event | None = None  # the job's last logged event (an earlier run's)
    cancelled: bool = False
    affinity: Affinity | None = None  # None: affinity did not place it (no key, affinity off, or outranking)
    tenant: str = ""
    model: str = ""
    bulk: bool = False


@dataclass(frozen=True, slots=True)
class Outranking:
    """What a queued job needs for a full engine to take it: at least ``priority`` (it then starts at once,
    preempting a running sequence of lower priority). A job of lower priority that only waited long is left
    for room: once claimed it would preempt nobody."""

    priority: int
    aging_ms: int
    count: int = 1  # jobs that would start at once: one per running sequence of the lowest priority

    def arg(self) -> str:
        """As CLAIM takes it (it recovers a queued job's priority from its score: ``keys.queue_score``)."""
        return f"{self.priority} {self.aging_ms}"


@dataclass(frozen=True, slots=True)
class BelowShare:
    """What a queued job's tenant must be for a full engine to take it: below its share of the batch
    (engine/core/shares.py), its load there once the job runs, (running there + 1) ÷ its weight, at most ``spare``
    (the most loaded running tenant's load less one job); it then starts at once in that tenant's place.
    ``running``: each tenant's jobs running in that engine."""

    spare: float
    running: dict[str, int]

    def arg(self) -> str:
        """As CLAIM takes it: "<spare> <tenant> <running> ..." (a tenant's name has no space)."""
        return " ".join([repr(self.spare), *(f"{t} {n}" for t, n in self.running.items())])


@dataclass(frozen=True, slots=True)
class Due:
    """What one CLAIM call did: an entry per due queue entry it looked at, and whether it left due jobs queued
    (``left_interactive``: jobs not of a bulk band among them)."""

    entries: list[DueEntry]
    left: bool
    left_interactive: bool = False


async def claim(redis: Redis, keys: Keys, worker_id: str, lease_ms: int, affinity_wait_ms: int,
                quotas: dict[str, int], most: int, outranking: dict[str, Outranking] | None = None,
                below_share: dict[str, BelowShare] | None = None) -> Due:
    """Claim up to ``most`` due jobs, lowest score first across the queues, each queue up to its quota; from a
    queue in ``outranking``, only jobs of at least its priority (up to its quota); from a queue in
    ``below_share``, jobs of the tenants below their share in its full engine (and the others' by priority, if
    it is in ``outranking`` too). ``affinity_wait_ms``: how long a job waits for the live worker with its prefix
    warm (< 0: affinity off). A model's bulk queue (``Keys.queue(model, bulk=True)``) shares its quota with the
    model's interactive queue: pass both with the same quota (CLAIM reads it after them)."""
    queues = sorted(quotas, key=lambda q: model_band(keys.queue_of(q)[0])[1])  # bulk queues last (a stable sort)
    outranking, below_share = outranking or {}, below_share or {}
    rows: list[object] = []
    for q in queues:
        rows += (quotas[q], outranking[q].arg() if q in outranking else "",
                 below_share[q].arg() if q in below_share else "")
    args = {"now_ms": int(time.time() * 1000), "most_jobs": most, "worker_id": worker_id, "lease_ms": lease_ms,
            "prefix": keys.prefix, "new_epoch": uuid.uuid4().hex, "read_limit": max(_READ_MIN, 2 * most),
            "affinity_wait_ms": affinity_wait_ms}
    named = {"running_key": keys.running(), "epoch_key": keys.epoch(), "deadlines_key": keys.deadlines()}
    epoch, left, *found = await CLAIM.run(redis, named, args, queues, rows)
    return Due([_due_entry(row, epoch.decode(), keys) for row in found], bool(left), int(left) == 2)


def _due_entry(row: list[bytes], epoch: str, keys: Keys) -> DueEntry:
    rid, queue, status = row[0].decode(errors="backslashreplace"), row[1].decode(), EntryStatus(row[2].decode())
    model, bulk = model_band(keys.queue_of(queue)[0])
    if status is not EntryStatus.STARTED:
        return DueEntry(rid, queue, status, epoch, row[0], tenant=row[3].decode(), model=model, bulk=bulk)
    _score, job, attempt, last, cancelled, placed, tenant = row[3:]
    return DueEntry(rid, queue, status, epoch, row[0], job, int(attempt), decode_event(last) if last else None,
                    bool(cancelled), _placed(placed, job), tenant.decode(), model, bulk)


_KEYED = re.compile(rb'"ak":"[0-9a-fA-F,]+","et":\d+}$')  # a job record's tail with affinity keys (jobrecord)


def _placed(placed: bytes, job: bytes) -> Affinity | None:
    """CLAIM's affinity outcome; "?": nobody advertised for the model, so a keyed job counts "none" (told here, from
    the record CLAIM returns, rather than by one more read in the script)."""
    if placed == b"?":
        return Affinity.NONE if _KEYED.search(job, max(0, len(job) - _TAIL)) else None
    return Affinity(placed.decode()) if placed else None
