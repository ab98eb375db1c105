"""Redis connections for producer and worker: retries with backoff, and arq's JSON job serializer.

arq pickles job payloads by default; both sides here use JSON, so nothing executable crosses Redis.
"""

from __future__ import annotations

import json
from typing import Any

from arq.connections import ArqRedis, RedisSettings
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["JOB_FUNCTION", "arq_pool", "dumps_job", "loads_job", "redis_client", "redis_settings"]

JOB_FUNCTION = "generate"  # the arq function name workers register
_RETRY_ON = [RedisConnectionError, RedisTimeoutError, OSError]


def dumps_job(data: dict[str, Any]) -> bytes:
    """arq ``job_serializer``: JSON, never pickle."""
    return json.dumps(data, separators=(",", ":"), default=str).encode()


def loads_job(data: bytes) -> dict[str, Any]:
    """arq ``job_deserializer``."""
    result: dict[str, Any] = json.loads(data)
    return result


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
