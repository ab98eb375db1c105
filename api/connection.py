"""Redis connections: the address, timeouts and retry policy every mlxq connection is made with."""

from __future__ import annotations

from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["RETRY_ON", "redis_client", "retry"]

RETRY_ON: list[type[Exception]] = [RedisConnectionError, RedisTimeoutError, OSError]
CONNECT_TIMEOUT_S = 2.0


def retry() -> Retry:
    """A worker's retries: survive a Redis restart or a short outage instead of dying on the first refusal."""
    return Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)


def _pool(url: str, **kwargs: Any) -> ConnectionPool:
    return ConnectionPool.from_url(
        url, retry=retry(), retry_on_error=RETRY_ON, socket_connect_timeout=CONNECT_TIMEOUT_S, **kwargs
    )


def redis_client(url: str, **kwargs: Any) -> Redis:
    """A redis-py asyncio client with retries on connection errors."""
    return Redis(connection_pool=_pool(url, **kwargs))
