"""On-demand loading: a worker's loadable models (``MLXQ_LOADABLE_MODELS``) load when their jobs wait and no live
worker has room for them, and unload when idle (``MLXQ_MODEL_IDLE_S``) or to make room under the weight budget
(``MLXQ_MODEL_MEMORY``, worker/budget.py); pinned models (``MLXQ_MODEL``, ``MLXQ_MODELS``) never unload.

Each claim poll of the host (every ``MLXQ_POLL_DELAY``, and at once on a producer's wake-up) pokes
:meth:`OnDemand.poke`, which looks at most once a poll period: the depth of each unloaded model's queues, and,
when jobs wait, the other workers' health records. A model no live worker has loaded with room (running and
waiting under its capacity), and none is loading, is loaded here under a short lock (``Keys.loading``, SET NX
with a TTL refreshed while the load runs): of several workers that see the same jobs one loads, the others see
the lock, then its record (loading, then serving), and load only if its room runs out; a worker that dies while
loading holds the lock at most its TTL. Once loaded, the host's next claim takes the jobs as for any model.

A load runs on the model's own MLX thread (engine/mlx/residency.py): the other models' engines step on. An unload
happens only without jobs, and never while a claim is in flight. A model whose load fails (files missing or
corrupt) is marked ``load_failed`` and never tried again by this worker; while no other live worker serves or can
load it, this worker claims its waiting jobs only to end them ``error(model_unavailable)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from mlxq.api.registry import live_workers
from mlxq.api.schema import DEFAULT_TENANT, ModelState, WorkerStatus

from .arqseam import wake
from .budget import WeightBudget
from .service import ModelService

if TYPE_CHECKING:
    from .host import WorkerHost

__all__ = ["LOCK_TTL_S", "OnDemand"]

log = logging.getLogger(__name__)
LOCK_TTL_S = 30  # the loading lock's TTL, refreshed every third of it while the load runs


class OnDemand:
    """Loads and unloads a worker's loadable models (see the module docstring)."""

    def __init__(self, host: WorkerHost, weights: dict[str, int]) -> None:
        self.host = host
        self.budget = WeightBudget(host.config.model_memory)
        now = time.monotonic()
        for name, service in host.services.items():
            service.weights_bytes = weights.get(name, 0)
            self.budget.add(name, service.weights_bytes, pinned=not service.served.loadable)
            if not service.served.loadable:
                self.budget.loaded(name, now)
        self.loads = self.unloads = self.load_failures = 0
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        self._period = host.config.poll_delay_s

    @property
    def loadable(self) -> list[ModelService]:
        return [s for s in self.host.services.values() if s.served.loadable]

    def poke(self) -> None:
        """A claim poll: look again, unless a look runs or the last one is less than a poll period old."""
        if not self.loadable or (self._task is not None and not self._task.done()):
            return
        if time.monotonic() - self._last < self._period:
            return
        self._last = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self.look())

    async def aclose(self) -> None:
        """Stop a look (and a load) in flight."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def look(self) -> None:
        """Load what waiting jobs need, fail what cannot load, unload what sat idle."""
        if self.host.draining:  # a leaving worker loads nothing (its jobs go to others); unloading is moot
            return
        try:
            cold = [s for s in self.loadable if s.state in (ModelState.UNLOADED, ModelState.LOAD_FAILED)]
            depths = await self._depths([s.name for s in cold]) if cold else {}
            wanted = [s for s in cold if depths.get(s.name, 0) > 0]
            if wanted:
                others = [w for w in await live_workers(self.host.redis, self.host.keys)
                          if w.id != self.host.config.worker_id]
                for service in wanted:
                    await self._serve_demand(service, others)
            await self._unload_idle()
        except (RedisError, OSError) as exc:
            log.warning("on-demand loading: could not read the queues (%r); looking again next poll", exc)
        except Exception:
            log.exception("on-demand loading failed; looking again next poll")

    async def _depths(self, names: list[str]) -> dict[str, int]:
        """Jobs waiting in each model's queues, every tenant's."""
        redis, keys = self.host.redis, self.host.keys
        async with redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.smembers(keys.backlog(name))
            backlogs = await pipe.execute()
        pairs = [(name, tenant) for name, members in zip(names, backlogs)
                 for tenant in {DEFAULT_TENANT, *(m.decode() for m in members)}]
        async with redis.pipeline(transaction=False) as pipe:
            for name, tenant in pairs:
                pipe.zcard(keys.queue(name, tenant))
            counts = await pipe.execute()
        depths: dict[str, int] = {}
        for (name, _), n in zip(pairs, counts):
            depths[name] = depths.get(name, 0) + int(n)
        return depths

    async def _serve_demand(self, service: ModelService, others: list[WorkerStatus]) -> None:
        if service.state is ModelState.LOAD_FAILED:
            # Its jobs are claimed here only to fail, and only while no other live worker may run them.
            service.fail_waiting = not any(w.serves(service.name) or w.can_load(service.name) for w in others)
            return
        if _room_elsewhere(service.name, others):
            return
        await self._load(service)

    async def _load(self, service: ModelService) -> None:
        """Load ``service`` under the loading lock, unloading least recently used idle models first."""
        self._sync_use()
        victims = self.budget.victims(service.name, self._busy())
        if victims is None:
            log.debug("model %s: jobs wait, but the loaded models hold jobs or are pinned: not loaded yet",
                      service.name)
            return
        key, me = self.host.keys.loading(service.name), self.host.config.worker_id
        if not await self.host.redis.set(key, me, nx=True, ex=LOCK_TTL_S):
            return  # another worker loads it: its record says so soon
        keeper = asyncio.get_running_loop().create_task(self._keep_lock(key, me))
        try:
            for name in victims:
                if not await self._unload(self.host.services[name], "to make room for " + service.name):
                    return  # a job came for it meanwhile: the next look chooses again
            await self._load_one(service)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            with contextlib.suppress(RedisError, OSError):  # ours unless it expired: the keeper refreshed it
                if await self.host.redis.get(key) == me.encode():
                    await self.host.redis.delete(key)
        wake()  # the claim poll looks at once

    async def _load_one(self, service: ModelService) -> None:
        log.info("model %s: jobs wait and no live worker has room; loading it (%.2f GiB of weights)",
                 service.name, service.weights_bytes / (1 << 30))
        service.loading = True  # (load() keeps it so until it ends)
        try:
            await self.host.health.beat()  # others see it loading here
        except BaseException:
            service.loading = False
            raise
        if await service.load_on_demand(self.host.sink):
            self.loads += 1
            self.budget.loaded(service.name, time.monotonic())
            self.host.started(service)
            log.info("model %s: loaded in %.2fs on demand", service.name, service.load_s or 0.0)
        else:
            self.load_failures += 1
            service.fail_waiting = True  # the look after this one says whether another worker may run them
        await self.host.health.beat()

    async def _keep_lock(self, key: str, me: str) -> None:
        while True:
            await asyncio.sleep(LOCK_TTL_S / 3)
            with contextlib.suppress(RedisError, OSError):
                await self.host.redis.set(key, me, xx=True, ex=LOCK_TTL_S)

    async def _unload_idle(self) -> None:
        self._sync_use()
        idle_s = self.host.config.model_idle_s
        for name in self.budget.idle(time.monotonic(), idle_s, self._busy()):
            await self._unload(self.host.services[name], f"idle for more than {idle_s:g}s")

    async def _unload(self, service: ModelService, why: str) -> bool:
        """Unload ``service`` unless a job came for it meanwhile (or a claim is in flight); whether it did."""
        if service.active or self.host.claiming or service.engine is None:
            return False
        before = service.before_load
        after = await service.unload()
        self.unloads += 1
        self.budget.unloaded(service.name)
        log.info("model %s: unloaded (%s); MLX active memory %.1f MiB (%.1f MiB before its load), cache %.1f MiB",
                 service.name, why, after.active / (1 << 20), (before.active if before else 0) / (1 << 20),
                 after.cache / (1 << 20))
        await self.host.health.beat()
        return True

    def _busy(self) -> set[str]:
        """Models that may not unload now: holding jobs, loading, or being claimed for."""
        if self.host.claiming:
            return set(self.host.services)
        return {n for n, s in self.host.services.items() if s.active or s.loading}

    def _sync_use(self) -> None:
        for name, service in self.host.services.items():
            if service.last_used is not None:
                self.budget.used(name, service.last_used)


def _room_elsewhere(model: str, others: list[WorkerStatus]) -> bool:
    """Whether another live worker loads ``model`` now, or has it loaded with room for more jobs."""
    for worker in others:
        if worker.draining:
            continue
        for m in worker.models:
            if m.name != model:
                continue
            if m.state is ModelState.LOADING or (m.state is ModelState.SERVING and m.running + m.waiting < m.capacity):
                return True
    return False

