"""A worker's upkeep calls: its leases extended (REFRESH), running jobs whose lease expired found (SWEEP), queued
jobs past their expiry found (LAPSE), and queue entries no worker can run moved aside (REJECT).

- **refresh**: a run whose lease is gone is fenced: it writes nothing more.
- **reap** (SWEEP, then EMIT as the empty owner): a running job whose lease expired (its worker died or froze) is
  handed back with a reset, or ended on its last try.
- **lapse** (LAPSE, then EMIT as the empty owner, write ``x``): a job still queued past its expiry ends
  ``error(expired)``, or ``done(cancelled)`` if a cancel waits; taking it out of its queue decides a race with a
  worker claiming it.
- **reject**: a queue entry no worker can run goes to the dead-letter list.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from ..tenants import SHARE_TTL_S
from .keys import Keys
from .scripts import Layout, load

__all__ = ["LAPSE", "REFRESH", "REJECT", "SWEEP", "Lapsed", "Lost", "lapsed", "refresh", "reject", "sweep"]

REFRESH = load("refresh", Layout(args=("lease_ms", "prefix"), arg_tail="leases", row=("rid", "token")))
SWEEP = load("sweep", Layout(keys=("running_key",), args=("prefix",)), {"SHARE_TTL_S": SHARE_TTL_S})
LAPSE = load("lapse", Layout(keys=("deadlines_key",), args=("now_ms", "prefix")), {"LAPSED_PER_SWEEP": 500})
REJECT = load("reject", Layout(keys=("queue_key", "dead_key"), arg_tail="rejected", row=("entry", "record")),
              {"DEAD_LETTERS_KEPT": 1000, "DEAD_LETTER_TTL_S": 7 * 86_400})


@dataclass(frozen=True, slots=True)
class Lost:
    """A running job whose lease expired, as SWEEP read it."""

    rid: str
    queue: str
    next_seq: int
    tries: int
    has_record: bool


@dataclass(frozen=True, slots=True)
class Lapsed:
    """A queued job whose expiry passed, as LAPSE read it."""

    rid: str
    queue: str
    next_seq: int
    enqueue_ms: int  # 0 if its record is gone
    cancelled: bool


async def refresh(redis: Redis, keys: Keys, lease_ms: int, leases: Sequence[tuple[str, str]]) -> list[bool]:
    """Extend each ``(rid, token)`` lease still held by that token; whether each was."""
    rows: list[str] = [v for lease in leases for v in lease]
    return [r == 1 for r in await REFRESH.run(redis, {}, {"lease_ms": lease_ms, "prefix": keys.prefix}, rows=rows)]


async def sweep(redis: Redis, keys: Keys) -> list[Lost]:
    """Running jobs (of any queue) whose lease expired."""
    rows = await SWEEP.run(redis, {"running_key": keys.running()}, {"prefix": keys.prefix})
    return [Lost(rid.decode(), queue.decode(), int(seq), int(tries), bool(has)) for rid, queue, seq, tries, has in rows]


async def lapsed(redis: Redis, keys: Keys) -> list[Lapsed]:
    """Queued jobs (of any queue) whose expiry passed."""
    args = {"now_ms": int(time.time() * 1000), "prefix": keys.prefix}
    rows = await LAPSE.run(redis, {"deadlines_key": keys.deadlines()}, args)
    return [Lapsed(rid.decode(), queue.decode(), int(seq), int(et), bool(c)) for rid, queue, seq, et, c in rows]


async def reject(redis: Redis, keys: Keys, worker_id: str, queue: str, entries: Sequence[bytes | str],
                 reason: str) -> int:
    """Move entries of ``queue`` aside to the dead-letter list; how many were still queued."""
    now = int(time.time() * 1000)
    rows: list[object] = []
    for entry in entries:
        raw = entry.encode() if isinstance(entry, str) else entry
        record = {"queue": queue, "entry": raw.decode(errors="backslashreplace"), "hex": raw.hex(),
                  "reason": reason, "at_ms": now, "worker": worker_id}
        rows += (raw, json.dumps(record))
    moved: int = await REJECT.run(redis, {"queue_key": queue, "dead_key": keys.dead_letters()}, {}, rows=rows)
    return moved
