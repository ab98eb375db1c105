"""One model served from Redis: arq jobs go into the engine, events come out, cancels are honoured.

Each arq job is a thin coroutine (:meth:`ModelService.run`, run by ``runner.py``): read the job and take
its lease in one call, validate, hand the request to the engine, await its terminal event. The coroutine
never touches MLX, so cancelling it (arq timeout, shutdown) only posts an abort that the engine applies
between steps on its own thread.

A job ends with exactly one terminal event, or is handed back to the queue with a ``reset`` event:
on shutdown (while tries remain), when its lease is lost (fenced), or by the reaper after a worker died.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from pydantic import ValidationError
from redis.asyncio import Redis

from api.connection import UNDECODABLE, redis_client
from api.schema import DoneEvent, ErrorCode, Event, FinishReason, GenerateRequest, ResetEvent, Usage, decode_event
from engine.engine import Engine
from engine.loader import EngineOptions, LoadedModel, start_engine
from engine.prompt import encode_prompt
from engine.request import RequestOutput

from . import waker
from .cancels import CancelWatcher
from .config import WorkerConfig
from .job import Job
from .leases import LeaseKeeper
from .publisher import LogTTL, Publisher
from .reaper import Reaper, StaleClaims
from .scripts import START, Script
from .translate import error_event, timings, to_engine_request

__all__ = ["BadRequest", "ModelService", "Started"]

log = logging.getLogger(__name__)
ENGINE_DEAD_EXIT = 70  # EX_SOFTWARE: the supervisor restarts the worker
_INLINE_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop


class BadRequest(Exception):
    """The job can never succeed as sent; becomes an ``error(bad_request)`` event."""


class LeaseLost(Exception):
    """This worker can no longer vouch for the job; another run will take it over."""


@dataclass(frozen=True, slots=True)
class Started:
    """A job the START script claimed: its arq job, this try's number, the lease, the job's history."""

    rid: str
    job: bytes | None  # None: the job key expired or was deleted
    attempt: int
    acquired: bool  # False: another run holds the lease; the job went back to the queue
    last: Event | None
    cancelled: bool


class ModelService:
    """Joins one model's engine to Redis for an arq worker."""

    def __init__(self, config: WorkerConfig, redis: Redis) -> None:
        self.config = config
        self.keys = config.keys
        self.redis = redis
        self.jobs: dict[str, Job] = {}
        ttl = LogTTL(live=config.live_ttl_s, done=config.done_ttl_s, result=config.keep_result_s)
        # The publisher's writes are serial: a connection of its own skips the pool's per-command checkout,
        # a health-check read that was a quarter of each EMIT call's CPU on the event loop.
        self._events_redis = Redis(connection_pool=redis.connection_pool, single_connection_client=True)
        self.publisher = Publisher(self._events_redis, self.keys, config.worker_id, self.jobs, ttl,
                                   give_up_s=config.lease_ttl_s, queue=config.queue_name)
        self.publisher.on_fenced = self._on_lease_lost
        self.leases = LeaseKeeper(redis, self.keys, self.jobs, config.lease_ttl_s, self._on_lease_lost)
        claims = StaleClaims(config.queue_name, int((config.arq_job_timeout_s + 10) * 1000),
                             int(config.lease_ttl_s * 1000))  # arq claims for its job timeout + 10 s
        self.reaper = Reaper(redis, self.keys, config.max_tries, config.reap_interval_s, ttl, claims)
        self._start_script = Script.of(START)
        self.engine: Engine | None = None
        self.model: LoadedModel | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, config: WorkerConfig) -> ModelService:
        """Connect to Redis, load the model on its MLX thread, start the background loops."""
        if not config.model:
            raise RuntimeError("MLXQ_MODEL is not set: give a local model path (or a hub id on a Mac)")
        service = cls(config, redis_client(config.redis_url))
        loop = asyncio.get_running_loop()

        def sink(outs: list[RequestOutput]) -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(service.publisher.feed, outs)

        opts = EngineOptions(config.capacity, config.prefill_batch_size, config.prefill_step_size,
                             stream_interval_s=config.stream_interval_ms / 1000)
        service.engine, service.model = await start_engine(config.model, sink, opts)

        def on_dead() -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(service._on_engine_dead)

        service.engine.on_dead = on_dead
        await asyncio.gather(service.publisher.start(), service.leases.start(), service.reaper.start())
        watcher = CancelWatcher(redis=service.redis, keys=service.keys, held=service.jobs.keys,
                                on_cancel=service._cancel, poll_s=config.cancel_poll_s)
        loops = (service.publisher.run(), watcher.run(), service.leases.run(), service.reaper.run(),
                 waker.listen(service.redis, service.keys.wake_channel(config.name)))
        service._tasks = [asyncio.create_task(c) for c in loops]
        # A full collection walks every object the collector tracks: with the model and its libraries loaded
        # that stalled the engine (and every stream) for 76 ms mid-decode here, about once in 15 bursts. What
        # is alive now lives as long as the worker: take it out of the collector's sight, as vLLM does.
        gc.collect()
        gc.freeze()
        log.info("worker %s serving %s on queue %s (capacity %d; %d start-up objects frozen out of GC)",
                 config.worker_id, config.name, config.queue_name, config.capacity, gc.get_freeze_count())
        return service

    async def aclose(self) -> None:
        """Abort what still runs, stop the engine (joining its MLX thread), close Redis."""
        if self.engine is not None:
            for rid in list(self.jobs):
                self.engine.abort(rid)
            await self.engine.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._events_redis.aclose()
        await self.redis.aclose()
        log.info("stats: %s", self.stats_line())

    def stats_line(self) -> str:
        """Counters as one ``key=value`` line (benchmarks parse it from the log)."""
        steps = self.engine.stats.steps if self.engine is not None else 0
        p = self.publisher.stats
        return (f"engine_steps={steps} redis_writes={p.writes} other_writes={p.other_writes} events={p.events} "
                f"fenced={p.fenced} reaped={self.reaper.reaped}")

    def on_claimed(self, n: int) -> None:
        """arq just claimed ``n`` jobs in one call: let an idle engine wait for all of them."""
        if self.engine is not None:
            self.engine.expect(n, self.config.admit_wait_ms / 1000)

    # --- one job -----------------------------------------------------------------------------------
    async def claim(self, job_ids: list[str], most: int, claim_ttl_ms: int) -> list[Started]:
        """Claim and start up to ``most`` of the queued ``job_ids`` in one call (the START script); a claim is
        arq's in-progress mark, kept ``claim_ttl_ms``."""
        cfg = self.config
        now_ms = int(time.time() * 1000)
        args: list[Any] = [now_ms, claim_ttl_ms, most, cfg.worker_id, int(cfg.lease_ttl_s * 1000),
                           now_ms + int(cfg.lease_ttl_s * 1000), self.keys.prefix, in_progress_key_prefix,
                           job_key_prefix, retry_key_prefix, *job_ids]
        rows = await self._start_script.run(self.redis, [cfg.queue_name, self.keys.running()], args)
        return [Started(rid.decode(), job or None, int(attempt), bool(taken), decode_event(last) if last else None,
                        bool(cancelled))
                for rid, _score, job, attempt, taken, last, cancelled in rows]

    async def run(self, start: Started, loads: Callable[[bytes], dict[str, Any]]) -> str:
        """Run one job this worker started to its terminal event (or hand it back); returns how it ended.

        ``loads`` is the worker's job deserializer. Never raises but for cancellation: a bug ends the job
        with ``error(internal)``.
        """
        envelope = loads(start.job) if start.job is not None else None
        job = Job(start.rid, self.config.name, (envelope or {}).get("et", time.time() * 1000) / 1000,
                  attempt=start.attempt, token=f"{self.config.worker_id}:{start.attempt}")
        try:
            return await self._serve(job, start, envelope)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("job %s: failed", job.rid)
            self.jobs.pop(job.rid, None)
            return await self._emit(job, error_event(job, ErrorCode.INTERNAL, f"the worker failed: {exc!r}"))

    async def _serve(self, job: Job, start: Started, envelope: dict[str, Any] | None) -> str:
        last = start.last
        if last is not None and last.type in ("done", "error"):
            await self._release(job)
            return last.type  # an earlier run finished it
        if last is not None:
            job.seq = last.seq + 1
            if last.type != "reset":
                await self._emit(job, ResetEvent(id=job.rid, seq=job.next_seq(), reason="job restarted",
                                                 attempt=job.attempt))
        if start.cancelled:
            return await self._emit(job, self._cancelled_event(job))
        if job.attempt > self.config.max_tries:
            msg = f"the job was tried {job.attempt - 1} times; the limit is {self.config.max_tries}"
            return await self._emit(job, error_event(job, ErrorCode.WORKER_LOST, msg))
        try:
            req = self._validate(_payload(envelope), job.rid)
            tokens = await self._tokenize_off_loop(req)
        except BadRequest as exc:
            log.info("job %s rejected: %s", job.rid, exc)
            return await self._emit(job, error_event(job, ErrorCode.BAD_REQUEST, str(exc)))
        return await self._run(job, req, tokens)

    async def _release(self, job: Job) -> None:
        """Drop the lease and finish the arq job of a job an earlier run already ended."""
        await self.publisher.finish(job)

    async def _run(self, job: Job, req: GenerateRequest, tokens: list[int]) -> str:
        assert self.engine is not None
        self.jobs[job.rid] = job
        deadline = time.monotonic() + self.config.job_timeout_s
        self.engine.add(to_engine_request(req, tokens, deadline))
        try:
            return await job.finished
        except LeaseLost:
            await self._requeue_fenced(job)
            return "fenced"
        except asyncio.CancelledError:
            await asyncio.shield(self._interrupted(job))
            raise

    async def _requeue_fenced(self, job: Job) -> None:
        """The lease was lost mid-run (the reaper normally re-queued the job already): make sure the job is
        queued, due after a lease TTL, and drop this run's claim, as arq does when a job asks to be retried."""
        due_ms = int((time.time() + self.config.lease_ttl_s) * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.config.queue_name, {job.rid: due_ms}, nx=True)
        pipe.delete(in_progress_key_prefix + job.rid)
        await pipe.execute()

    async def _interrupted(self, job: Job) -> None:
        """Shutdown or an arq timeout cancelled the job's coroutine: hand it back, or end it on its last try."""
        assert self.engine is not None
        self.engine.abort(job.rid)
        if job.rid not in self.jobs:
            return  # it ended (or was fenced) meanwhile
        if job.attempt >= self.config.max_tries:
            msg = f"the job was interrupted on its last try ({job.attempt}/{self.config.max_tries})"
            await self._emit(job, error_event(job, ErrorCode.WORKER_LOST, msg))
            return
        reset = ResetEvent(id=job.rid, seq=job.next_seq(), reason="worker shutting down; job re-queued",
                           attempt=job.attempt + 1)
        await self.publisher.write([(job, reset)], mode="release")  # also re-queues it, atomically
        log.info("job %s: interrupted; handed back to the queue", job.rid)

    def _cancel(self, rid: str) -> None:
        """A client cancelled: end the job now, without waiting for the step in flight, and drop its
        sequence from the batch between steps (the engine's own terminal output is then ignored)."""
        if rid not in self.jobs or self.engine is None:
            return
        self.engine.abort(rid)
        self.publisher.feed_cancel(rid)

    def _on_lease_lost(self, job: Job) -> None:
        if self.engine is not None:
            self.engine.abort(job.rid)
        self.jobs.pop(job.rid, None)
        if not job.finished.done():
            job.finished.set_exception(LeaseLost(job.rid))

    def _on_engine_dead(self) -> None:
        # Every in-flight job already got error(engine_error); exit so the supervisor starts a fresh process.
        log.critical("engine could not be rebuilt; exiting with %d", ENGINE_DEAD_EXIT)
        asyncio.get_running_loop().call_later(0.5, os._exit, ENGINE_DEAD_EXIT)

    async def _emit(self, job: Job, event: Event) -> str:
        await self.publisher.write([(job, event)])
        return event.type

    def _cancelled_event(self, job: Job) -> DoneEvent:
        return DoneEvent(id=job.rid, seq=job.next_seq(), finish_reason=FinishReason.CANCELLED,
                         usage=Usage(prompt_tokens=0, completion_tokens=0), timings=timings(job))

    # --- validation --------------------------------------------------------------------------------
    def _validate(self, payload: Any, job_id: str) -> GenerateRequest:
        if isinstance(payload, dict) and UNDECODABLE in payload:
            raise BadRequest(f"undecodable job: {payload[UNDECODABLE]}")
        try:
            req = GenerateRequest.model_validate(payload)
        except ValidationError as exc:
            raise BadRequest(_summarize(exc)) from None
        cfg = self.config
        if len(req.stop) > cfg.max_stop_strings or any(len(s) > cfg.max_stop_chars for s in req.stop):
            raise BadRequest(f"at most {cfg.max_stop_strings} stop strings of at most {cfg.max_stop_chars} chars")
        if req.id != job_id:
            raise BadRequest(f"request id {req.id!r} does not match job id {job_id!r}")
        if req.model not in (cfg.model, cfg.model_name):
            raise BadRequest(f"unknown model {req.model!r}: this queue serves {cfg.name!r}")
        if req.max_tokens > cfg.max_tokens_limit:
            raise BadRequest(f"max_tokens {req.max_tokens} exceeds this worker's limit {cfg.max_tokens_limit}")
        return req

    async def _tokenize_off_loop(self, req: GenerateRequest) -> list[int]:
        # A long prompt takes a while to tokenize: keep the event loop (events, leases) responsive.
        chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
        if chars > self.config.max_payload_bytes:
            raise BadRequest(f"the prompt has {chars} characters; the limit is {self.config.max_payload_bytes}")
        if chars < _INLINE_TOKENIZE_CHARS:
            return self._tokenize(req, inline=True)
        return await asyncio.to_thread(self._tokenize, req, False)

    def _tokenize(self, req: GenerateRequest, inline: bool) -> list[int]:
        """Inline: without releasing the GIL (see ``PromptEncoder``); else through transformers, which
        releases it while a long prompt encodes."""
        assert self.model is not None
        messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
        try:
            if inline:
                tokens = self.model.prompts.encode(req.prompt, messages)
            else:
                tokens = encode_prompt(self.model.tokenizer, req.prompt, messages)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            raise BadRequest(f"could not tokenize the prompt: {exc}") from None
        ctx = self.model.context_length
        limit = min(self.config.max_prompt_tokens, ctx or self.config.max_prompt_tokens)
        if not tokens:
            raise BadRequest("the prompt is empty after tokenization")
        if len(tokens) > limit:
            raise BadRequest(f"prompt has {len(tokens)} tokens; the limit is {limit}")
        if ctx is not None and len(tokens) + req.max_tokens > ctx:
            raise BadRequest(
                f"prompt ({len(tokens)} tokens) + max_tokens ({req.max_tokens}) exceeds the context ({ctx})"
            )
        return tokens


def _payload(envelope: dict[str, Any] | None) -> Any:
    """The one argument of an arq job of ours (a malformed or vanished job becomes an undecodable payload)."""
    if envelope is None:
        return {UNDECODABLE: "the job is gone from Redis (expired or deleted) before it ran"}
    args, kwargs = envelope.get("a"), envelope.get("k")
    if isinstance(args, list) and len(args) == 1 and not kwargs:
        return args[0]
    return {UNDECODABLE: "the job must carry one payload"}


def _summarize(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(_clip(str(p), 64) for p in err["loc"]) or "payload"
        parts.append(f"{where}: {_clip(err['msg'], 300)}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "..."
