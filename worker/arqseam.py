"""Everything mlxq knows about arq, in one place (arq 0.28, pinned; checked at import).

arq runs each worker process: its poll loop, ``max_jobs`` slots, health-check key, signals and SIGTERM drain.
Claiming, running and ending a job are mlxq's own (worker/jobs/). What crosses this seam:

- **Records**: a job is stored as arq's job record, an ended job's terminal event as arq's result record
  (``api/protocol/jobrecord.py``), so :func:`arq_job` gives an ``arq.jobs.Job`` whose ``status()`` and ``result()``
  work.
- **Claims**: ``Worker._poll_iteration`` asks ``Host.claim`` for up to the free slots instead of reading arq's
  queue; each claimed job runs in one of arq's slots.
- **Wake-ups**: :func:`wake` makes the poll look at the queue now.
- **Stop signals**: arq's handlers call :attr:`WorkerSpec.on_stop_signal`, its ``close``
  :attr:`WorkerSpec.on_closed`.

**Why a patch, not a subclass.** ``arq mlxq.worker.Settings`` is how a worker runs, and arq's CLI builds the
Worker itself: ``cli`` calls ``run_worker`` -> ``create_worker``, which is ``Worker(**get_kwargs(settings))``,
``get_kwargs`` keeping only the settings that name one of ``Worker.__init__``'s parameters; no setting names
another class, and the instance is reached by no hook before its ``main`` runs (``on_startup`` gets only ``ctx``;
the signal handlers are bound in ``__init__``). So :func:`_install` replaces ``Worker._poll_iteration``,
``main``, ``close``, the two signal handlers, and the ``poll`` that ``Worker.main`` reads from its module, on
arq's class, once. Each replacement serves only mlxq's workers, those whose ``ctx`` holds the
:class:`WorkerSpec` that :func:`worker_kwargs` puts there (:func:`_spec_of`), and hands any other Worker to
arq's own method unchanged: a plain arq worker in the same process keeps arq's behaviour (a test holds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import signal
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import arq.jobs
import arq.version
import arq.worker
from arq.connections import ArqRedis, RedisSettings
from redis.asyncio import Redis
from redis.exceptions import RedisError

from mlxq.api.connection import (
    CONNECT_TIMEOUT_S,
    RETRY_ON,
    RetryPolicy,
    SentinelUrl,
    client_redis,
    find_master,
    redact,
    redis_client,
    retry,
    sentinel_url,
    with_retries,
)
from mlxq.api.errors import AccessDenied, ConfigError, MlxqError, QueueUnavailable
from mlxq.api.protocol.jobrecord import JOB_FUNCTION, load_record
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import DEFAULT_TENANT

__all__ = [
    "Claims",
    "Host",
    "Outcome",
    "WorkerSpec",
    "arq_job",
    "wake",
    "worker_kwargs",
]

SUPPORTED = "0.28"
if not arq.version.VERSION.startswith(SUPPORTED + "."):
    raise ImportError(f"mlxq needs arq {SUPPORTED}.x (it plugs into arq's internals); arq {arq.version.VERSION} "
                      f"is installed: pip install 'arq=={SUPPORTED}.*'")

log = logging.getLogger(__name__)

_HOST = "mlxq_host"  # arq ctx keys
_SPEC = "mlxq_spec"
_BACKLOG = "mlxq_backlog"


class _Job(arq.jobs.Job):
    """arq's ``Job`` reading mlxq's records: the same methods, over the deployment's key names."""

    __slots__ = ("_keys",)

    def __init__(self, rid: str, redis: Redis, queue: str, keys: Keys) -> None:
        super().__init__(rid, redis, _queue_name=queue, _deserializer=load_record)
        self._keys = keys

    async def result(self, timeout: float | None = None, *, poll_delay: float = 0.5,
                     pole_delay: float | None = None) -> Any:
        start = time.monotonic()
        while True:
            info = await self.result_info()
            if info is not None:
                if info.success:
                    return info.result
                raise arq.jobs.SerializationError(info.result)
            if await self.status() is arq.jobs.JobStatus.not_found:
                raise arq.jobs.ResultNotFound("not waiting for the result: the job is neither queued, running nor "
                                              "ended with a kept result")
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError
            await asyncio.sleep(poll_delay)

    async def info(self) -> arq.jobs.JobDef | None:
        info: arq.jobs.JobDef | None = await self.result_info()
        if info is None:
            raw = await self._redis.get(self._keys.job(self.job_id))
            if raw:
                info = arq.jobs.deserialize_job(raw, deserializer=load_record)
        if info is not None:
            score = await self._redis.zscore(self._queue_name, self.job_id)
            info.score = None if score is None else int(score)
        return info

    async def result_info(self) -> arq.jobs.JobResult | None:
        raw = await self._redis.get(self._keys.result(self.job_id))
        return arq.jobs.deserialize_result(raw, deserializer=load_record) if raw else None

    async def status(self) -> arq.jobs.JobStatus:
        k = self._keys
        async with self._redis.pipeline(transaction=True) as tr:
            tr.exists(k.result(self.job_id))
            tr.hexists(k.running(), self.job_id)
            tr.zscore(self._queue_name, self.job_id)
            ended, running, score = await tr.execute()
        if ended:
            return arq.jobs.JobStatus.complete
        if running:
            return arq.jobs.JobStatus.in_progress
        if score is not None:
            due = score > time.time() * 1000
            return arq.jobs.JobStatus.deferred if due else arq.jobs.JobStatus.queued
        return arq.jobs.JobStatus.not_found


def arq_job(redis: Redis, keys: Keys, model: str, rid: str, tenant: str = DEFAULT_TENANT) -> arq.jobs.Job:
    """arq's handle on job ``rid`` of ``model``'s queue (``tenant``'s): ``status()``, ``info()``, ``result()``."""
    return _Job(rid, redis, keys.queue(model, tenant), keys)


# --- the worker side -----------------------------------------------------------------------------------
class Outcome(enum.Enum):
    """How a run ended, as arq counts jobs."""

    COMPLETE = "complete"  # ended with its terminal event (done or error)
    RETRIED = "retried"  # handed back to the queue, or taken over by another run
    FAILED = "failed"  # a bug or arq's job timeout


@dataclass(frozen=True, slots=True)
class Claims:
    """What one claim started (each job's id, and the coroutine that runs it to its end), and whether due jobs
    were left queued (a freed slot should poll again)."""

    started: dict[str, Coroutine[Any, Any, Outcome]]
    left: bool


class Host(Protocol):
    """What runs an mlxq worker's jobs inside arq's Worker."""

    async def claim(self, free: int) -> Claims:
        """Claim up to ``free`` due jobs of the host's queues in one call."""

    async def aclose(self) -> None:
        """Stop: called from arq's shutdown."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """An mlxq worker process, in the terms arq's Worker takes."""

    queue: str  # arq's own queue name (its health record counts it); the host claims from all of its queues
    redis_url: str
    start: Callable[[], Awaitable[Host]]  # at arq's start-up
    max_jobs: int
    poll_delay_s: float
    job_timeout_s: float  # arq's own job timeout: a backstop behind the engine's deadline
    drain_s: float  # on SIGTERM, running jobs may finish this long
    health_key: str
    on_stop_signal: Callable[[float], None] = lambda drain_s: None  # SIGTERM/SIGINT, given the drain
    on_closed: Callable[[], None] = lambda: None
    connect_deadline_s: float = 30.0  # at start, how long to wait for Redis to answer (MLXQ_CONNECT_DEADLINE)


def worker_kwargs(spec: WorkerSpec) -> dict[str, Any]:
    """Keyword arguments of ``arq.Worker`` (the attributes of an ``arq mlxq.worker.Settings`` class)."""
    _install()

    async def startup(ctx: dict[str, Any]) -> None:
        ctx[_HOST] = await spec.start()

    async def shutdown(ctx: dict[str, Any]) -> None:
        host: Host | None = ctx.get(_HOST)
        if host is not None:
            await host.aclose()

    async def generate(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # arq needs a function to register; the host runs mlxq's jobs without calling it.
        raise RuntimeError("mlxq jobs run through worker.arqseam, which this process did not install")

    settings = _redis_settings(spec.redis_url)
    settings.retry = retry()
    settings.retry_on_error = list(RETRY_ON)
    settings.conn_timeout = int(CONNECT_TIMEOUT_S)
    settings.conn_retries = 0  # Redis answered already (_await_redis): no "retries remaining" lines of arq's
    return {
        "functions": [arq.worker.func(generate, name=JOB_FUNCTION, timeout=spec.job_timeout_s, max_tries=1)],
        "queue_name": spec.queue,
        "redis_settings": settings,
        "on_startup": startup,
        "on_shutdown": shutdown,
        "max_jobs": spec.max_jobs,
        "poll_delay": spec.poll_delay_s,
        "job_timeout": spec.job_timeout_s,
        "health_check_key": spec.health_key,
        "health_check_interval": 10,
        "job_completion_wait": spec.drain_s,
        "ctx": {_SPEC: spec},
    }


def _redis_settings(url: str) -> RedisSettings:
    """arq's settings for ``url``; for a Sentinel set arq's own Sentinel mode, though the worker hands arq a
    pool of its own (:func:`_sentinel_pool`): arq's ignores the retries and the sentinels' password."""
    found = sentinel_url(url)
    if found is None:
        return RedisSettings.from_dsn(url)
    return RedisSettings(host=list(found.sentinels), sentinel=True, sentinel_master=found.master, ssl=found.ssl,
                         database=found.db, username=found.username, password=found.password)


def _sentinel_pool(worker: arq.worker.Worker, url: str) -> ArqRedis:
    """arq's client of a Sentinel set's master, as ``arq.connections.create_pool`` makes it, with the worker's
    retries: a failover is a short outage, ridden out like a Redis restart."""
    pool = redis_client(url, redis_class=ArqRedis)
    assert isinstance(pool, ArqRedis)
    pool.job_serializer, pool.job_deserializer = worker.job_serializer, worker.job_deserializer
    pool.default_queue_name, pool.expires_extra_ms = worker.queue_name, worker.expires_extra_ms
    return pool


def host_of(worker: arq.worker.Worker) -> Host | None:
    """The host running ``worker``'s jobs (once started)."""
    host: Host | None = worker.ctx.get(_HOST)
    return host


def _spec_of(worker: arq.worker.Worker) -> WorkerSpec | None:
    """What makes ``worker`` one of mlxq's (:func:`worker_kwargs` put it in its ``ctx``); None for any other
    arq Worker, which each patched method hands to arq's own."""
    spec = worker.ctx.get(_SPEC)
    return spec if isinstance(spec, WorkerSpec) else None


_arq_poll_iteration = arq.worker.Worker._poll_iteration


async def _poll_iteration(self: arq.worker.Worker) -> None:
    """``Worker._poll_iteration`` for an mlxq worker: claim up to the free slots from its host's queues."""
    host = host_of(self)
    if _spec_of(self) is None or host is None:  # not mlxq's, or (never, as arq runs on_startup first) no host yet
        return await _arq_poll_iteration(self)
    free = self.max_jobs - self.job_counter
    if self.allow_pick_jobs and free > 0:
        claims = await host.claim(free)
        # Jobs left queued, or every free slot taken (arq does not poll a full worker, so jobs enqueued meanwhile
        # wait for a slot): a job's end wakes the poll for them.
        self.ctx[_BACKLOG] = claims.left or len(claims.started) >= free
        for rid, run in claims.started.items():
            await self.sem.acquire()  # free slots were counted by the claim: never waits
            self.job_counter += 1
            task = self.loop.create_task(_run_in_slot(self, rid, run))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[rid] = task
    for rid, task in list(self.tasks.items()):
        if task.done():
            del self.tasks[rid]
            task.result()  # as arq: a task's exception stops the worker (ours never raise: see _run_in_slot)
    await self.heart_beat()


async def _run_in_slot(worker: arq.worker.Worker, rid: str, run: Coroutine[Any, Any, Outcome]) -> None:
    """One claimed job in a slot: arq's counters, and a wake-up for waiting jobs when it ends."""
    try:
        outcome = await run
    except asyncio.CancelledError:  # shutdown: the host handed the job back (or ended it on its last try)
        outcome = Outcome.RETRIED  # as arq's run_job: the task ends quietly, so the poll loop never re-raises it
    except Exception:  # a bug: never let it reach arq's poll loop, which re-raises a task's exception and stops
        log.exception("job %s: failed", rid)
        outcome = Outcome.FAILED
    if outcome is Outcome.COMPLETE:
        worker.jobs_complete += 1
    elif outcome is Outcome.RETRIED:
        worker.jobs_retried += 1
    else:
        worker.jobs_failed += 1
    # A slot is free: if the last poll left jobs queued, let arq take the next one now rather than at its
    # next poll. Two hops, so the wake lands after the task's done-callback has released its slot.
    if worker.ctx.get(_BACKLOG):
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, wake)


# --- wake-ups: arq polls on a period; producers' and freed slots' wake-ups make it look now -------------
# Enqueues from several producers arrive as a burst of wake-ups, and polling at the first one claims a job
# or two, then the rest in pieces. So once woken, the poll lets the event loop run a few passes, reading the
# wake-ups already on their way in, and polls once a round of passes brings none (at most _BURST_MAX_S): one
# claim takes what came together. It does not sleep for stragglers: the loop's timers count whole milliseconds,
# so any sleep adds a millisecond to every job's start; an idle engine waits for a burst claimed in pieces.
_wakes: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}
_BURST_PASSES = 3  # a wake-up in the socket takes two passes to reach wake(): the read, then the listener
_BURST_MAX_S = 0.005


def _wake_event() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    event = _wakes.get(loop)
    if event is None:
        for stale in [lp for lp in _wakes if lp.is_closed()]:
            del _wakes[stale]
        event = _wakes[loop] = asyncio.Event()
    return event


def wake() -> None:
    """Make every mlxq worker's poll loop on this event loop look at its queue now."""
    _wake_event().set()


_arq_poll = arq.worker.poll
_in_mlxq_main: contextvars.ContextVar[bool] = contextvars.ContextVar("mlxq_main", default=False)


def _poll(step: float = 0.5) -> AsyncGenerator[float, None]:
    """``arq.worker.poll`` as ``Worker.main`` reads it: the wakeable poll in an mlxq worker's main (its task's
    context says so: :func:`_wakeable_polls`), arq's own in any other Worker's."""
    return _wakeable_poll(step) if _in_mlxq_main.get() else _arq_poll(step)


@contextlib.contextmanager
def _wakeable_polls() -> Iterator[None]:
    """Within it, ``Worker.main`` running in this task (an mlxq worker's, :func:`_main`) polls with
    :func:`_wakeable_poll`; a context variable, so another Worker's main task, which never runs in this one's
    context, keeps arq's poll."""
    token = _in_mlxq_main.set(True)
    try:
        yield
    finally:
        _in_mlxq_main.reset(token)


async def _wakeable_poll(step: float = 0.5) -> AsyncGenerator[float, None]:
    """arq's ``poll`` helper, but its sleep ends early on :func:`wake`."""
    loop = asyncio.get_running_loop()
    event = _wake_event()
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
    """Return once ``_BURST_PASSES`` passes of the event loop bring no wake-up, or at ``until``."""
    loop = asyncio.get_running_loop()
    while True:
        event.clear()
        for _ in range(_BURST_PASSES):
            await asyncio.sleep(0)
        if not event.is_set() or loop.time() >= until:
            return


# --- stop signals --------------------------------------------------------------------------------------
_STOPS = (signal.SIGTERM, signal.SIGINT)  # arq's close() also calls the handler, with SIGUSR1: not a stop


def _signalled(handler: Callable[[arq.worker.Worker, Any], None]) -> Callable[[arq.worker.Worker, Any], None]:
    def handle(self: arq.worker.Worker, signum: Any) -> None:
        spec = _spec_of(self)
        if spec is not None and signum in _STOPS:
            spec.on_stop_signal(self._job_completion_wait)
        handler(self, signum)

    return handle


REDIS_UNAVAILABLE_EXIT = 69  # EX_UNAVAILABLE: Redis stayed unreachable past the retries
CONFIG_ERROR_EXIT = 78  # EX_CONFIG, as worker/settings.py's: a Sentinel set that cannot name a master
_arq_main = arq.worker.Worker.main


async def _main(self: arq.worker.Worker) -> None:
    """arq's main loop; for an mlxq worker, Redis staying unreachable (at start past ``connect_deadline_s``, or
    past the retries later) ends it with one line and exit status 69 for the supervisor, instead of a traceback
    (at DEBUG, with it)."""
    spec = _spec_of(self)
    if spec is None:
        return await _arq_main(self)
    debug = log.isEnabledFor(logging.DEBUG)
    if self._pool is None:
        try:
            await _await_redis(spec)
        except MlxqError as exc:  # unreachable past the deadline, refusing our credentials, or no such master
            log.error("worker cannot start: %s", exc, exc_info=debug)
            # 78 for a Sentinel set that names no master (a refused password stays 69, as it was)
            sentinels = isinstance(exc, ConfigError) and not isinstance(exc, AccessDenied)
            raise SystemExit(CONFIG_ERROR_EXIT if sentinels else REDIS_UNAVAILABLE_EXIT) from None
        if sentinel_url(spec.redis_url) is not None:
            self._pool = _sentinel_pool(self, spec.redis_url)
    try:
        with _wakeable_polls():
            await _arq_main(self)
    except (RedisError, OSError) as exc:
        log.error("worker stopping: Redis at %s unreachable: %s", redact(spec.redis_url), exc, exc_info=debug)
        raise SystemExit(REDIS_UNAVAILABLE_EXIT) from None


async def _await_redis(spec: WorkerSpec) -> None:
    """Ping Redis until it answers, within ``spec.connect_deadline_s`` from now: the client's retry policy (each
    try cut short at the deadline), so a worker started before Redis waits for it, and one whose Redis never
    answers says so once, at the deadline."""
    policy = RetryPolicy(deadline_s=spec.connect_deadline_s, cap_s=1.0, setting="MLXQ_CONNECT_DEADLINE")
    found = sentinel_url(spec.redis_url)
    if found is not None:
        await _await_sentinels(found, policy, redact(spec.redis_url))
    probe = client_redis(spec.redis_url, policy)
    try:
        await with_retries(probe.ping, policy, redact(spec.redis_url))
    finally:
        await probe.aclose()


async def _await_sentinels(found: SentinelUrl, policy: RetryPolicy, where: str) -> None:
    """Ask the sentinels for the master until one answers, within the policy's deadline: none answering by then,
    or all answering that they know no such master, is a configuration the worker cannot start with."""
    try:
        address = await with_retries(lambda: find_master(found, CONNECT_TIMEOUT_S), policy, where)
    except QueueUnavailable as exc:
        raise ConfigError(f"no sentinel of {where} answered within {policy.deadline_s:g}s "
                          f"({policy.setting}): {exc.__cause__ or exc}") from exc
    log.debug("sentinels at %s name master %r at %s:%d", where, found.master, *address)


_arq_close = arq.worker.Worker.close


async def _close(self: arq.worker.Worker) -> None:
    """arq's ``close``; then, for an mlxq worker, :attr:`WorkerSpec.on_closed`."""
    await _arq_close(self)
    spec = _spec_of(self)
    if spec is not None:
        spec.on_closed()


def _install() -> None:
    """Plug the claim, the wakeable poll and the stop hooks into arq's Worker class (idempotent): the module
    docstring says why a patch; each replacement hands a Worker that is not mlxq's to arq's own."""
    worker = arq.worker.Worker
    if getattr(worker, "_mlxq", False):
        return
    worker._poll_iteration = _poll_iteration  # type: ignore[method-assign]
    arq.worker.poll = _poll  # type: ignore[attr-defined]  # Worker.main reads it from the module
    for name in ("handle_sig", "handle_sig_wait_for_completion"):
        setattr(worker, name, _signalled(getattr(worker, name)))
    worker.close = _close  # type: ignore[method-assign]
    worker.main = _main  # type: ignore[method-assign]
    worker._mlxq = True  # type: ignore[attr-defined]
