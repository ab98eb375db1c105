"""Redis connections: the address, timeouts and retry policies every mlxq connection is made with.

Workers retry inside redis-py (``retry()``): they must outlive a Redis restart. The client has one policy
of its own, :class:`RetryPolicy`, applied around each of its operations (:func:`with_retries`): transient
errors are retried with backoff until a deadline, then raise :class:`QueueUnavailable`; a refusal of the
credentials or of a command raises :class:`AccessDenied` at once (redis-py files a wrong password under
its ``ConnectionError``, which retrying would only repeat).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    InvalidResponse,
    NoPermissionError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import AccessDenied, QueueUnavailable

__all__ = ["RETRY_ON", "RetryPolicy", "client_redis", "redact", "redis_client", "retry", "with_retries"]

T = TypeVar("T")
_DENIED = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)
_DENIED_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM")

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


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The client's retries: backoff from ``base_s`` doubling up to ``cap_s``, for at most ``deadline_s``."""

    deadline_s: float = 5.0
    base_s: float = 0.05
    cap_s: float = 1.0


def client_redis(url: str, policy: RetryPolicy) -> Redis:
    """The client's connection pool: no retries inside redis-py (the policy is applied around operations),
    and a connect timeout within the policy's deadline."""
    timeout = min(CONNECT_TIMEOUT_S, max(0.1, policy.deadline_s))
    return Redis(connection_pool=ConnectionPool.from_url(url, socket_connect_timeout=timeout))


def is_denied(exc: BaseException) -> bool:
    """Redis refused the credentials or the command: retrying repeats the refusal."""
    if isinstance(exc, _DENIED):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_DENIED_REPLIES)


def is_transient(exc: BaseException) -> bool:
    """Redis was unreachable, restarting or too slow: the same call may go through later."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError) and not is_denied(exc)


def redact(url: str) -> str:
    """``url`` without its password (or query string, where a unix socket URL may carry one)."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url.split("?", 1)[0])


def denied(exc: BaseException, where: str) -> AccessDenied:
    what = "the credentials" if isinstance(exc, RedisConnectionError) else "a command"
    return AccessDenied(f"Redis at {where} refused {what}: {exc}")


@dataclass(slots=True)
class Failures:
    """Consecutive failures of one operation under a policy: when to give up, how long to wait."""

    policy: RetryPolicy
    where: str
    since: float | None = None
    count: int = 0

    def ok(self) -> None:
        self.since, self.count = None, 0

    async def failed(self, exc: BaseException) -> None:
        """Raise what ``exc`` means to the caller, or wait out the backoff before the next try."""
        if is_denied(exc):
            raise denied(exc, self.where) from exc
        if isinstance(exc, InvalidResponse):  # another server on Redis's port: retrying reads the same
            raise QueueUnavailable(f"{self.where} does not answer as Redis does: {exc}") from exc
        if not is_transient(exc):
            raise exc
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since >= self.policy.deadline_s:
            raise QueueUnavailable(f"Redis at {self.where} unreachable for {now - self.since:.1f}s "
                                   f"({self.count + 1} tries): {exc}") from exc
        delay = min(self.policy.cap_s, self.policy.base_s * 2**self.count) * random.uniform(0.5, 1.0)
        self.count += 1
        await asyncio.sleep(min(delay, max(0.0, self.since + self.policy.deadline_s - now)))


async def with_retries(op: Callable[[], Awaitable[T]], policy: RetryPolicy, where: str) -> T:
    """``await op()``, retried on transient errors within ``policy``."""
    failures = Failures(policy, where)
    while True:
        try:
            return await op()
        except Exception as exc:
            await failures.failed(exc)
