"""Tenants: each one's policy, kept live in Redis, and each one's use of the fleet.

A policy entry (``<prefix>:tenant:<name>``, a hash) holds a tenant's weight and caps; producers (``max_queued``)
and workers' CLAIM (``weight``, ``max_running``, ``tokens_per_minute``) read it at every call, so a change
applies at once, fleet-wide. A tenant without an entry has the default policy: weight 1, no caps. Entries have
no TTL; a Redis restarted empty loses them, and everything goes on under the default policy.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from redis.asyncio import Redis

from .errors import BadRequest
from .protocol.keys import Keys
from .schema import DEFAULT_TENANT, TENANT_PATTERN

__all__ = ["DEFAULT_TENANT", "Policy", "TenantUse", "check_name", "policies", "remove", "store", "use"]

_NAME = re.compile(TENANT_PATTERN)
SHARE_TTL_S = 86_400  # the fair-share accounts and running counts live a day past their last change


def check_name(name: str, field: str = "tenant") -> str:
    """``name`` if it is a tenant name (``[A-Za-z0-9._-]{1,64}``), else :class:`BadRequest` naming ``field``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{field}: a tenant name is 1 to 64 of A-Z a-z 0-9 . _ -, not {str(name)[:80]!r}")
    return name


@dataclass(frozen=True, slots=True)
class Policy:
    """A tenant's share and caps (0: no cap)."""

    weight: float = 1.0
    max_running: int = 0
    max_queued: int = 0
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise BadRequest(f"weight: must be above 0, not {self.weight}")
        for name in ("max_running", "max_queued", "tokens_per_minute"):
            if getattr(self, name) < 0:
                raise BadRequest(f"{name.replace('_', '-')}: must be 0 (no cap) or more, not {getattr(self, name)}")

    @classmethod
    def of(cls, fields: dict[bytes, bytes] | dict[str, str]) -> Policy:
        """A policy hash as read back (missing fields keep their defaults)."""
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in fields.items()}
        return cls(weight=float(d.get("weight", 1.0)), max_running=int(d.get("max_running", 0)),
                   max_queued=int(d.get("max_queued", 0)), tokens_per_minute=int(d.get("tokens_per_minute", 0)))


@dataclass(frozen=True, slots=True)
class TenantUse:
    """A tenant's policy (``named``: from an entry, else the default) and its live use of the fleet."""

    name: str
    policy: Policy
    named: bool
    queued: int  # jobs queued, all models
    running: int  # jobs running, fleet-wide
    tokens_per_minute: float  # prompt + generated tokens of its jobs that ended over the last minute
    share: float  # its share of the tokens all tenants' jobs used over the last minute (0..1)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "policy": asdict(self.policy), "named": self.named, "queued": self.queued,
                "running": self.running, "tokens_per_minute": round(self.tokens_per_minute, 1),
                "share": round(self.share, 4)}


async def store(redis: Redis, keys: Keys, name: str, weight: float | None = None, max_running: int | None = None,
                max_queued: int | None = None, tokens_per_minute: int | None = None) -> Policy:
    """Set the given fields of a tenant's policy (the others keep theirs, or the defaults); the policy now."""
    check_name(name, "name")
    current = Policy.of(await redis.hgetall(keys.tenant(name)))  # type: ignore[misc]
    given = {"weight": weight, "max_running": max_running, "max_queued": max_queued,
             "tokens_per_minute": tokens_per_minute}
    policy = Policy(**{**asdict(current), **{k: v for k, v in given.items() if v is not None}})
    async with redis.pipeline(transaction=True) as tr:
        tr.hset(keys.tenant(name), mapping={k: str(v) for k, v in asdict(policy).items()})
        tr.sadd(keys.tenants(), name)
        await tr.execute()
    return policy


async def remove(redis: Redis, keys: Keys, name: str) -> bool:
    """Drop a tenant's policy entry (its queued jobs stay, under the default policy); whether it had one."""
    check_name(name, "name")
    async with redis.pipeline(transaction=True) as tr:
        tr.delete(keys.tenant(name))
        tr.srem(keys.tenants(), name)
        deleted, _ = await tr.execute()
    return bool(deleted)


async def policies(redis: Redis, keys: Keys) -> dict[str, Policy]:
    """Every policy entry, by tenant."""
    names = sorted(n.decode() for n in await redis.smembers(keys.tenants()))  # type: ignore[misc]
    async with redis.pipeline(transaction=False) as pipe:
        for n in names:
            pipe.hgetall(keys.tenant(n))
        found = await pipe.execute()
    return {n: Policy.of(f) for n, f in zip(names, found) if f}


def window_tokens(current: int, previous: int, now_ms: int) -> float:
    """Tokens over the last minute from two minute buckets, the previous one weighted by its part still inside
    the window (as CLAIM counts them for ``tokens_per_minute``)."""
    return current + previous * (1 - (now_ms % 60_000) / 60_000)


async def _spent(redis: Redis, keys: Keys, minute: int) -> set[str]:
    """The tenants with tokens counted this minute or the one before: their buckets' names, by SCAN (an
    operator's command and the dashboard's refresh read this, never a job's path)."""
    names = set()
    for m in (minute, minute - 1):
        head, _, tail = keys.tenant_tokens("\0", m).partition("\0")
        async for key in redis.scan_iter(match=keys.tenant_tokens("*", m), count=1000):
            name = key.decode()
            if name.startswith(head) and name.endswith(tail):
                names.add(name[len(head):len(name) - len(tail)])
    return names


async def use(redis: Redis, keys: Keys, queued: dict[str, int]) -> list[TenantUse]:
    """Each tenant with a policy entry, jobs queued or running, or tokens over the last minute: its policy and
    live use. ``queued``: jobs queued per tenant (``api.registry.queues``)."""
    named = await policies(redis, keys)
    running = {k.decode(): int(v) for k, v in
               (await redis.hgetall(keys.tenants_running())).items()}  # type: ignore[misc]
    now_ms = int(time.time() * 1000)
    minute = now_ms // 60_000
    busy = {t for t, n in queued.items() if n} | {t for t, n in running.items() if n}
    names = sorted(set(named) | busy | await _spent(redis, keys, minute))
    async with redis.pipeline(transaction=False) as pipe:
        for n in names:
            pipe.get(keys.tenant_tokens(n, minute))
            pipe.get(keys.tenant_tokens(n, minute - 1))
        raw = await pipe.execute()
    tpm = {n: window_tokens(int(raw[2 * i] or 0), int(raw[2 * i + 1] or 0), now_ms) for i, n in enumerate(names)}
    total = sum(tpm.values())
    return [TenantUse(n, named.get(n, Policy()), n in named, queued.get(n, 0), max(0, running.get(n, 0)), tpm[n],
                      tpm[n] / total if total else 0.0) for n in names]
