"""Prefix affinity, a worker's side: which affinity keys (api/affinity.py) its prefix caches hold, advertised in
Redis for CLAIM (api/protocol/lua/affinity.lua), and how CLAIM placed its jobs.

A worker cannot ask its prefix cache which keys it holds (the cache knows tokens, not keys), so it keeps an
approximation per model (:class:`Holdings`): a job's key is held from the moment the job goes into the engine
with a prompt the cache would store (its prefill stores it), and while the entry its prompt's start made is still
cached, in memory or on disk (the disk's entries carry their keys: a restarted worker advertises them from its
first heartbeat, :meth:`Holdings.seed`). A job with keys at two depths (its conversation's and its system
prompt's alone: api/affinity.py) holds both, the system prompt's checked by the system prompt's own tokens. Each
heartbeat asks the engine, on its MLX thread, which of the keys no running job holds are still cached (a short
trie lookup of each key's first ``ANCHOR_TOKENS`` prompt tokens), and drops the rest once the answer comes; the
beat does not wait for it (the thread may be in a long prefill: a heartbeat held up by it would make a live worker
look dead), but writes what the last answer left, and an answer that drops keys is written when it comes. The
bound (``MAX_KEYS``) drops the least recently used. The advertisement lives ``ttl`` (a few
heartbeats): a stopped (or draining) worker removes it, and a dead or frozen one's lapses; CLAIM counts an
advertiser live until then. A worker with a prefix cache is listed from its first heartbeat, even advertising no
key: CLAIM spreads the jobs whose key no worker has warm over the live advertisers with room, the fewest keys
first (each waiting at most the same wait), so the conversations, and their work, spread over the fleet; and it
adds a started job's keys to its claimer's advertisement at once (the next write here keeps them or not).

A worker whose engine for a model is full (no free slot, or no KV headroom) says so
(``Keys.affinity_full``): CLAIM then lets another worker take its keys' jobs at once rather than after the wait.
The mark is written only when the engine fills or frees (checked at each claim, each job's end and each
heartbeat), at most once per ``FULL_EVERY_S`` (a flapping engine's states in between are coalesced), and renewed
with the advertisement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from mlxq.api.protocol.claim import Affinity
from mlxq.api.protocol.keys import Keys

__all__ = ["ANCHOR_TOKENS", "FULL_EVERY_S", "MAX_KEYS", "Advertiser", "Holdings", "Placements", "affinity_ttl_s"]

log = logging.getLogger(__name__)

MAX_KEYS = 256  # keys advertised per model: more than the prefix cache's entries in memory and on disk
ANCHOR_TOKENS = 256  # a key's prompt start looked up in the cache to tell whether the key is still held
FULL_EVERY_S = 0.2  # the full mark is written at most this often per worker (one Redis write, a few a second at most)

# (model's prompts) -> whether the model's prefix cache still holds each one's start; on the MLX thread
Check = Callable[[list[list[int]]], Awaitable[list[bool]]]


class Holdings:
    """One model's affinity keys whose prompts its prefix cache holds (an approximation: see the module
    docstring), at most ``max_keys``, least recently used dropped first."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._anchors: OrderedDict[str, list[int]] = OrderedDict()
        self._running: Counter[str] = Counter()
        self.version = 0  # changes whenever the keys do: the advertisement is rewritten

    def __len__(self) -> int:
        return len(self._anchors)

    def keys(self) -> list[str]:
        return list(self._anchors)

    def started(self, key: str, prompt: Sequence[int]) -> None:
        """A job of ``key`` went into the engine: its prompt's prefill stores its start in the cache."""
        new = key not in self._anchors
        self._anchors[key] = list(prompt[:ANCHOR_TOKENS])
        self._anchors.move_to_end(key)
        self._running[key] += 1
        while len(self._anchors) > self.max_keys:
            oldest = next((k for k in self._anchors if not self._running[k]), None)
            if oldest is None:
                break
            del self._anchors[oldest]
            new = True
        if new:
            self.version += 1

    def seed(self, tagged: Sequence[tuple[str, Sequence[int]]]) -> None:
        """At the start: the keys the prefix cache's tier on disk holds (least recently used first), as a
        previous run of this worker left them; each heartbeat checks them as any other."""
        for key, tokens in tagged:
            if key not in self._anchors and len(self._anchors) < self.max_keys:
                self._anchors[key] = list(tokens[:ANCHOR_TOKENS])
                self.version += 1

    def ended(self, key: str) -> None:
        """A job of ``key`` left the engine (its entry is stored by then, or its key is checked at the next
        heartbeat)."""
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]

    def idle(self) -> dict[str, list[int]]:
        """The keys no job in the engine holds, with their prompts' starts: those a heartbeat checks."""
        return {k: a for k, a in self._anchors.items() if not self._running[k]}

    def keep(self, checked: dict[str, list[int]], held: Sequence[bool]) -> None:
        """Drop the checked keys the cache no longer holds (evicted), unless a job of theirs started since (the
        check was asked before it, and its prefill stores the key's prompt again: :meth:`started` gave the key a
        new anchor, so the checked one is no longer it)."""
        gone = [k for k, h in zip(checked, held) if not h and self._anchors.get(k) is checked[k]]
        for k in gone:
            del self._anchors[k]
        if gone:
            self.version += 1

    def clear(self) -> None:
        """The cache was emptied (its engine failed): nothing is held."""
        if self._anchors:
            self._anchors.clear()
            self.version += 1


@dataclass(slots=True)
class Placements:
    """How CLAIM placed one model's jobs on this worker (jobs with an affinity key only)."""

    counts: Counter[Affinity] = field(default_factory=Counter)

    def add(self, placed: Affinity | None) -> None:
        if placed is not None:
            self.counts[placed] += 1

    @property
    def holder(self) -> int:
        return self.counts[Affinity.HOLDER]

    @property
    def elsewhere(self) -> int:
        return self.counts[Affinity.ELSEWHERE]

    @property
    def none(self) -> int:
        return self.counts[Affinity.NONE]


class Advertiser:
    """Writes a worker's holdings to Redis (``Keys.affinity_keys`` and ``Keys.affinity_advertisers``, per model):
    at once when a key is added, and every heartbeat after checking the cache; removes them at the stop."""

    def __init__(self, redis: Redis, keys: Keys, worker_id: str, ttl_s: float,
                 full_every_s: float = FULL_EVERY_S) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.full_every_s = full_every_s
        self.holdings: dict[str, Holdings] = {}
        self.placements: dict[str, Placements] = {}
        self.full: set[str] = set()  # the models whose engines are full now
        self.full_writes = 0  # full marks written or cleared on a change (not the heartbeat's renewals)
        self._written: dict[str, int] = {}  # model -> the holdings' version last written
        self._full_written: set[str] = set()  # the full marks as last written
        self._full_at = -float("inf")  # when (monotonic) a change to them was last written
        self._pending: asyncio.Task[None] | None = None
        self._full_pending: asyncio.Task[None] | None = None
        self._checking: dict[str, asyncio.Task[None]] = {}  # model -> its cache's check, asked and not answered
        self._withdrawn = False  # stopping or draining: it takes no more jobs, so it advertises nothing

    def model(self, name: str) -> Holdings:
        if name not in self.holdings:
            self.holdings[name] = Holdings()
            self.placements[name] = Placements()
        return self.holdings[name]

    def started(self, model: str, keys: str | Sequence[str], prompt: Sequence[int]) -> None:
        """A job of ``keys`` (its affinity keys, at each depth: api/affinity.py) went into ``model``'s engine:
        advertise the new ones now. Each is checked at heartbeats by the prompt's start, as one key is."""
        holdings = self.model(model)
        for key in [keys] if isinstance(keys, str) else keys:
            holdings.started(key, prompt)
        self._changed(model)

    def _changed(self, model: str) -> None:
        """Write ``model``'s keys soon if they changed since last written."""
        if self.holdings[model].version != self._written.get(model) and self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._write_soon())

    def ended(self, model: str, keys: Sequence[str]) -> None:
        """A job of ``keys`` left ``model``'s engine."""
        for key in keys:
            self.holdings[model].ended(key)

    async def _write_soon(self) -> None:
        try:
            await self.write()
        finally:
            self._pending = None

    def set_full(self, model: str, full: bool) -> None:
        """Whether ``model``'s engine is full now: a change is written soon (rate-limited), an unchanged state
        costs nothing."""
        if model not in self.holdings or (model in self.full) == full:
            return
        if full:
            self.full.add(model)
        else:
            self.full.discard(model)
        if self._full_pending is None and not self._withdrawn:
            self._full_pending = asyncio.get_running_loop().create_task(self._write_full_soon())

    async def _write_full_soon(self) -> None:
        """Write the marks that changed, at most once per ``full_every_s``, until a pause finds none changed."""
        try:
            while not self._withdrawn:
                await asyncio.sleep(max(0.0, self._full_at + self.full_every_s - time.monotonic()))
                marked = set(self.full)
                changed = marked ^ self._full_written  # states that flapped back meanwhile write nothing
                if not changed or self._withdrawn:
                    return
                self._full_at = time.monotonic()
                now_ms = int(time.time() * 1000)
                try:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for model in changed:
                            self._write_full(pipe, model, model in marked, now_ms)
                        await pipe.execute()
                except (RedisError, OSError) as exc:  # the next heartbeat writes them again
                    log.warning("could not mark the engines full or free for prefix affinity: %r", exc)
                    return
                self._full_written = marked
                self.full_writes += 1
        finally:
            self._full_pending = None

    def _write_full(self, pipe: Redis, model: str, full: bool, now_ms: int) -> None:
        key = self.keys.affinity_full(model)
        if full:
            pipe.zadd(key, {self.worker_id: now_ms + self.ttl_ms})
            pipe.pexpire(key, self.ttl_ms)
        else:
            pipe.zrem(key, self.worker_id)

    async def refresh(self, checks: Mapping[str, Check]) -> None:
        """Each heartbeat: ask each model's cache which of its idle keys it still holds (``checks``: the models with
        a prefix cache; not awaited, see the module docstring), then rewrite every advertisement (its TTL too)
        with the keys as the last answers left them."""
        for name, check in checks.items():
            self.model(name)
            if name not in self._checking and not self._withdrawn:
                self._checking[name] = asyncio.get_running_loop().create_task(self._check(name, check))
        await self.write(force=True)

    async def _check(self, model: str, check: Check) -> None:
        """Ask ``model``'s cache about its idle keys; drop those it evicted, and advertise without them soon."""
        try:
            holdings = self.holdings[model]
            idle = holdings.idle()
            if idle:
                holdings.keep(idle, await check(list(idle.values())))
                self._changed(model)
        except Exception:  # an engine stopping under the check: the next beat asks again
            log.warning("could not check the prefix affinity keys of %s", model, exc_info=True)
        finally:
            self._checking.pop(model, None)

    async def write(self, force: bool = False) -> None:
        """Write the models' key sets whose holdings changed (``force``: all of them, renewing their TTL)."""
        now_ms = int(time.time() * 1000)
        changed = {m: h for m, h in self.holdings.items() if force or h.version != self._written.get(m)}
        if not changed or self._withdrawn:
            return
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                for model, holdings in changed.items():
                    self._write_model(pipe, model, holdings.keys(), now_ms)
                    if force:  # the full marks renewed (or cleared) with the advertisement
                        self._write_full(pipe, model, model in self.full, now_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # the next heartbeat writes them again
            log.warning("could not advertise the prefix affinity keys: %r", exc)
            return
        for model, holdings in changed.items():
            self._written[model] = holdings.version
        if force:
            self._full_written = self.full & set(changed)

    def _write_model(self, pipe: Redis, model: str, keys: list[str], now_ms: int) -> None:
        own, advertisers = self.keys.affinity_keys(model, self.worker_id), self.keys.affinity_advertisers(model)
        pipe.delete(own)
        if keys:
            pipe.sadd(own, *keys)
            pipe.pexpire(own, self.ttl_ms)
        # listed even advertising no key: a live worker with fewer keys is the one to take a job nobody has warm
        pipe.zadd(advertisers, {self.worker_id: now_ms + self.ttl_ms})
        pipe.pexpire(advertisers, self.ttl_ms)

    async def remove(self) -> None:
        """At the stop (or the drain's start): this worker takes no more jobs, so it advertises nothing from here
        on (a dead one's advertisement lapses instead)."""
        self._withdrawn = True
        for task in (self._pending, self._full_pending, *self._checking.values()):
            if task is not None:
                task.cancel()
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                for model in self.holdings:
                    pipe.delete(self.keys.affinity_keys(model, self.worker_id))
                    pipe.zrem(self.keys.affinity_advertisers(model), self.worker_id)
                    pipe.zrem(self.keys.affinity_full(model), self.worker_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not withdraw the prefix affinity keys (they lapse on their own): %r", exc)


def affinity_ttl_s(heartbeat_s: float) -> float:
    """How long an advertisement lives: three heartbeats (one missed write is no death), at least two seconds."""
    return max(2.0, 3 * heartbeat_s)

