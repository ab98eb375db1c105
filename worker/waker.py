"""Wake arq's queue poll on demand instead of polling every few milliseconds.

arq polls its queue on a fixed period: a short period adds little latency but costs a Redis round trip
(and GIL time next to the MLX thread) every few ms even when idle; a long one adds up to a period to every
job's start. Producers (``api.client.Client.submit``) publish a wake-up on ``<prefix>:wake:<model>``
with each burst of jobs, and a job's end wakes the poll when jobs wait for its slot
(``settings.after_job_end``), so arq's poll can sleep for ``poll_delay`` as a fallback (lost wake-ups,
deferred retries, producers that send none).

Enqueues from several producers arrive as a burst of wake-ups, and polling at the first one claims a job
or two, then the rest in pieces, each piece a prefill step of its own. So once woken, the poll waits while
wake-ups keep coming less than ``_BURST_GAP_S`` apart (at most ``_BURST_MAX_S``) and claims the burst in
one call; a lone job waits ``_BURST_GAP_S`` more.

arq 0.28 (pinned) reads its ``poll`` helper from ``arq.worker``'s globals in ``Worker.main``; :func:`install`
replaces it with :func:`wakeable_poll`, which sleeps until the period ends or :func:`wake` is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

import arq.worker
from redis.asyncio import Redis
from redis.exceptions import RedisError

__all__ = ["install", "listen", "wake", "wakeable_poll"]

log = logging.getLogger(__name__)
_events: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}
_BURST_GAP_S = 0.0005
_BURST_MAX_S = 0.005


def _event() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    event = _events.get(loop)
    if event is None:
        for stale in [lp for lp in _events if lp.is_closed()]:
            del _events[stale]
        event = _events[loop] = asyncio.Event()
    return event


def wake() -> None:
    """Make every arq poll loop on this event loop look at its queue now."""
    _event().set()


async def wakeable_poll(step: float = 0.5) -> AsyncGenerator[float, None]:
    """Drop-in for ``arq.utils.poll``: yields, then sleeps ``step`` seconds or until :func:`wake`."""
    loop = asyncio.get_running_loop()
    event = _event()
    start = loop.time()
    while True:
        event.clear()
        yield loop.time() - start
        if not event.is_set():
            # Not wait_for: on Python 3.11 a cancel landing as the wake-up does returned the wake-up and
            # dropped the cancel, and arq's stop (it cancels this loop) hung the worker after SIGTERM.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step):
                    await event.wait()
        if event.is_set():
            await _burst_settled(event, loop.time() + _BURST_MAX_S)


async def _burst_settled(event: asyncio.Event, until: float) -> None:
    """Return once no wake-up came for ``_BURST_GAP_S``, or at ``until``."""
    loop = asyncio.get_running_loop()
    while True:
        event.clear()
        await asyncio.sleep(_BURST_GAP_S)
        if not event.is_set() or loop.time() >= until:
            return


def install() -> None:
    """Use :func:`wakeable_poll` in arq's worker loop (idempotent)."""
    arq.worker.poll = wakeable_poll  # type: ignore[attr-defined]


async def listen(redis: Redis, channel: str) -> None:
    """Wake the poll on every message on ``channel`` (producers' wake-ups) until cancelled."""
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            wake()  # anything enqueued while we were not listening
            async for _ in pubsub.listen():
                wake()
        except (RedisError, OSError) as exc:
            log.warning("wake-up channel lost (%r); resubscribing", exc)
            await asyncio.sleep(0.5)
        finally:
            await pubsub.aclose()
