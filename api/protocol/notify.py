"""Webhook events: what ended, on one Redis stream (``Keys.webhooks()``) that the gateways deliver from
(api/gateway/webhooks.py).

An entry is ``{type, id, tenant, at_ms}``: the event type (OpenAI's: ``response.completed``, ``batch.failed``,
...), the id of the object it is about, whose object it is, and when it ended (epoch ms). Two ways in:

- :func:`publish`: one event, from wherever an object's end is decided in Python (a batch's end).
- :func:`watch`: a job whose end is itself the event (a background response's). EMIT adds the entry in the
  same atomic call that writes the job's terminal event (``lua/notify.lua``), whichever writes it (its run, the
  reaper, the expiry): exactly once per job, with no process having to see the end happen.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .enqueuer import Command
from .keys import WEBHOOKS_KEPT, Keys

__all__ = ["DISABLED_FOR_S", "FAILURES_KEPT", "RECORD_TTL_S", "WebhookEntry", "disable_endpoint",
           "disabled_endpoints", "eviction_risk", "publish", "report", "unwatch", "watch", "watching"]

FAILURES_KEPT = 100  # the newest given-up deliveries listed (Keys.webhook_failures)
RECORD_TTL_S = 7 * 86_400  # the failure list and the counters live a week past their last write
DISABLED_FOR_S = 7 * 86_400  # an endpoint that answered 410 Gone gets nothing for a week (or until its entry goes)


@dataclass(frozen=True, slots=True)
class WebhookEntry:
    """One entry of the webhook stream: ``entry`` its stream id, which names the event (``evt_<entry>``)."""

    entry: str
    type: str
    id: str
    tenant: str
    at_ms: int

    @property
    def event_id(self) -> str:
        """The event's id, the same on every delivery attempt (Standard Webhooks' ``webhook-id``)."""
        return "evt_" + self.entry.replace("-", "_")

    @classmethod
    def of(cls, entry: bytes | str, fields: dict[bytes, bytes]) -> WebhookEntry:
        """An entry as XREADGROUP returns it."""
        get = lambda k: fields.get(k, b"").decode()  # noqa: E731
        name = entry.decode() if isinstance(entry, bytes) else entry
        return cls(name, get(b"type"), get(b"id"), get(b"tenant"), int(get(b"at_ms") or 0))


async def publish(redis: Redis, keys: Keys, type: str, object_id: str, tenant: str) -> str:
    """Add one webhook event (``type`` about ``object_id``, ``tenant``'s) to the stream; its entry id."""
    entry = await redis.xadd(keys.webhooks(), {"type": type, "id": object_id, "tenant": tenant,
                                               "at_ms": int(time.time() * 1000)},
                             maxlen=WEBHOOKS_KEPT, approximate=True)
    return entry.decode() if isinstance(entry, bytes) else str(entry)


async def watch(redis: Redis, keys: Keys, rid: str, family: str, object_id: str, tenant: str, ttl_s: int) -> None:
    """Ask that job ``rid``'s end become the webhook event ``<family>.<status>`` about ``object_id`` (status:
    completed, incomplete, cancelled or failed). Set before the job is queued (so no end can come first); lives
    ``ttl_s`` (as long as a job may)."""
    await redis.execute_command(*watching(keys, rid, family, object_id, tenant, ttl_s))


def watching(keys: Keys, rid: str, family: str, object_id: str, tenant: str, ttl_s: int) -> Command:
    """:func:`watch`'s write as a command, for the job's submit to make with its ENQUEUE (``Client.submit``'s
    ``writes``: in the same round trip, so it is set before the job is queued)."""
    if " " in family + object_id + tenant:
        raise ValueError("a webhook family, object id or tenant holds no space")
    return ("SET", keys.notify(rid), f"{family} {object_id} {tenant}", "EX", ttl_s)


async def unwatch(redis: Redis, keys: Keys, rid: str) -> None:
    """Drop :func:`watch`'s request (the job was never queued)."""
    await redis.delete(keys.notify(rid))


async def report(redis: Redis, keys: Keys) -> dict[str, Any]:
    """Webhook deliveries as the gateways recorded them: their counters (``delivered``, ``retried``, ``failed``,
    ``disabled``), the events waiting in the stream, the newest failures and the endpoints disabled by a 410
    (``mlxq status``, the dashboard)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.webhook_counts())
        pipe.xlen(keys.webhooks())
        pipe.lrange(keys.webhook_failures(), 0, 9)
        pipe.hgetall(keys.webhook_disabled())
        counts, waiting, failed, disabled = await pipe.execute()
    return {"counts": {k.decode(): int(v) for k, v in counts.items()}, "waiting": int(waiting),
            "failures": [json.loads(f) for f in failed],
            "disabled": [{"url": url, **entry} for url, entry in sorted(_disabled(disabled).items())]}


async def disable_endpoint(redis: Redis, keys: Keys, url: str, event_id: str) -> None:
    """Record that ``url`` answered 410 Gone (to the event ``event_id``): every gateway stops delivering to it
    for :data:`DISABLED_FOR_S` (or until its entry is removed: ``HDEL <prefix>:webhooks:disabled <url>``)."""
    entry = json.dumps({"at_ms": int(time.time() * 1000), "event": event_id}, separators=(",", ":"))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.webhook_disabled(), url, entry)
        pipe.expire(keys.webhook_disabled(), DISABLED_FOR_S)
        await pipe.execute()


async def disabled_endpoints(redis: Redis, keys: Keys) -> set[str]:
    """The endpoints no gateway delivers to now (a 410 within :data:`DISABLED_FOR_S`)."""
    return set(_disabled(await redis.hgetall(keys.webhook_disabled())))  # type: ignore[misc]


def _disabled(fields: dict[bytes, bytes]) -> dict[str, dict[str, Any]]:
    """The hash's entries that still count (each lapses on its own, the hash's TTL only with its newest)."""
    now_ms = int(time.time() * 1000)
    out = {}
    for url, raw in fields.items():
        try:
            entry = json.loads(raw)
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or not isinstance(entry.get("at_ms"), int):  # not ours: it still counts
            entry = {"at_ms": now_ms, "event": ""}
        if entry["at_ms"] >= now_ms - DISABLED_FOR_S * 1000:
            out[url.decode()] = entry
    return out


async def eviction_risk(redis: Redis) -> str | None:
    """Why Redis could drop kept results (and webhook events) before their time, or None: a ``maxmemory`` with
    an evicting ``maxmemory-policy`` (every other policy than ``noeviction`` may evict keys with a TTL, and kept
    results have one). With ``noeviction``, a full Redis refuses new jobs instead (``QueueOutOfMemory``)."""
    info = await redis.info("memory")
    policy, limit = str(info.get("maxmemory_policy", "noeviction")), int(info.get("maxmemory", 0) or 0)
    if limit == 0 or policy == "noeviction":
        return None
    return (f"Redis's maxmemory-policy is {policy} (maxmemory {limit} bytes): when full it evicts keys, kept "
            "results and queued jobs among them, before their time; set `maxmemory-policy noeviction` "
            "(a full Redis then refuses new jobs: QueueOutOfMemory)")
