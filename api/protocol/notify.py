"""Notifications of ended objects (a batch, a background response): one stream every webhook sender reads.

:func:`publish` appends ``{type, id, tenant, at_ms}`` to ``Keys.webhooks()``, trimmed to about
:data:`MAX_NOTIFICATIONS` entries: a sender that falls that far behind loses the oldest.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from .keys import Keys

__all__ = ["MAX_NOTIFICATIONS", "publish"]

MAX_NOTIFICATIONS = 100_000  # entries kept (approximately: MAXLEN ~)


async def publish(redis: Redis, keys: Keys, type: str, object_id: str, tenant: str) -> None:
    """Append one notification: ``type`` (e.g. ``batch.completed``) of object ``object_id`` of ``tenant``."""
    fields = {"type": type, "id": object_id, "tenant": tenant, "at_ms": str(int(time.time() * 1000))}
    await redis.xadd(keys.webhooks(), fields, maxlen=MAX_NOTIFICATIONS, approximate=True)  # type: ignore[arg-type]
