"""The fleet's recent history, for the dashboard's charts: bounded buckets in Redis, written by the workers.

Each job's end (its EMIT call, ``api/protocol/lua/history.lua``) adds it to its model's bucket of
:data:`BUCKET_S` seconds (``<prefix>:hist:<model>:<bucket>``, a hash that expires after :data:`HISTORY_TTL_S`):
jobs ended, errors, tokens made, and histograms of time to first token and queue wait over :data:`EDGES_MS`.
It also pushes a one-line summary onto ``<prefix>:recent`` (the newest :data:`RECENT_KEPT`). Nothing runs per
token: one bucket write and one list push per job end. Readers turn the buckets into per-second rates and
percentiles (:func:`series`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .protocol.keys import Keys

__all__ = ["BUCKET_S", "EDGES_MS", "HISTORY_TTL_S", "RECENT_KEPT", "WINDOW_S", "Point", "percentile", "recent",
           "series"]

BUCKET_S = 10  # one bucket per model per this many seconds
WINDOW_S = 900  # what the charts show: the last 15 minutes
HISTORY_TTL_S = WINDOW_S + 120  # a bucket outlives the window a little, then Redis drops it
RECENT_KEPT = 500  # job summaries kept on the recent list
RECENT_TTL_S = 86_400
# Histogram bin upper edges (ms); a value above the last edge counts in the last bin.
EDGES_MS = (5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 300_000)


@dataclass(frozen=True, slots=True)
class Point:
    """One bucket of a model's history: its start (epoch s), jobs and tokens per second, and percentiles (ms,
    None when no job ended in it)."""

    at: int
    jobs_per_s: float
    tokens_per_s: float
    errors: int
    ttft_p50: float | None
    ttft_p99: float | None
    wait_p50: float | None
    wait_p99: float | None


def percentile(counts: list[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram over :data:`EDGES_MS`, interpolated within its bin (as
    Prometheus's ``histogram_quantile`` does)."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for edge, n in zip(EDGES_MS, counts):
        if n and seen + n >= rank:
            return lower + (edge - lower) * (rank - seen) / n
        seen, lower = seen + n, float(edge)
    return float(EDGES_MS[-1])


def _point(at: int, fields: dict[bytes, bytes]) -> Point:
    get = {k.decode(): int(v) for k, v in fields.items()}
    ttft = [get.get(f"t{i}", 0) for i in range(len(EDGES_MS))]
    wait = [get.get(f"w{i}", 0) for i in range(len(EDGES_MS))]
    return Point(at * BUCKET_S, get.get("n", 0) / BUCKET_S, get.get("tok", 0) / BUCKET_S, get.get("err", 0),
                 percentile(ttft, 0.5), percentile(ttft, 0.99), percentile(wait, 0.5), percentile(wait, 0.99))


async def series(redis: Redis, keys: Keys, models: list[str], now_s: float) -> dict[str, list[Point]]:
    """Each model's buckets over the last :data:`WINDOW_S` seconds, oldest first (one pipeline)."""
    last = int(now_s // BUCKET_S)
    buckets = list(range(last - WINDOW_S // BUCKET_S + 1, last + 1))
    pipe = redis.pipeline(transaction=False)
    for model in models:
        for b in buckets:
            pipe.hgetall(keys.history(model, b))
    replies = iter(await pipe.execute())
    return {model: [_point(b, next(replies)) for b in buckets] for model in models}


async def recent(redis: Redis, keys: Keys, most: int = 100) -> list[dict[str, Any]]:
    """The newest ended jobs' summaries, newest first (as the workers wrote them)."""
    found = []
    for raw in await redis.lrange(keys.recent(), 0, most - 1):  # type: ignore[misc]
        try:
            found.append(json.loads(raw))
        except ValueError:
            continue
    return found

