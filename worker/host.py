"""A worker process: the models it serves, and what they share; arq's seam hands it due jobs.

The host claims jobs from every served model's queue in one call (up to what each engine has room for) and
runs each job as a thin coroutine (:meth:`WorkerHost._run`): decide its fate (an earlier run's end, a waiting
cancel, no tries left, a dead engine), prepare it for its model (worker/jobs/prepare.py: one call, given what it
needs of the model), hand the request to the engine, await its end. A run never touches MLX, so cancelling it
(arq's timeout, shutdown) only posts an abort that the engine applies between steps on its own thread. How a job
moves (claimed, ended, handed back, reaped, fenced, expired) is worker/jobs/, and its run table makes every move:
this module says when.

Shared by every model: the Redis connections, the transitions, the run table (one EMIT per batch of outputs,
whichever engines made them), the tenants' weights, the lease keeper, the reaper, the cancel watcher, the wake-up
listener and the health record. A model whose engine dies stops taking jobs and shows as dead in the health
record; the process exits for its supervisor only when every engine is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from mlxq.api.connection import redis_client
from mlxq.api.protocol.claim import BelowShare, Due, DueEntry, EntryStatus, Outranking
from mlxq.api.protocol.emit import LogTTL
from mlxq.api.protocol.jobrecord import Envelope, read_job
from mlxq.api.protocol.notify import eviction_risk
from mlxq.api.schema import DEFAULT_TENANT, ErrorCode, ModelState, WorkerStatus, is_terminal
from mlxq.api.schema.requests import MAX_KEEP_RESULT_S
from mlxq.engine.core.request import RequestOutput
from mlxq.engine.mlx.process import MLXLimits, mlx_process

from . import arqseam, waker
from .affinity import Advertiser, affinity_ttl_s
from .arqseam import Claims, Outcome
from .budget import model_weights
from .cancels import CancelWatcher
from .config import WorkerConfig
from .health import HealthReporter, TokenRate, package_version
from .jobs.prepare import BadRequest, Prepared, prepare
from .jobs.run import Run, State
from .jobs.table import RunTable
from .jobs.transitions import Transitions
from .jobs.translate import output_events
from .leases import LeaseKeeper
from .metrics import Metrics
from .ondemand import OnDemand
from .reaper import Reaper
from .service import ModelService

__all__ = ["ENGINE_DEAD_EXIT", "WorkerHost"]

log = logging.getLogger(__name__)
ENGINE_DEAD_EXIT = 70  # EX_SOFTWARE: the supervisor restarts the worker
_VERSION = package_version()


def _weight(raw: bytes | None) -> float:
    """A tenant's weight as its policy entry holds it (1: none, or not a positive number)."""
    try:
        weight = float(raw) if raw is not None else 1.0
    except ValueError:
        return 1.0
    return weight if weight > 0 else 1.0


class WorkerHost:
    """Serves ``config.served`` from Redis for an arq worker (``worker.arqseam.Host``)."""

    def __init__(self, config: WorkerConfig, redis: Redis) -> None:
        self.config = config
        self.keys = config.keys
        self.redis = redis
        self.services = {served.name: ModelService(served, config) for served in config.served}
        ttl = LogTTL(live=config.live_ttl_s, done=config.done_ttl_s, result=config.keep_result_s)
        # Event writes are serial: a connection of their own skips the pool's per-command checkout (a
        # health-check read on the event loop, which shares the GIL with the engines).
        self._writer = Redis(connection_pool=redis.connection_pool, single_connection_client=True)
        self.transitions = Transitions(redis, self.keys, config.worker_id, ttl, config.lease_ttl_s,
                                       writer=self._writer, affinity_wait_ms=int(config.affinity_wait_ms))
        # Which affinity keys this worker's prefix caches hold, advertised for CLAIM (worker/affinity.py).
        self.affinity = Advertiser(redis, self.keys, config.worker_id, affinity_ttl_s(config.heartbeat_s))
        # The runs in an engine, by job id: every change to one, and every event write, is the table's.
        self.runs = RunTable(self.transitions, output_events, self.services, give_up_s=config.lease_ttl_s)
        self.leases = LeaseKeeper(self.transitions, self.runs, config.lease_ttl_s, self.runs.lose)
        self.reaper = Reaper(self.runs, config.max_tries, config.reap_interval_s)
        self.health = HealthReporter(redis, self.keys, config.worker_id, self.status, config.heartbeat_s,
                                     before=self._before_beat)
        self.metrics = Metrics()
        self.runs.on_ended = self.metrics.ended
        self.runs.on_write = self.metrics.redis_write.observe
        self.metrics_url: str | None = None
        self.queue_depths: dict[str, int] = {}  # jobs waiting in each served queue, read every heartbeat
        self.tenant_depths: dict[tuple[str, str], int] = {}  # (model, tenant) -> jobs waiting, all workers'
        self.tenants_running: dict[str, int] = {}  # tenant -> jobs running fleet-wide
        self.weights: dict[str, float] = {}  # tenant -> weight (its jobs' in the engines), read every heartbeat
        self.dead_lettered = 0
        self._marking = False  # a _mark_full() is due at the end of this event-loop pass
        self.draining = False
        self.started_at = time.time()
        self._rates = {name: TokenRate() for name in self.services}
        self._tasks: list[asyncio.Task[None]] = []
        self.claiming = 0  # claims in flight: no model unloads meanwhile (its jobs may be on their way)
        self.backlog = False  # the last claim left due interactive jobs queued
        self.sink: Callable[[list[RequestOutput]], None] = lambda outs: None  # engines' outputs, set by start()
        self.ondemand = OnDemand(self, model_weights(config))  # raises ConfigError: a budget too small
        self.metrics.watch(self)  # last: the registry reads the counters above at once

    @classmethod
    async def start(cls, config: WorkerConfig) -> WorkerHost:
        """Connect to Redis, load each model on its own MLX thread, start the shared loops."""
        if not config.served:
            raise RuntimeError("no model to serve: set MLXQ_MODEL (or MLXQ_MODELS=path[=alias],...)")
        host = cls(config, redis_client(config.redis_url))
        await host.transitions.open()
        with contextlib.suppress(RedisError):  # INFO refused (ACL): nothing to say
            if risk := await eviction_risk(host.redis):
                log.warning("%s", risk)
        loop = asyncio.get_running_loop()

        def sink(outs: list[RequestOutput]) -> None:  # runs on an MLX thread
            loop.call_soon_threadsafe(host.runs.feed, outs)

        host.sink = sink
        # MLX's process-global limits, set once before any engine exists (engine/mlx/process.py)
        mlx_process(MLXLimits(*host.config.mlx_limits))
        for service in host.services.values():  # one at a time: each materializes its arrays on its own thread
            if not service.served.loadable:  # (loadable ones load when their jobs wait: worker/ondemand.py)
                await service.load(sink)
                host.started(service)
        if config.metrics_port:
            host.metrics_url = host.metrics.serve(config.metrics_port, config.metrics_addr)
            log.info("metrics on %s", host.metrics_url)
        watcher = CancelWatcher(redis=host.redis, keys=host.keys, held=host.runs.keys, on_cancel=host.runs.cancel,
                                poll_s=config.cancel_poll_s)
        wake_channels = [host.keys.wake_channel(name) for name in host.services]
        loops = (host.runs.publish(), watcher.run(), host.leases.run(), host.reaper.run(),
                 waker.listen(host.redis, wake_channels), host.health.run())
        host._tasks = [asyncio.create_task(c) for c in loops]
        # A full collection walks every object the collector tracks: with the models and their libraries
        # loaded it stalls the engines (and every stream) mid-decode. What is alive now lives as long as the
        # worker: take it out of the collector's sight, as vLLM does.
        gc.collect()
        gc.freeze()
        served = ", ".join(f"{s.name} on {s.queue}" for s in host.services.values())
        log.info("worker %s serving %s (capacity %d each; %d start-up objects frozen out of GC)",
                 config.worker_id, served, config.capacity, gc.get_freeze_count())
        await host.health.beat()  # clients see it serving from here on
        return host

    def started(self, service: ModelService) -> None:
        """A model's engine just started (at start, or loaded on demand): hook it to the worker's parts."""
        service.on_dead = self._on_model_dead
        assert service.engine is not None
        service.engine.on_step = self.metrics.step_timer(service.name)
        loop = asyncio.get_running_loop()

        def claimable() -> None:  # on the MLX thread
            loop.call_soon_threadsafe(self._claimable)

        service.engine.on_claimable = claimable
        if service.engine.prefix_min_tokens is not None:  # advertised from the next heartbeat on
            self.affinity.model(service.name).seed(service.engine.prefix_tagged())  # what its disk holds

    def _claimable(self) -> None:
        """An engine can take more jobs than before its last step: if the last claim left interactive jobs queued,
        claim now (not at a job's end, nor at the poll's next period: a claim limited by the room an engine had
        before its last step left an interactive job waiting that long)."""
        if self.backlog:
            arqseam.wake()

    async def aclose(self) -> None:
        """Leave the registry, abort what still runs, stop the engines (joining their MLX threads), close Redis."""
        await self.ondemand.aclose()
        await self.health.remove()
        await self.affinity.remove()
        for run in list(self.runs.values()):
            self.services[run.model].abort(run.rid)
        await asyncio.gather(*(s.aclose() for s in self.services.values()))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._writer.aclose()
        await self.redis.aclose()
        self.metrics.close()
        log.info("stats: %s", self.stats_line())

    def drain(self) -> None:
        """A stop signal came: say so in the health record now (no new jobs are taken from here on)."""
        self.draining = True
        asyncio.get_running_loop().create_task(self.health.beat())
        asyncio.get_running_loop().create_task(self.affinity.remove())  # jobs need not wait for a leaving worker

    def status(self) -> WorkerStatus:
        """This worker's health record."""
        tokens = self.runs.stats.tokens_by_model
        models = [s.status(self._rates[name].rate(tokens.get(name, 0))).model_copy(update=self._affinity_fields(name))
                  for name, s in self.services.items()]
        return WorkerStatus(id=self.config.worker_id, host=socket.gethostname(), pid=os.getpid(), version=_VERSION,
                            started_at=self.started_at, updated_at=time.time(), draining=self.draining, models=models,
                            metrics_url=self._public_metrics_url())

    def _public_metrics_url(self) -> str | None:
        if self.metrics_url is None:
            return None
        if self.config.metrics_addr in ("0.0.0.0", "::", ""):  # listening everywhere: name this host
            return f"http://{socket.gethostname()}:{self.config.metrics_port}/metrics"
        return self.metrics_url

    def _affinity_fields(self, model: str) -> dict[str, int]:
        placed, holdings = self.affinity.placements.get(model), self.affinity.holdings.get(model)
        if placed is None or holdings is None:
            return {}
        return {"affinity_holder": placed.holder, "affinity_elsewhere": placed.elsewhere,
                "affinity_none": placed.none, "affinity_keys": len(holdings)}

    def _mark_full(self) -> None:
        """Whether each model's engine takes no more jobs now (its room, or this worker's arq slots, are used up):
        CLAIM then gives its prefixes' jobs to other workers at once (worker/affinity.py; written on a change
        only)."""
        slots_full = sum(len(s.active) for s in self.services.values()) >= self.config.arq_max_jobs
        for name, service in self.services.items():
            self.affinity.set_full(name, slots_full or service.room() == 0)

    def _mark_full_soon(self) -> None:
        """:meth:`_mark_full` once, after this event-loop pass: the jobs one EMIT call ended all leave in one pass
        (and the poll claims in the next), and each one's look at every engine's room would be the same but for
        the last's. The marks are written rate-limited anyway (worker/affinity.py)."""
        if not self._marking:
            self._marking = True
            asyncio.get_running_loop().call_soon(self._marked)

    def _marked(self) -> None:
        self._marking = False
        self._mark_full()

    async def _before_beat(self) -> None:
        """Each heartbeat: the queues' depths, and the affinity keys the prefix caches still hold (and whether
        each engine is full: its KV headroom changes between claims). Nothing here waits for an MLX thread: the
        caches are asked without waiting for their answers (worker/affinity.py)."""
        await self._read_queues()
        self._mark_full()
        checks = {name: s.engine.prefix_holds for name, s in self.services.items()
                  if s.engine is not None and s.engine.prefix_min_tokens is not None and s.state is not ModelState.DEAD}
        await self.affinity.refresh(checks)

    async def _read_queues(self) -> None:
        """The depth of each served model's queues, per tenant, and each tenant's running jobs (for the
        metrics), and those tenants' weights (their jobs' weights in the engines: engine/core/shares.py), once a
        heartbeat."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in self.services:
                pipe.smembers(self.keys.backlog(name))
            pipe.hgetall(self.keys.tenants_running())
            *backlogs, running = await pipe.execute()
        pairs = [(name, tenant) for name, members in zip(self.services, backlogs)
                 for tenant in sorted({DEFAULT_TENANT, *(m.decode() for m in members)})]
        named = sorted({tenant for _, tenant in pairs} | {k.decode() for k in running})
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, tenant in pairs:
                pipe.zcard(self.keys.queue(name, tenant))
            for tenant in named:
                pipe.hget(self.keys.tenant(tenant), "weight")
            replies = await pipe.execute()
        depths, weights = replies[:len(pairs)], replies[len(pairs):]
        # In place: a job being prepared takes its tenant's weight as of when its request is built.
        self.weights.clear()
        self.weights.update({t: _weight(w) for t, w in zip(named, weights)})
        self.tenant_depths = {pair: int(n) for pair, n in zip(pairs, depths)}
        self.queue_depths = {name: sum(n for (m, _), n in self.tenant_depths.items() if m == name)
                             for name in self.services}
        self.tenants_running = {k.decode(): max(0, int(v)) for k, v in running.items()}

    def stats_line(self) -> str:
        """Every counter of the metrics registry as one ``key=value`` line."""
        return self.metrics.stats_line()

    # --- arq's seam: claims --------------------------------------------------------------------------
    async def claim(self, free: int) -> Claims:
        """Claim up to ``free`` due jobs across the served models' queues, each up to its engine's room."""
        self.claiming += 1  # until the jobs count against their models: none of those unloads meanwhile
        try:
            return await self._claim(free)
        finally:
            self.claiming -= 1
            self.ondemand.poke()  # jobs waiting for a model not loaded: load it (worker/ondemand.py); idle: unload

    async def _claim(self, free: int) -> Claims:
        due = await self.transitions.claim(*self._quotas(free))
        self.backlog = due.left_interactive
        await self._put_aside(due)
        started = [entry for entry in due.entries if entry.status is EntryStatus.STARTED]
        by_model = {entry.rid: self.services[entry.model] for entry in started}
        for entry in started:
            self.affinity.model(by_model[entry.rid].name)
            self.affinity.placements[by_model[entry.rid].name].add(entry.affinity)
        for service in self.services.values():
            service.claimed([entry for entry in started if by_model[entry.rid] is service])
        if started:  # (a claim that started nothing changed no engine's room; the heartbeat looks at its KV)
            self._mark_full_soon()
        return Claims({entry.rid: self._run(by_model[entry.rid], entry) for entry in started}, due.left)

    def _quotas(self, free: int) -> tuple[dict[str, int], int, dict[str, Outranking], dict[str, BelowShare]]:
        """CLAIM's arguments: each queue up to its engine's room, and a full engine one job that outranks its
        running sequences (it starts at once, preempting one of them: priority is no use if it waits in Redis),
        or one job of a tenant below its share there (it starts at once in the place of a job of a tenant above
        it, engine/core/shares.py: between tenants the share decides, and a job waiting in Redis behind another
        tenant's flood would get no share). Each model's bulk queue takes what room its interactive queues leave
        (the same quota, counted once by CLAIM) less the slots its interactive jobs' recent peak keeps
        (worker/reserve.py), and nothing from a full engine."""
        quotas = {service.queue: min(free, service.room()) for service in self.services.values()}
        outranking: dict[str, Outranking] = {}
        below_share: dict[str, BelowShare] = {}
        for service in self.services.values():
            if quotas[service.queue] or free <= 0:
                continue
            need, below = service.outranking(), service.below_share()
            if need is not None:
                quotas[service.queue], outranking[service.queue] = min(free, need.count), need
            if below is not None:
                quotas[service.queue], below_share[service.queue] = max(1, quotas[service.queue]), below
        for service in self.services.values():
            room = service.queue not in outranking | below_share  # (a full engine: none)
            quotas[service.bulk_queue] = min(quotas[service.queue], service.bulk_room()) if room else 0
        return quotas, free, outranking, below_share

    async def _put_aside(self, due: Due) -> None:
        for entry in due.entries:
            if entry.status is EntryStatus.DEFERRED:
                log.info("job %s: another run still holds its lease; left queued", entry.rid)
        reasons = {EntryStatus.POISON: "the queue entry is not a job id",
                   EntryStatus.GONE: "no job record (it expired, or Redis lost it)"}
        for status, reason in reasons.items():
            for queue in {e.queue for e in due.entries if e.status is status}:
                await self.reject(queue, [e.entry for e in due.entries if e.status is status and e.queue == queue],
                                  reason)

    async def reject(self, queue: str, entries: Sequence[bytes], reason: str) -> None:
        """Move queue entries no worker can run to the dead-letter list (``<prefix>:dead``)."""
        try:
            self.dead_lettered += await self.transitions.reject(queue, entries, reason)
        except (RedisError, OSError) as exc:
            log.warning("could not move %d queue entries aside: %r", len(entries), exc)
            return
        for entry in entries:
            log.warning("queue %s: entry %r moved to %s: %s", queue, entry, self.keys.dead_letters(), reason)

    # --- one job ---------------------------------------------------------------------------------------
    async def _run(self, service: ModelService, entry: DueEntry) -> Outcome:
        """One claimed job, to its terminal event or handed back, within arq's job timeout (a backstop: the
        engine's deadline comes first)."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.config.arq_job_timeout_s):
                state = await self._serve(service, entry)
        except TimeoutError:
            log.warning("job %s: ran past the arq job timeout (%.0fs); handed back or failed",
                        entry.rid, self.config.arq_job_timeout_s)
            return Outcome.FAILED
        finally:
            service.release(entry)
            self._mark_full_soon()
        log.debug("job %s: %s in %.3fs", entry.rid, state.value, time.monotonic() - t0)
        return Outcome.COMPLETE if state is State.ENDED else Outcome.RETRIED

    async def _serve(self, service: ModelService, entry: DueEntry) -> State:
        envelope = read_job(entry.job, self.config.max_job_bytes)
        run = self.transitions.run(entry, service.name, envelope.enqueue_ms)
        run.keep_s = keep_of(envelope.payload)
        try:
            return await self._serve_run(service, run, entry, envelope)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the job still gets its one terminal event
            log.exception("job %s: failed", run.rid)
            return await self.runs.fail(run, ErrorCode.INTERNAL, f"the worker failed: {exc!r}")

    async def _serve_run(self, service: ModelService, run: Run, entry: DueEntry, envelope: Envelope) -> State:
        """The job's fate: ended or refused here, or prepared and generated."""
        last = entry.last
        if last is not None and is_terminal(last):  # ended, yet queued: only a partial loss of Redis' data
            return await self.runs.finish(run)
        unannounced = last is not None and last.type != "reset"  # its last run left no reset (a partial data loss)
        if unannounced and (state := await self.runs.restart(run)) is not State.RUNNING:
            return state
        if entry.cancelled:
            return await self.runs.end_cancelled(run)
        if run.attempt > self.config.max_tries:
            msg = f"the job was tried {run.attempt - 1} times; the limit is {self.config.max_tries}"
            return await self.runs.fail(run, ErrorCode.WORKER_LOST, msg)
        if service.state is ModelState.DEAD:
            msg = f"model {service.name}'s engine on this worker is dead: {service.error}"
            return await self.runs.fail(run, ErrorCode.ENGINE_ERROR, msg)
        if service.state is ModelState.LOAD_FAILED:
            msg = f"model {service.name} cannot be loaded: {service.load_error}"
            return await self.runs.fail(run, ErrorCode.MODEL_UNAVAILABLE, msg)
        try:
            prepared = await prepare(envelope, run.rid, service.view, self.weights)
        except BadRequest as exc:
            log.info("job %s rejected: %s", run.rid, exc)
            return await self.runs.reject(run, str(exc))
        return await self._generate(service, run, prepared, envelope.keys)

    async def _generate(self, service: ModelService, run: Run, prepared: Prepared,
                        affinity: tuple[str, ...] = ()) -> State:
        if not self.runs.admit(run, prepared.token_text, prepared.tools):
            return run.state
        held = self._holds(service, prepared, affinity)
        if held:  # the keys, deepest first, kept with its prefix's entries on disk: known after a restart
            request = prepared.request
            request.affinity = affinity[0]
            self.affinity.started(service.name, affinity[:1], request.prompt_tokens)
            if len(affinity) > 1:  # its system prompt's own (api/affinity.py): that checkpoint stays on disk
                request.system_key = affinity[-1]
                system = request.prompt_tokens[:request.cache_boundary or None]  # held while the system prompt is
                self.affinity.started(service.name, affinity[1:], system)
        service.add(prepared.request)
        try:
            return await run.finished
        except asyncio.CancelledError:  # shutdown or arq's timeout: hand the job back, or end it on its last try
            await asyncio.shield(self.runs.interrupt(run, self.config.max_tries))
            raise
        finally:
            if held:
                self.affinity.ended(service.name, affinity)

    @staticmethod
    def _holds(service: ModelService, prepared: Prepared, affinity: tuple[str, ...]) -> bool:
        """Whether the job's prompt goes into the model's prefix cache, so that its worker holds its key."""
        least = service.engine.prefix_min_tokens if service.engine is not None else None
        request = prepared.request
        return bool(affinity) and least is not None and request.images is None and \
            len(request.prompt_tokens) >= least

    def _on_model_dead(self, service: ModelService) -> None:
        asyncio.get_running_loop().create_task(self.health.beat())  # say so now: producers stop counting on it
        if all(s.state is ModelState.DEAD for s in self.services.values()):
            # Every in-flight job already got error(engine_error); exit so the supervisor starts a fresh process.
            log.critical("every engine is dead; exiting with %d", ENGINE_DEAD_EXIT)
            asyncio.get_running_loop().call_later(0.5, os._exit, ENGINE_DEAD_EXIT)


def keep_of(payload: object) -> int | None:
    """A job's ``keep_result_s`` as its record holds it (read before the request is validated: a job refused
    as malformed keeps its result as long as it asked); None: not given, or not a number of seconds."""
    keep = payload.get("keep_result_s") if isinstance(payload, dict) else None
    if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0:
        return min(keep, MAX_KEEP_RESULT_S)
    return None
