"""The feeder: drives open batches, a bounded window of each one's lines in the queue at a time.

Any process may run one (every gateway does; ``mlxq batches feed`` for producers without one). Each looks for
open batches (``Keys.batches_open``) and takes a short lease on each it drives (``BATCH_LEASE``, renewed while
it drives): one feeder per batch at a time, and another takes over once a lease lapses (its holder died or
lost Redis). Everything a feeder needs lives in Redis, not in it: the cursor (the next line to feed), the lines
in flight, each line's outcome. So a takeover resumes where the last holder stopped:

- a line is added to the in-flight set (with the cursor moved past it) *before* its job is enqueued, and a new
  holder follows every line of that set: none is forgotten between the two;
- a line's job id is the batch's id and the line's number: enqueueing it again (a line fed twice) is a
  :class:`~api.errors.DuplicateJob`, and the feeder follows the job already there;
- a line's outcome is recorded once (``BATCH_RECORD``), however many feeders see it end.

A job whose worker dies mid-run is run again by the queue (its lease lapses): the feeder reads its last run.

This module holds the feeder and its leases; one batch's run is api/drive.py's :class:`~api.drive.Drive`, and
its lines (their format, their codec, the input file read line by line) are api/batchline.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from .batches import LEASE, BatchStore
from .batchline import LineCodec
from .client import Client
from .drive import Drive
from .errors import MlxqError
from .files import FileStore

__all__ = ["BatchFeeder", "FeederSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FeederSettings:
    """How a feeder drives batches: ``window`` jobs in flight per batch; its lease on a batch; how often it
    looks for batches; how long a line waits for a worker to serve its model before it is that line's error."""

    window: int = 256
    lease_ms: int = 10_000
    poll_s: float = 1.0
    no_worker_grace_s: float = 30.0


class BatchFeeder:
    """Drives every open batch it can take the lease of, until closed."""

    def __init__(self, client: Client, batches: BatchStore, codec: LineCodec,
                 settings: FeederSettings | None = None) -> None:
        self.client = client
        self.batches = batches
        self.files: FileStore = batches.files
        self.codec = codec
        self.settings = settings or FeederSettings()
        self.id = f"feeder-{secrets.token_hex(6)}"
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def redis(self) -> Any:
        return self.batches.redis

    def start(self) -> None:
        """Run :meth:`run` in the background until :meth:`aclose`."""
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())

    async def aclose(self) -> None:
        """Stop driving (jobs in flight run on; another feeder takes the batches once the leases lapse)."""
        tasks = [t for t in (self._task, *self._driving.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def run(self) -> None:
        """Look for open batches every ``poll_s`` and drive each one whose lease this feeder takes."""
        down, first = False, True  # Redis away since the last round that reached it: said once, not every round
        while True:
            try:
                await self.poll()
                if down:
                    log.info("batch feeder %s: Redis answers again", self.id)
                down = False
            except MlxqError as exc:
                log.warning("batch feeder %s: %s", self.id, exc)
            except Exception as exc:  # Redis away: try again next round
                if not down:
                    # at start the gateway has warned already (one line: app.py's check)
                    log.log(logging.INFO if first else logging.WARNING,
                            "batch feeder %s: Redis: %r; trying again every %.0f s", self.id, exc, self.settings.poll_s)
                down = True
            first = False
            await asyncio.sleep(self.settings.poll_s)

    async def poll(self) -> None:
        """One look: start driving the open batches whose lease is free."""
        for raw in await self.redis.smembers(self.batches.keys.batches_open()):
            bid = raw.decode()
            if bid in self._driving or not await self._lease(bid):
                continue
            task = asyncio.ensure_future(self._drive(bid))
            self._driving[bid] = task
            task.add_done_callback(functools.partial(self._driven, bid))

    def _driven(self, bid: str, _task: asyncio.Task[None]) -> None:
        self._driving.pop(bid, None)

    async def _lease(self, bid: str) -> bool:
        held = await LEASE.run(self.redis, {"lease_key": self.batches.keys.batch_lease(bid)},
                               {"feeder": self.id, "ttl_ms": self.settings.lease_ms})
        return bool(held)

    async def _drive(self, bid: str) -> None:
        """Drive one batch while the lease holds; let it go when the batch ends or the lease is lost."""
        work = asyncio.ensure_future(Drive(self, bid).run())
        lost = False
        try:
            while not work.done():
                await asyncio.wait([work], timeout=self.settings.lease_ms / 3000)
                if not work.done() and not await self._lease(bid):
                    log.warning("batch %s: lease lost to another feeder; stopping here", bid)
                    lost = True
                    work.cancel()
            await work
        except asyncio.CancelledError:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise
        except Exception:
            log.exception("batch %s: its feeder stopped; another takes it once the lease lapses", bid)
        finally:
            if work.done() and not lost:  # free it now rather than when it lapses (lost: another's now)
                with contextlib.suppress(Exception):
                    await self.redis.delete(self.batches.keys.batch_lease(bid))
