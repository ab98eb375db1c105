"""Wakes arq's queue poll when a producer enqueues, instead of polling every few milliseconds.

A short poll period adds little latency but costs a Redis round trip (and GIL time next to the MLX threads)
every few ms even when idle; a long one adds up to a period to every job's start. Producers publish a
wake-up on ``<prefix>:wake:<model>`` with each burst of jobs (``api.protocol.enqueuer``), and this listener makes the
poll look at once (``worker.arqseam.wake``), so the poll period (``MLXQ_POLL_DELAY``) is only a fallback for
lost wake-ups and producers that send none.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from .arqseam import wake

__all__ = ["listen"]

log = logging.getLogger(__name__)


async def listen(redis: Redis, channels: list[str]) -> None:
    """Wake the poll on every message on ``channels`` (one per served model) until cancelled."""
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(*channels)
            wake()  # anything enqueued while we were not listening
            async for _ in pubsub.listen():
                wake()
        except (RedisError, OSError) as exc:
            log.warning("wake-up channel lost (%r); resubscribing", exc)
            await asyncio.sleep(0.5)
        finally:
            await pubsub.aclose()
