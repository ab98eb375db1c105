"""Redis connections: the address, timeouts and retry policies every mlxq connection is made with.

Workers retry inside redis-py (``retry()``): they must outlive a Redis restart. The client has one policy
of its own, :class:`RetryPolicy`, applied around each of its operations (:func:`with_retries`): transient
errors are retried with backoff until a deadline, then raise :class:`QueueUnavailable`; a refusal of the
credentials or of a command raises :class:`AccessDenied` at once (redis-py files a wrong password under
its ``ConnectionError``, which retrying would only repeat). The deadline runs from the operation's start, and
each try is cut short at it: a host that drops packets, or a peer that accepts and never answers, ends the
operation at its deadline, not a connect or read timeout later.

The URL may name a Sentinel set instead of one server (:class:`SentinelUrl`):
``redis+sentinel://[user:pass@]host1:26379,host2:26379/mymaster[/db][?sentinel_password=...]``
(``rediss+sentinel://`` for TLS to the master). Each new connection asks the sentinels for the master's address,
so after a failover the next connection (the next retry) goes to the promoted replica.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import ExponentialBackoff, NoBackoff
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

from .errors import AccessDenied, ConfigError, QueueUnavailable, UnexpectedPassword

__all__ = ["RETRY_ON", "SENTINEL_SCHEMES", "RetryPolicy", "SentinelUrl", "client_redis", "find_master",
           "redact", "redis_client", "retry", "sentinel_url", "with_retries"]

T = TypeVar("T")
_DENIED = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)
_DENIED_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM")
# What Redis answers an unauthenticated client whose first request is large (a pipelined enqueue): no NOAUTH,
# it refuses to read a long multibulk from a client that has not authenticated.
_UNAUTHENTICATED = "Protocol error: unauthenticated"
# What Redis answers AUTH with a password when it has none (6 and later; before 6): the URL is wrong.
_NO_PASSWORD_SET = ("called without any password configured", "Client sent AUTH, but no password is set")

RETRY_ON: list[type[Exception]] = [RedisConnectionError, RedisTimeoutError, OSError]
CONNECT_TIMEOUT_S = 2.0


def retry() -> Retry:
    """A worker's retries: survive a Redis restart or a short outage instead of dying on the first refusal."""
    return Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A Sentinel set as ``MLXQ_REDIS_URL`` names it: the sentinels, the master's name, and how to talk to the
    master (``username``/``password``/``db``/``ssl``, as in a plain URL) and to the sentinels themselves
    (``sentinel_username``/``sentinel_password``, from the query string: a sentinel's own ``requirepass``)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def sentinel(self, *, strict: bool = False, **kwargs: Any) -> Sentinel:
        """redis-py's Sentinel for this set; ``kwargs`` go to every connection to the master (the socket
        timeouts to the sentinels' too). ``strict``: a master name the sentinels answer they do not know raises
        :class:`ConfigError` at once, not a connection error to retry."""
        auth = {"username": self.sentinel_username, "password": self.sentinel_password}
        to_sentinels = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
        kind = _StrictSentinel if strict else Sentinel
        return kind(list(self.sentinels), sentinel_kwargs={**to_sentinels, **auth}, db=self.db,
                    username=self.username, password=self.password, ssl=self.ssl, **kwargs)


class _StrictSentinel(Sentinel):
    """redis-py's Sentinel, except that a master name no answering sentinel monitors is a configuration error:
    redis-py's ``MasterNotFoundError`` is a connection error, retried until the client's deadline."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            address: tuple[str, int] = await super().discover_master(service_name)
            return address
        except MasterNotFoundError:
            if not await self._unknown(service_name):
                raise  # unreachable sentinels, or a master they know is down (a failover under way)
        hosts = ",".join(f"{c.connection_pool.connection_kwargs.get('host')}:"
                         f"{c.connection_pool.connection_kwargs.get('port')}" for c in self.sentinels)
        raise ConfigError(f"no sentinel of {hosts} knows a master named {service_name!r} (MLXQ_REDIS_URL)")

    async def _unknown(self, name: str) -> bool:
        """Whether a sentinel answers and none of those answering monitors ``name``."""
        answered = False
        for node in self.sentinels:
            try:
                masters = await node.sentinel_masters()
            except (RedisConnectionError, RedisTimeoutError, OSError):
                continue
            if name in masters:
                return False
            answered = True
        return answered


class _SentinelPool(SentinelConnectionPool):
    """The master's connection pool, which closes the sentinels' connections too when its client is closed (a
    full disconnect): redis-py's leaves them open. A failover's disconnect (idle connections only) keeps them."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:
            for node in self.sentinel_manager.sentinels:
                await node.connection_pool.disconnect()


class _SentinelConnection(SentinelManagedConnection):
    """A connection to a Sentinel set's master that asks the sentinels again at every try. redis-py's connects
    to the address they named with the whole retry policy (about 9 s of backoff for a worker) before it asks
    again: past a failover, the worker would lose its leases to a master that had been replaced seconds ago."""

    async def connect_to(self, address: tuple[str, int]) -> None:
        policy, self.retry = self.retry, Retry(NoBackoff(), 0)
        try:
            await super().connect_to(address)
        finally:
            self.retry = policy


class _SentinelSSLConnection(_SentinelConnection, SentinelManagedSSLConnection):
    """:class:`_SentinelConnection` over TLS (``rediss+sentinel://``)."""


def _bad_sentinel(raw: str, why: str) -> ConfigError:
    shown = "<a URL with credentials>" if "@" in raw or "password" in raw else raw
    return ConfigError(f"{shown!r}: {why} (expected redis+sentinel://[USER:PASSWORD@]HOST:PORT,HOST:PORT/MASTER)")


def _host_port(raw: str, item: str) -> tuple[str, int]:
    host, port = item, ""
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host:
        raise _bad_sentinel(raw, f"no host in {item!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise _bad_sentinel(raw, f"bad port in {item!r}")
    return host, int(port) if port else SENTINEL_PORT


def sentinel_url(raw: str) -> SentinelUrl | None:
    """The Sentinel set ``raw`` names (None for a plain ``redis://``, ``rediss://`` or ``unix://`` URL);
    a malformed one raises :class:`ConfigError` in one line, without its password."""
    scheme, sep, rest = raw.strip().partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        return None
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(pw) if colon else None)
    if not hosts:
        raise _bad_sentinel(raw, "no sentinel address")
    sentinels = tuple(_host_port(raw, item) for item in hosts.split(","))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise _bad_sentinel(raw, "the path must be the master's name, then optionally a database number")
    if len(parts) == 2 and not parts[1].isdigit():
        raise _bad_sentinel(raw, f"database {parts[1]!r} is not a number")
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - set(_SENTINEL_OPTIONS))
    if unknown:
        raise _bad_sentinel(raw, f"unknown option {unknown[0]!r} (known: {', '.join(_SENTINEL_OPTIONS)})")
    return SentinelUrl(sentinels, unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0, username, password,
                       scheme.lower() == "rediss+sentinel", options.get("sentinel_username") or None,
                       options.get("sentinel_password") or None)


def _client(url: str, redis_class: type[Redis], *, strict: bool = False, **kwargs: Any) -> Redis:
    """A client of the server ``url`` names: one address, or a Sentinel set's master (looked up again for each
    new connection; ``strict``: see :meth:`SentinelUrl.sentinel`). Closing it closes the sentinels' connections."""
    found = sentinel_url(url)
    if found is None:
        return redis_class(connection_pool=ConnectionPool.from_url(url, **kwargs))
    connection = _SentinelSSLConnection if found.ssl else _SentinelConnection
    client: Redis = found.sentinel(strict=strict, **kwargs).master_for(
        found.master, redis_class=redis_class, connection_class=connection, connection_pool_class=_SentinelPool)
    return client


async def find_master(url: SentinelUrl, timeout: float) -> tuple[str, int]:
    """The master's address as the first sentinel that knows it answers. :class:`ConfigError` when sentinels
    answer and none knows the master's name (retrying will not help); ``redis.exceptions.ConnectionError``
    when no sentinel answers (within ``timeout`` each)."""
    sentinel = url.sentinel(socket_connect_timeout=timeout, socket_timeout=timeout)
    answered, errors = 0, []
    try:
        for host_port, node in zip(url.sentinels, sentinel.sentinels, strict=True):
            try:
                found = await node.sentinel_get_master_addr_by_name(url.master)
            except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                where = f"{host_port[0]}:{host_port[1]}"
                if is_denied(exc):  # the sentinels' own password (sentinel_password): wrong or missing
                    raise denied(exc, f"sentinel {where}") from exc
                if isinstance(exc, ResponseError):  # a plain Redis, not a sentinel
                    raise ConfigError(f"{where} does not answer as a Redis Sentinel does (MLXQ_REDIS_URL): "
                                      f"{exc}") from exc
                errors.append(f"{where}: {_cause(exc)}")
                continue
            answered += 1
            if found:
                host = found[0].decode() if isinstance(found[0], bytes) else str(found[0])
                return host, int(found[1])
    finally:
        for node in sentinel.sentinels:
            await node.aclose()
    hosts = ",".join(f"{h}:{p}" for h, p in url.sentinels)
    if answered:
        raise ConfigError(f"no sentinel of {hosts} knows a master named {url.master!r} (MLXQ_REDIS_URL)")
    raise RedisConnectionError(f"no sentinel of {hosts} answers: {'; '.join(errors)}")


def redis_client(url: str, *, redis_class: type[Redis] = Redis, **kwargs: Any) -> Redis:
    """A redis-py asyncio client with retries on connection errors (of ``redis_class``: arq's is a subclass)."""
    return _client(url, redis_class, retry=retry(), retry_on_error=RETRY_ON,
                   socket_connect_timeout=CONNECT_TIMEOUT_S, **kwargs)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The client's retries: backoff from ``base_s`` doubling up to ``cap_s``, for at most ``deadline_s`` from the
    operation's start; ``setting`` names the variable that sets the deadline (for the message on giving up)."""

    deadline_s: float = 5.0
    base_s: float = 0.05
    cap_s: float = 1.0
    setting: str = "MLXQ_RETRY_DEADLINE"


def client_redis(url: str, policy: RetryPolicy) -> Redis:
    """The client's connection pool: no retries inside redis-py (the policy is applied around operations),
    and a connect timeout within the policy's deadline. A Sentinel master's name that the sentinels do not know
    raises :class:`ConfigError` at the first operation (retrying would only ask them again)."""
    timeout = min(CONNECT_TIMEOUT_S, max(0.1, policy.deadline_s))
    return _client(url, Redis, strict=True, socket_connect_timeout=timeout)


def _refusal(exc: BaseException) -> BaseException | None:
    """The refusal of the credentials or of a command that ``exc`` is, or wraps (over a unix socket redis-py
    files a refused AUTH as ``ConnectionError(AuthenticationError(...))``); None if it is none."""
    for err in (exc, exc.__cause__, *(a for a in exc.args if isinstance(a, BaseException))):
        if isinstance(err, _DENIED):
            return err
        if isinstance(err, ResponseError) and str(err).startswith((*_DENIED_REPLIES, _UNAUTHENTICATED)):
            return err
    return None


def is_denied(exc: BaseException) -> bool:
    """Redis refused the credentials or the command: retrying repeats the refusal."""
    return _refusal(exc) is not None


def is_transient(exc: BaseException) -> bool:
    """Redis was unreachable, restarting or too slow: the same call may go through later."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError) and not is_denied(exc)


def redact(url: str) -> str:
    """``url`` without its password (or query string, where a unix socket URL, or a Sentinel URL's
    ``sentinel_password``, may carry one)."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url.split("?", 1)[0])


def denied(exc: BaseException, where: str) -> AccessDenied:
    """What a refusal (:func:`is_denied`) means to the caller, in one line: :class:`UnexpectedPassword` (a
    configuration error) for a password given to a Redis that has none, else :class:`AccessDenied`."""
    exc = _refusal(exc) or exc
    if any(text in str(exc) for text in _NO_PASSWORD_SET):
        return UnexpectedPassword(f"Redis at {where} has no password set, but the URL gives one (MLXQ_REDIS_URL): "
                                  f"remove it from the URL, or set one on the server (requirepass): {exc}")
    if str(exc).startswith(_UNAUTHENTICATED):
        return AccessDenied(f"Redis at {where} requires a password and none was given (put one in the URL: "
                            f"redis://:PASSWORD@host or redis://USER:PASSWORD@host): {exc}")
    what = "the credentials" if isinstance(exc, RedisConnectionError) else "a command"
    return AccessDenied(f"Redis at {where} refused {what}: {exc}")


_MIN_TRY_S = 0.1  # a try gets at least this long, so a deadline of 0 (or one nearly spent) still makes one


@dataclass(slots=True)
class Failures:
    """The tries of one operation under a policy: how long the next may take, when to give up, how long to wait.

    The deadline runs from ``since``: the operation's start, or its first failure after Redis last answered
    (:meth:`ok`, for a long-lived operation such as following a job)."""

    policy: RetryPolicy
    where: str
    since: float | None = field(default_factory=time.monotonic)
    count: int = 0

    def ok(self) -> None:
        self.since, self.count = None, 0

    def time_left(self) -> float:
        """How long the next try may take: what is left of the deadline (the whole of it after a success)."""
        if self.since is None:
            return max(_MIN_TRY_S, self.policy.deadline_s)
        return max(_MIN_TRY_S, self.since + self.policy.deadline_s - time.monotonic())

    async def attempt(self, op: Callable[[], Awaitable[T]]) -> T:
        """``await op()``, cut short at the deadline: a connect or a reply that never comes raises
        ``redis.exceptions.TimeoutError`` then, whatever the socket's own timeouts."""
        bound = self.time_left()
        timer = asyncio.timeout(bound)
        try:
            async with timer:
                return await op()
        except TimeoutError:
            if timer.expired():
                raise RedisTimeoutError(f"no answer within {bound:.1f}s") from None
            raise

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
        self.count += 1
        left = self.since + self.policy.deadline_s - now
        if left <= 0:
            p, tries = self.policy, "1 try" if self.count == 1 else f"{self.count} tries"
            raise QueueUnavailable(f"Redis at {self.where} unreachable within the {p.deadline_s:g}s deadline "
                                   f"({p.setting}; {tries}): {_cause(exc)}") from exc
        delay = min(self.policy.cap_s, self.policy.base_s * 2 ** (self.count - 1)) * random.uniform(0.5, 1.0)
        await asyncio.sleep(min(delay, left))


def _cause(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def with_retries(op: Callable[[], Awaitable[T]], policy: RetryPolicy, where: str) -> T:
    """``await op()``, retried on transient errors within ``policy``'s deadline from now."""
    failures = Failures(policy, where)
    while True:
        try:
            return await failures.attempt(op)
        except Exception as exc:
            await failures.failed(exc)
