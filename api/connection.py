"""Redis connections for producer and worker: retries with backoff, and arq's JSON job serializer.

arq pickles job payloads by default; both sides here use JSON, so nothing executable crosses Redis.
"""

from __future__ import annotations

import json
import time
from typing import Any

from arq.connections import ArqRedis, RedisSettings
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "ENQUEUE", "JOB_FUNCTION", "JOB_TTL_MS", "UNDECODABLE",
    "arq_pool", "dumps_job", "loads_job", "redis_client", "redis_settings",
]

JOB_FUNCTION = "generate"  # the arq function name workers register
UNDECODABLE = "__mlxq_undecodable__"  # payload key marking a job arq could not decode
JOB_TTL_MS = 86_400_000  # a job not started within a day expires (arq's default)

# One round trip (arq's enqueue_job takes two): refuse a reused id, store the job as arq does, queue it,
# and wake the model's workers. KEYS: arq job key, arq result key, queue.
# ARGV: id, job, ttl ms, wake channel ("" for none: a burst sent together wakes them once, from its last
# job; that wake-up goes out even if that job's id is refused), score (enqueue time in ms, as arq scores it).
ENQUEUE = """
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], '1') end
if redis.call('EXISTS', KEYS[1], KEYS[2]) > 0 then return 0 end
redis.call('PSETEX', KEYS[1], ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[1])
return 1
"""

_RETRY_ON = [RedisConnectionError, RedisTimeoutError, OSError]


def dumps_job(data: dict[str, Any]) -> bytes:
    """arq ``job_serializer``: JSON, never pickle."""
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def loads_job(data: bytes, max_bytes: int | None = None) -> dict[str, Any]:
    """arq ``job_deserializer``: JSON. It never raises.

    arq fails a job it cannot decode before the job function runs, so nobody would ever publish its
    terminal event (and some malformed envelopes crash arq's poll loop). Such a job instead becomes a call
    of the job function with an ``{UNDECODABLE: reason}`` payload, which the worker ends with
    ``error(bad_request)``.
    """
    try:
        if max_bytes is not None and len(data) > max_bytes:
            raise ValueError(f"the job payload has {len(data)} bytes; the limit is {max_bytes}")
        envelope = json.loads(data)
        _check_envelope(envelope)
    except (ValueError, TypeError, RecursionError) as exc:
        reason = str(exc) if len(str(exc)) <= 300 else str(exc)[:300] + "..."
        return {"f": JOB_FUNCTION, "a": [{UNDECODABLE: reason}], "k": {}, "t": None, "et": int(time.time() * 1000)}
    result: dict[str, Any] = envelope
    return result


def _check_envelope(d: Any) -> None:
    if not isinstance(d, dict):
        raise ValueError("the job is not a JSON object")
    checks = {"f": (str,), "a": (list,), "k": (dict,), "t": (int, type(None)), "et": (int,)}
    for key, types in checks.items():
        value = d.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ValueError(f"malformed job envelope: {key!r} is {type(value).__name__}")
    if d["f"] != JOB_FUNCTION:
        raise ValueError(f"unknown job function {d['f'][:64]!r}")


def _retry() -> Retry:
    # Survive a Redis restart or a short outage instead of dying on the first refused connection.
    return Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)


def _pool(url: str, **kwargs: Any) -> ConnectionPool:
    return ConnectionPool.from_url(
        url, retry=_retry(), retry_on_error=_RETRY_ON, socket_connect_timeout=2.0, **kwargs
    )


def redis_client(url: str, **kwargs: Any) -> Redis:
    """A redis-py asyncio client with retries on connection errors."""
    return Redis(connection_pool=_pool(url, **kwargs))


def arq_pool(url: str) -> ArqRedis:
    """An arq client (for enqueueing) using the JSON serializer."""
    return ArqRedis(pool_or_conn=_pool(url), job_serializer=dumps_job, job_deserializer=loads_job)


def redis_settings(url: str) -> RedisSettings:
    """arq ``RedisSettings`` for a URL, with the same retry policy as :func:`redis_client`."""
    settings = RedisSettings.from_dsn(url)
    settings.retry = _retry()
    settings.retry_on_error = list(_RETRY_ON)
    settings.conn_timeout = 2
    return settings
