"""Webhook delivery: the gateways POST the webhook stream's events (``Keys.webhooks()``, api/protocol/notify.py)
to ``MLXQ_WEBHOOK_URL``, in OpenAI's format, signed per Standard Webhooks.

- **Format**: a thin payload, ``{"id": "evt_...", "object": "event", "created_at": <s>, "type": "response.completed",
  "data": {"id": "resp_..."}}``; headers ``webhook-id`` (the event id, the same on every attempt),
  ``webhook-timestamp`` (the attempt's, Unix seconds) and ``webhook-signature: v1,<base64 HMAC-SHA256 of
  "id.timestamp.body">`` keyed with the ``whsec_`` secret's bytes: what the openai SDK's
  ``client.webhooks.unwrap(body, headers, secret=...)`` verifies.
- **One delivery per event across gateways**: the gateways read the stream as one consumer group
  (XREADGROUP); an event is acknowledged (XACK, and deleted) once every endpoint took it or was given up on. A
  gateway keeps the events it is retrying its own (XCLAIM resets their idle time every third of
  ``MLXQ_WEBHOOK_CLAIM``); those a dead gateway held go idle and another takes them (XAUTOCLAIM) and starts their
  schedule over: at least once, never lost while the stream holds them.
- **Retries**: attempt *i* waits ``MLXQ_WEBHOOK_SCHEDULE[i]`` seconds (or a 429/503's ``Retry-After``, if later);
  any 2xx is success; 410 disables the endpoint for every gateway (``Keys.webhook_disabled()``, for
  ``notify.DISABLED_FOR_S``; counted): each round of attempts reads the disabled ones first; after the last attempt
  the event is recorded as failed (``Keys.webhook_failures()``, and ``Keys.webhook_counts()``: ``mlxq status``,
  the dashboard).
- Deliveries run in their own tasks, at most ``MLXQ_WEBHOOK_CONCURRENCY`` at once, each POST within
  ``MLXQ_WEBHOOK_TIMEOUT``: they never hold up requests or jobs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from ..protocol.keys import Keys
from ..protocol.notify import FAILURES_KEPT, RECORD_TTL_S, WebhookEntry, disable_endpoint, disabled_endpoints
from .config import WEBHOOK_SECRET_PREFIX, GatewayConfig

__all__ = ["GROUP", "Deliverer", "WebhookSettings", "payload", "sign"]

log = logging.getLogger(__name__)

GROUP = "gateways"  # the consumer group every gateway of a deployment reads the stream in
MAX_HELD = 10_000  # events one gateway holds at once (most wait for a retry; POSTs are MLXQ_WEBHOOK_CONCURRENCY)
_RETRY_AFTER_MAX_S = 3600.0  # a Retry-After later than this is taken as this
_READ_BLOCK_MS = 1000
_USER_AGENT = "mlxq-webhooks/1 (+Standard Webhooks)"


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """What delivery needs of the gateway's configuration."""

    urls: tuple[str, ...]
    secret: bytes  # the secret's bytes (what follows ``whsec_``, decoded)
    schedule: tuple[float, ...]
    timeout_s: float
    concurrency: int
    claim_s: float

    @classmethod
    def of(cls, config: GatewayConfig) -> WebhookSettings | None:
        """The configuration's webhook settings; None when no endpoint is set."""
        if not config.webhook_urls:
            return None
        secret = base64.b64decode(config.webhook_secret[len(WEBHOOK_SECRET_PREFIX):])
        return cls(config.webhook_urls, secret, config.webhook_schedule, config.webhook_timeout_s,
                   config.webhook_concurrency, config.webhook_claim_s)


def payload(entry: WebhookEntry) -> bytes:
    """The event's body, as OpenAI sends it (thin: the receiver GETs the object)."""
    return json.dumps({"id": entry.event_id, "object": "event", "created_at": entry.at_ms // 1000,
                       "type": entry.type, "data": {"id": entry.id}}, separators=(",", ":")).encode()


def sign(secret: bytes, event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Standard Webhooks' headers of one attempt: id, timestamp and the v1 signature over ``id.timestamp.body``."""
    mac = hmac.new(secret, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return {"webhook-id": event_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": "v1," + base64.b64encode(mac).decode()}


Settle = Callable[[WebhookEntry], Awaitable[None]]


class Deliverer:
    """One gateway's webhook deliveries: a reader of the stream (its new events and the ones a dead gateway
    left), and a task per event it holds. ``settle``: called before an event's first attempt (a background
    response's end recorded, so the receiver's GET finds it settled)."""

    def __init__(self, redis: Redis, keys: Keys, settings: WebhookSettings, settle: Settle | None = None,
                 consumer: str | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.redis, self.keys, self.settings, self.settle = redis, keys, settings, settle
        self.consumer = consumer or uuid.uuid4().hex[:12]
        self.http = httpx.AsyncClient(timeout=settings.timeout_s, transport=transport, follow_redirects=False,
                                      headers={"user-agent": _USER_AGENT, "content-type": "application/json"})
        self.held: dict[str, asyncio.Task[None]] = {}  # entry id -> its delivery
        self.disabled: set[str] = set()  # endpoints that answered 410 here (the deployment's list is in Redis)
        self._reading_disabled: asyncio.Future[set[str]] | None = None
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start reading the stream (call on the event loop)."""
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._tend())]

    async def aclose(self) -> None:
        """Stop: the events held stay pending, and another gateway (or this one's next start) takes them."""
        for task in (*self._tasks, *self.held.values()):
            task.cancel()
        await asyncio.gather(*self._tasks, *self.held.values(), return_exceptions=True)
        await self.http.aclose()

    async def _group(self) -> None:
        with contextlib.suppress(ResponseError):  # BUSYGROUP: another gateway made it
            await self.redis.xgroup_create(self.keys.webhooks(), GROUP, id="0", mkstream=True)

    async def _read(self) -> None:
        """New events, as long as a delivery slot is free (a backlog stays in the stream, for any gateway)."""
        made = False
        while True:
            try:
                if not made:
                    await self._group()
                    made = True
                room = min(MAX_HELD - len(self.held), 4 * self.settings.concurrency)
                if room <= 0:
                    await asyncio.sleep(0.05)
                    continue
                got = await self.redis.xreadgroup(GROUP, self.consumer, {self.keys.webhooks(): ">"}, count=room,
                                                  block=_READ_BLOCK_MS)
                for _, entries in got or []:
                    for entry_id, fields in entries:
                        self._hold(WebhookEntry.of(entry_id, fields))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                if "NOGROUP" in str(exc):
                    made = False  # the stream was deleted (FLUSHALL): make the group again
                log.warning("webhooks: reading the stream failed: %r", exc)
                await asyncio.sleep(1.0)
            except Exception:  # a bug: logged, and the reader goes on (its events stay pending meanwhile)
                log.exception("webhooks: the stream's reader failed")
                await asyncio.sleep(1.0)

    async def _tend(self) -> None:
        """Every third of the claim time: keep the held events ours (their idle time reset), and take those idle
        past it (a dead gateway's)."""
        claim_ms = int(self.settings.claim_s * 1000)
        while True:
            await asyncio.sleep(self.settings.claim_s / 3)
            try:
                if self.held:
                    await self.redis.xclaim(self.keys.webhooks(), GROUP, self.consumer, 0, list(self.held),
                                            justid=True)
                room = min(MAX_HELD - len(self.held), 4 * self.settings.concurrency)
                if room > 0:
                    reply = await self.redis.xautoclaim(self.keys.webhooks(), GROUP, self.consumer, claim_ms,
                                                        count=room)
                    for entry_id, fields in reply[1]:
                        if fields is not None:
                            self._hold(WebhookEntry.of(entry_id, fields))
                    for gone in reply[2] if len(reply) > 2 else []:  # trimmed away while pending: ack it
                        await self.redis.xack(self.keys.webhooks(), GROUP, gone)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("webhooks: tending pending events failed: %r", exc)
            except Exception:  # a bug: logged, and the next round tries again
                log.exception("webhooks: tending pending events failed")

    def _hold(self, entry: WebhookEntry) -> None:
        if entry.entry in self.held:
            return
        task = asyncio.ensure_future(self._deliver(entry))
        self.held[entry.entry] = task
        task.add_done_callback(lambda done: self._released(entry, done))

    def _released(self, entry: WebhookEntry, task: asyncio.Task[None]) -> None:
        """A delivery ended; one that failed (a bug) leaves its event pending, for a gateway's next claim."""
        self.held.pop(entry.entry, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("webhooks: delivering %s (%s %s) failed: %r", entry.event_id, entry.type, entry.id, exc)

    async def _deliver(self, entry: WebhookEntry) -> None:
        """Every endpoint's attempts on the schedule; then the event acknowledged and deleted."""
        if self.settle is not None:
            try:
                await self.settle(entry)
            except Exception as exc:  # its GET still works: it settles on read
                log.warning("webhooks: %s %s: settling it first failed: %r", entry.type, entry.id, exc)
        body = payload(entry)
        pending = list(self.settings.urls)
        failures: dict[str, str] = {}
        attempts = dict.fromkeys(pending, 0)
        wait = 0.0
        for i, delay in enumerate(self.settings.schedule):
            await asyncio.sleep(max(delay, wait) if i else delay)
            wait = 0.0
            gone = await self._gone()  # a 410 any gateway saw since the last round counts in this one
            left = []
            for url in pending:
                if url in gone:
                    failures.pop(url, None)
                    continue
                outcome, retry_after = await self._attempt(url, entry, body)
                attempts[url] += 1
                if outcome == "ok" or outcome == "gone":
                    failures.pop(url, None)
                    continue
                failures[url] = outcome
                left.append(url)
                wait = max(wait, retry_after)
            pending = left
            if not pending:
                break
            await self._count("retried")
        for url in pending:
            await self._failed(entry, url, failures.get(url, ""), attempts[url])
        await self._done(entry)

    async def _gone(self) -> set[str]:
        """The endpoints disabled by a 410, here or at any gateway; the deliveries that ask together share one
        read (Redis away: those this gateway saw)."""
        if self._reading_disabled is None:
            self._reading_disabled = asyncio.ensure_future(disabled_endpoints(self.redis, self.keys))
            self._reading_disabled.add_done_callback(lambda _: setattr(self, "_reading_disabled", None))
        try:
            shared = await asyncio.shield(self._reading_disabled)
        except (RedisError, OSError) as exc:
            log.warning("webhooks: reading the disabled endpoints failed: %r", exc)
            shared = set()
        return self.disabled | shared

    async def _attempt(self, url: str, entry: WebhookEntry, body: bytes) -> tuple[str, float]:
        """One POST: ``ok``, ``gone`` (410: the endpoint disabled) or why it failed; and a Retry-After (s)."""
        headers = sign(self.settings.secret, entry.event_id, int(time.time()), body)
        async with self._slots:
            try:
                resp = await self.http.post(url, content=body, headers=headers)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"[:300], 0.0
        if 200 <= resp.status_code < 300:
            await self._count("delivered")
            return "ok", 0.0
        if resp.status_code == 410:
            log.warning("webhooks: %s answered 410 Gone: no more deliveries to it from any gateway", url)
            self.disabled.add(url)
            try:
                await disable_endpoint(self.redis, self.keys, url, entry.event_id)
            except (RedisError, OSError) as exc:  # this gateway stops anyway; the others at their own 410
                log.warning("webhooks: recording %s as disabled failed: %r", url, exc)
            await self._count("disabled")
            return "gone", 0.0
        retry_after = 0.0
        if resp.status_code in (429, 503):
            with contextlib.suppress(ValueError):
                retry_after = min(_RETRY_AFTER_MAX_S, float(resp.headers.get("retry-after", "0")))
        return f"HTTP {resp.status_code}", retry_after

    async def _failed(self, entry: WebhookEntry, url: str, why: str, attempts: int) -> None:
        log.error("webhooks: %s %s (%s) not delivered to %s after %d attempts: %s", entry.type, entry.id,
                  entry.event_id, url, attempts, why)
        record = json.dumps({"event": entry.event_id, "type": entry.type, "id": entry.id, "tenant": entry.tenant,
                             "url": url, "error": why, "attempts": attempts, "at_ms": int(time.time() * 1000)})
        with contextlib.suppress(RedisError, OSError):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.lpush(self.keys.webhook_failures(), record)
                pipe.ltrim(self.keys.webhook_failures(), 0, FAILURES_KEPT - 1)
                pipe.expire(self.keys.webhook_failures(), RECORD_TTL_S)
                await pipe.execute()
        await self._count("failed")

    async def _count(self, field: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(self.keys.webhook_counts(), field, 1)
                pipe.expire(self.keys.webhook_counts(), RECORD_TTL_S)
                await pipe.execute()

    async def _done(self, entry: WebhookEntry) -> None:
        """Acknowledge and drop the event (retried while Redis is away: an unacknowledged one is delivered again)."""
        for attempt in range(30):
            try:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.xack(self.keys.webhooks(), GROUP, entry.entry)
                    pipe.xdel(self.keys.webhooks(), entry.entry)
                    await pipe.execute()
                return
            except (RedisError, OSError) as exc:
                log.warning("webhooks: acknowledging %s failed (attempt %d): %r", entry.event_id, attempt + 1, exc)
                await asyncio.sleep(min(10.0, 0.2 * 2 ** attempt))
