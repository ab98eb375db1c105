"""Finds jobs whose worker died and gets them going again.

Every worker sweeps ``<prefix>:running`` every few seconds. A job there without a lease lost its worker:
while tries remain, the reaper emits ``reset`` and deletes arq's in-progress key so any worker re-runs it
at once; otherwise it emits ``error(worker_lost)`` and removes the arq job. One reaper per job at a time
(``SET {rid}:reap NX``), and its writes go through only while nobody holds the lease (fenced EMIT).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.keys import Keys
from api.schema import ErrorCode, ErrorEvent, Event, ResetEvent, decode_event, is_terminal

from .publisher import Batch, LogTTL, emit_args
from .scripts import EMIT, SWEEP, Script

__all__ = ["Reaper", "StaleClaims"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StaleClaims:
    """Where to look for stale arq claims: this worker's queue, arq's claim TTL and the lease TTL (ms)."""

    queue: str
    claim_ms: int
    lease_ms: int


class Reaper:
    """Sweeps for lost jobs every ``interval_s``."""

    def __init__(self, redis: Redis, keys: Keys, max_tries: int, interval_s: float, ttl: LogTTL,
                 claims: StaleClaims | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.max_tries = max_tries
        self.interval_s = interval_s
        self.ttl = ttl
        self.claims = claims
        self.reaped = 0
        self._script: Script | None = None
        self._sweep = Script.of(SWEEP)

    async def start(self) -> None:
        self._script = await Script.load(self.redis, EMIT)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
                if self.claims is not None:
                    await self.release_stale_claims(self.claims)
            except (RedisError, OSError) as exc:
                log.warning("reaper sweep failed: %r", exc)

    async def release_stale_claims(self, claims: StaleClaims) -> list[str]:
        """Free queued jobs that a worker claimed (arq's in-progress mark) but died before leasing.

        Between arq's claim and the job's lease there are a few milliseconds in which a SIGKILL would leave
        the job claimed for arq's whole in-progress TTL (job timeout + 40 s). A queued job whose claim is
        older than a lease TTL and that holds no lease is such a job: drop the claim so any worker runs it.
        """
        now_ms = int(time.time() * 1000)
        rids = [r.decode() for r in await self.redis.zrangebyscore(
            claims.queue, "-inf", now_ms - claims.lease_ms, start=0, num=200)]
        if not rids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.pttl(in_progress_key_prefix + rid)
            pipe.exists(self.keys.lease(rid))
        answers = await pipe.execute()
        stale = [rid for rid, pttl, leased in zip(rids, answers[::2], answers[1::2])
                 if pttl > 0 and not leased and claims.claim_ms - pttl > claims.lease_ms]
        if stale:
            await self.redis.delete(*(in_progress_key_prefix + rid for rid in stale))
        for rid in stale:
            log.info("job %s: claimed by a worker that died before starting it; released", rid)
        return stale

    async def sweep(self) -> list[str]:
        """Handle every running job that has no lease; returns their ids."""
        flat = await self._sweep.run(self.redis, [self.keys.running()], [self.keys.prefix])
        lost = {rid.decode(): queue.decode() for rid, queue in zip(flat[::2], flat[1::2])}
        for rid, queue in lost.items():
            await self._reap(rid, queue)
        return list(lost)

    async def _reap(self, rid: str, queue: str) -> None:
        guard = self.keys.reap_guard(rid)
        if not await self.redis.set(guard, b"1", nx=True, ex=30):
            return  # another worker's reaper has it
        try:
            await self._reap_guarded(rid, queue)
        finally:
            await self.redis.delete(guard)

    async def _reap_guarded(self, rid: str, queue: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(self.keys.log(rid), count=1)
        pipe.get(retry_key_prefix + rid)
        pipe.exists(job_key_prefix + rid)
        entries, tries_raw, job_exists = await pipe.execute()
        last = decode_event(entries[0][1][b"e"]) if entries else None
        if last is not None and is_terminal(last):
            await self.redis.hdel(self.keys.running(), rid)  # type: ignore[misc]  # ended; only the bookkeeping was left
            return
        seq = last.seq + 1 if last is not None else 0
        tries = int(tries_raw or 0)
        if tries < self.max_tries and job_exists:
            await self._requeue(rid, queue, ResetEvent(id=rid, seq=seq, reason="worker lost; job re-queued",
                                                attempt=tries + 1))
        else:
            msg = f"the worker running this job was lost (try {tries} of {self.max_tries})"
            await self._give_up(rid, queue, ErrorEvent(id=rid, seq=seq, code=ErrorCode.WORKER_LOST,
                                                       message=msg, retryable=True))

    async def _requeue(self, rid: str, queue: str, event: Event) -> None:
        if await self._emit(rid, queue, event, "release"):  # also re-queues it, atomically
            self.reaped += 1
            log.info("job %s: worker lost; re-queued (%s)", rid, event.type)

    async def _give_up(self, rid: str, queue: str, event: Event) -> None:
        if await self._emit(rid, queue, event, "end"):  # also finishes the arq job
            self.reaped += 1
            log.info("job %s: worker lost on its last try; failed", rid)

    async def _emit(self, rid: str, queue: str, event: Event, mode: str) -> bool:
        assert self._script is not None
        args = emit_args(self.keys, [Batch(rid, "", [event], mode)], self.ttl, queue)
        (ok,) = await self._script.run(self.redis, *args)
        return bool(ok == 1)
