"""Turns cancel requests in Redis into engine aborts.

A client's cancel sets ``<prefix>:{rid}:cancel`` and publishes the id on ``<prefix>:cancel``. The
pub/sub wake-up is the fast path; since a wake-up can be lost (reconnects), the cancel keys of every job
this worker holds are also polled, in one pipeline, every ``poll_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from redis.asyncio import Redis
from redis.exceptions import RedisError

from mlxq.api.protocol.keys import Keys

__all__ = ["CancelWatcher"]

log = logging.getLogger(__name__)


class CancelWatcher:
    """Calls ``on_cancel(rid)`` for each held job whose cancel key appears."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        held: Callable[[], Collection[str]],
        on_cancel: Callable[[str], None],
        poll_s: float = 0.25,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self._held = held
        self._on_cancel = on_cancel
        self._poll_s = poll_s

    async def run(self) -> None:
        """Listen and poll until cancelled."""
        await asyncio.gather(self._listen(), self._poll())

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel_channel())
                async for msg in pubsub.listen():
                    rid = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
                    if rid in self._held():
                        self._on_cancel(rid)
            except (RedisError, OSError) as exc:
                log.warning("cancel channel lost (%r); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            rids = list(self._held())
            if not rids:
                continue
            try:
                for rid in await self.cancelled(rids):
                    self._on_cancel(rid)
            except (RedisError, OSError) as exc:
                log.warning("cancel poll failed: %r", exc)

    async def cancelled(self, rids: list[str]) -> list[str]:
        """Which of ``rids`` have a cancel key: one cheap command while none has (the usual case)."""
        if not await self.redis.exists(*(self.keys.cancel(rid) for rid in rids)):
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.exists(self.keys.cancel(rid))
        flags = await pipe.execute()
        return [rid for rid, flag in zip(rids, flags) if flag]
