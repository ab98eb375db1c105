"""EMIT: a worker's job events, one call per engine step for all its jobs (``lua/emit.lua``).

Each record carries one job's events and what the call does with the job beyond logging and publishing them
(:class:`Write`): append, end (its terminal event), hand back (a reset: queued again), lost (Redis lost its data
under it) or expire (it lapsed while queued). A run's one-event appends while its log's TTL is fresh travel apart,
as token appends: nothing to parse in Lua, no EXPIRE.

A job's keys are named in the script from the prefix and its id, as :class:`~.keys.Keys` names them
(``<prefix>:{<id>}:lease`` and so on), rather than passed as KEYS: redis-py packs every argument in Python, on the
event loop that shares the GIL with the engine, so a step's records travel as one argument. (So the scripts are
not Redis Cluster-ready.)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from .. import history
from ..tenants import SHARE_TTL_S
from .claim import TRIES_TTL_S
from .keys import DONE_TTL_S, LIVE_TTL_S, WEBHOOKS_KEPT, Keys
from .scripts import Layout, load

__all__ = ["EMIT", "LogTTL", "Write", "emit", "emit_record"]

APPENDS_PER_READ = 256  # token appends whose leases EMIT reads in one MGET (within Lua's unpack limit)

EMIT = load("emit", Layout(
    keys=("running_key", "epoch_key", "deadlines_key"),
    args=("count", "live_ttl_s", "done_ttl_s", "now_ms", "prefix", "records"),
    arg_tail="appends", row=("rid", "owner", "entry", "event"),
), {
    "SHARE_TTL_S": SHARE_TTL_S, "JOB_TTL_MS": TRIES_TTL_S * 1000, "APPENDS_PER_READ": APPENDS_PER_READ,
    "HIST_EDGES": history.EDGES_MS, "BUCKET_S": history.BUCKET_S, "HISTORY_TTL_S": history.HISTORY_TTL_S,
    "RECENT_KEPT": history.RECENT_KEPT, "RECENT_TTL_S": history.RECENT_TTL_S, "WEBHOOKS_KEPT": WEBHOOKS_KEPT,
})


class Write(enum.Enum):
    """What an EMIT call does with a job beyond logging and publishing its events."""

    APPEND = "a"
    END = "e"
    HAND_BACK = "h"
    LOST = "l"
    EXPIRE = "x"


@dataclass(frozen=True, slots=True)
class LogTTL:
    """Replay-log TTLs, and how long an ended job's result is kept unless its request says (0: none); seconds."""

    live: int = LIVE_TTL_S
    done: int = DONE_TTL_S
    result: int = 0


def emit_record(queue: str, rid: str, owner: str, write: Write, first_seq: int, result: bytes,
                events: Sequence[str], keep_s: int = 0) -> bytes:
    """One job's record as EMIT parses it: ``owner`` the run's token ("" the reaper; the run's epoch for
    :attr:`Write.LOST`), ``first_seq`` its first event's seq, ``result`` the result record to keep (or b"") for
    ``keep_s`` seconds, ``events`` their JSON texts."""
    q, r, o = queue.encode(), rid.encode(), owner.encode()
    keep_ms = keep_s * 1000 if result else 0
    head = b"%d %d %d %s %d %d %d\n" % (len(q), len(r), len(o), write.value.encode(), first_seq, len(result),
                                         keep_ms)
    return b"".join((head, q, r, o, result, b"\n", "\n".join(events).encode()))


async def emit(redis: Redis, keys: Keys, ttl: LogTTL, records: Sequence[bytes], appends: Sequence[object]) -> list[int]:
    """One EMIT call: ``records`` (:func:`emit_record`), then ``appends``, flat, four values each: rid, owner,
    entry id (``keys.log_entry_id``) and event JSON. 1 (written) or 0 (refused) per record, then per append."""
    args = {"count": len(records), "live_ttl_s": ttl.live, "done_ttl_s": ttl.done,
            "now_ms": int(time.time() * 1000), "prefix": keys.prefix,
            "records": b"".join(b"%d\n%s" % (len(r), r) for r in records)}
    named = {"running_key": keys.running(), "epoch_key": keys.epoch(), "deadlines_key": keys.deadlines()}
    result: list[int] = await EMIT.run(redis, named, args, rows=appends)
    return result
