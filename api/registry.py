"""The live workers and the queues of a deployment, read from Redis (any host, no worker code needed).

Every worker writes its :class:`~api.schema.WorkerStatus` to ``<prefix>:worker:<id>`` every few seconds, with
a TTL of a few heartbeats, and its id into the ``<prefix>:workers`` sorted set (score: the heartbeat's time).
A worker that stops is gone from both within its TTL; one that dies lingers in the set (never in a record)
until a reader prunes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError
from redis.asyncio import Redis

from .protocol.keys import Keys
from .protocol.scripts import Layout, load
from .schema import ModelState, WorkerStatus

__all__ = ["ModelInfo", "QueueInfo", "live_workers", "models_of", "other_prefixes", "queues"]

log = logging.getLogger(__name__)

_STALE_S = 3600.0  # set members this old are pruned by readers (their records expired long ago)
_SCAN_CHUNK = 100  # queue entries read per ZRANGE while looking for the oldest waiting job
# The look for other prefixes' workers is bounded: this many SCAN calls of this many keys, this many prefixes
# and workers each read.
_OTHERS_SCANS, _OTHERS_COUNT, _OTHERS_MOST, _OTHERS_WORKERS = 10, 1000, 5, 50
_WORKERS_SUFFIX = Keys("").workers()  # ":workers"

# A queue's depth and the enqueue time of its oldest waiting job (lua/queue_stats.lua).
_QUEUE_STATS = load("queue_stats", Layout(keys=("queue_key",), args=("prefix", "chunk_size", "now_ms")))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model as the live workers serve it."""

    name: str
    workers: int  # live workers taking its jobs now
    capacity: int  # their batch capacity together
    running: int
    waiting: int
    tokens_per_s: float
    accepts_images: bool
    context_length: int | None
    dead_on: list[str] = field(default_factory=list)  # workers whose engine for it died
    loadable: int = 0  # live workers that have it on demand, not loaded now: they load it when its jobs wait
    bulk: int = 0  # of its jobs in engines, those of the bulk band (their queue is the model's bulk band's)

    @property
    def offered(self) -> bool:
        """Whether jobs for it get served: a live worker takes them now, or loads it for them."""
        return self.workers > 0 or self.loadable > 0


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A model's queue: jobs waiting, and how long the oldest of them has waited (None: no job record left)."""

    model: str
    depth: int
    oldest_s: float | None
    tenants: dict[str, int] = field(default_factory=dict)  # jobs waiting per tenant (its own queue's depth)


async def queues(redis: Redis, keys: Keys) -> list[QueueInfo]:
    """Every model queue under the prefix that holds jobs, by model name: all tenants' queues together."""
    names = sorted({k.decode() if isinstance(k, bytes) else str(k)
                    for start in (keys.queue(""), keys.tenant_queues())
                    async for k in redis.scan_iter(match=_glob_escape(start) + "*", count=1000)})
    if not names:
        return []
    now = time.time()
    pipe = redis.pipeline(transaction=False)
    for name in names:  # the script's text each time: a status read, not a hot path
        named, args = _QUEUE_STATS.layout.pack(
            {"queue_key": name}, {"prefix": keys.prefix, "chunk_size": _SCAN_CHUNK, "now_ms": int(now * 1000)})
        pipe.eval(_QUEUE_STATS.source, len(named), *named, *args)
    found: dict[str, QueueInfo] = {}
    for name, reply in zip(names, await pipe.execute(raise_on_error=False)):
        if isinstance(reply, Exception):  # not a queue (a key of another kind under the same name)
            continue
        depth, oldest = reply
        model, tenant = keys.queue_of(name)
        age = now - int(oldest) / 1000 if oldest else None
        seen = found.get(model)
        if seen is not None:
            ages = [a for a in (seen.oldest_s, age) if a is not None]
            age = max(ages) if ages else None
            depth = seen.depth + int(depth)
        counts = {**(seen.tenants if seen is not None else {}), tenant: int(reply[0])}
        found[model] = QueueInfo(model, int(depth), age, counts)
    return [found[m] for m in sorted(found)]


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


async def live_workers(redis: Redis, keys: Keys) -> list[WorkerStatus]:
    """Every worker whose health record is current, ordered by id."""
    now_ms = int(time.time() * 1000)
    ids = [i.decode() if isinstance(i, bytes) else str(i) for i in await redis.zrange(keys.workers(), 0, -1)]
    if not ids:
        return []
    records = await redis.mget([keys.worker(i) for i in ids])
    workers = []
    for wid, raw in zip(ids, records):
        if raw is None:
            continue
        try:
            workers.append(WorkerStatus.model_validate_json(raw))
        except ValidationError as exc:  # a newer or broken writer: skip it, say so once per read
            log.warning("worker %s: unreadable health record: %s", wid, exc.errors()[0]["msg"])
    await redis.zremrangebyscore(keys.workers(), "-inf", now_ms - int(_STALE_S * 1000))
    return sorted(workers, key=lambda w: w.id)


def models_of(workers: Iterable[WorkerStatus]) -> dict[str, ModelInfo]:
    """What the given workers serve, by model name (a model only dead everywhere has ``workers == 0``; one only
    loadable, ``workers == 0`` and ``loadable > 0``)."""
    infos: dict[str, ModelInfo] = {}
    for w in workers:
        for m in w.models:
            serving = w.serves(m.name)
            one = ModelInfo(m.name, int(serving), m.capacity if serving else 0, m.running, m.waiting, m.tokens_per_s,
                            m.accepts_images, m.context_length, [w.id] if m.state is ModelState.DEAD else [],
                            int(w.can_load(m.name)), m.bulk)
            prev = infos.get(m.name)
            infos[m.name] = one if prev is None else _sum(prev, one)
    return dict(sorted(infos.items()))


def _sum(a: ModelInfo, b: ModelInfo) -> ModelInfo:
    return ModelInfo(a.name, a.workers + b.workers, a.capacity + b.capacity, a.running + b.running,
                     a.waiting + b.waiting, a.tokens_per_s + b.tokens_per_s, a.accepts_images or b.accepts_images,
                     a.context_length or b.context_length, a.dead_on + b.dead_on, a.loadable + b.loadable,
                     a.bulk + b.bulk)


async def other_prefixes(redis: Redis, keys: Keys) -> dict[str, list[str]]:
    """Other prefixes of this Redis under which live workers serve models: prefix -> their models (a hint for
    an MLXQ_PREFIX that differs from the workers'). Bounded: a few SCAN calls, a few prefixes; reads only."""
    found: dict[str, list[str]] = {}
    cursor = 0
    for _ in range(_OTHERS_SCANS):
        cursor, names = await redis.scan(cursor, match="*" + _glob_escape(_WORKERS_SUFFIX), count=_OTHERS_COUNT,
                                         _type="zset")
        for name in (n.decode() if isinstance(n, bytes) else str(n) for n in names):
            prefix = name[:-len(_WORKERS_SUFFIX)]
            if prefix != keys.prefix and prefix not in found and len(found) < _OTHERS_MOST:
                served = await _served_under(redis, Keys(prefix))
                if served:
                    found[prefix] = served
        if cursor == 0:
            break
    return found


async def _served_under(redis: Redis, keys: Keys) -> list[str]:
    """The models live workers under ``keys`` serve (their current health records; nothing is pruned)."""
    ids = [i.decode() if isinstance(i, bytes) else str(i)
           for i in await redis.zrevrange(keys.workers(), 0, _OTHERS_WORKERS - 1)]
    served: set[str] = set()
    for raw in await redis.mget([keys.worker(i) for i in ids]) if ids else []:
        try:
            status = WorkerStatus.model_validate_json(raw) if raw is not None else None
        except ValidationError:  # not a worker's record: another application's key of the same shape
            continue
        if status is not None:
            served.update(m.name for m in status.models if status.serves(m.name) or status.can_load(m.name))
    return sorted(served)
