"""One model served from Redis: the host arq's seam hands due jobs to; each runs through the engine.

A job's run (:meth:`ModelService._run`) is a thin coroutine: validate, hand the request to the engine, await
its end. It never touches MLX, so cancelling it (arq's timeout, shutdown) only posts an abort that the engine
applies between steps on its own thread. How a job moves (started, ended, handed back, reaped, fenced) is
worker/lifecycle.py; this module decides when.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.arqseam import Claimed, Envelope, Outcome, read_job
from api.connection import redis_client
from api.schema import ErrorCode, FinishReason, GenerateRequest, is_terminal
from engine.engine import Engine
from engine.loader import EngineOptions, LoadedModel, start_engine
from engine.prompt import EncodedPrompt, encode_prompt_with_boundary
from engine.request import RequestOutput

from . import waker
from .cancels import CancelWatcher
from .config import WorkerConfig
from .leases import LeaseKeeper
from .lifecycle import Claim, Lifecycle, LogTTL, Record, Run, Start, State, Wire, Write
from .publisher import Publisher
from .reaper import Reaper
from .translate import to_engine_request

__all__ = ["BadRequest", "ModelService"]

log = logging.getLogger(__name__)
ENGINE_DEAD_EXIT = 70  # EX_SOFTWARE: the supervisor restarts the worker
_INLINE_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop
_DATA_LOST = "Redis lost this job's data while it ran (restarted without persistence, or flushed); submit it again"


class BadRequest(Exception):
    """The job can never succeed as sent; becomes an ``error(bad_request)`` event."""


class ModelService:
    """Joins one model's engine to Redis for an arq worker (``api.arqseam.Host``)."""

    def __init__(self, config: WorkerConfig, redis: Redis) -> None:
        self.config = config
        self.keys = config.keys
        self.redis = redis
        self.runs: dict[str, Run] = {}  # the runs in the engine
        ttl = LogTTL(live=config.live_ttl_s, done=config.done_ttl_s, result=config.keep_result_s)
        # Event writes are serial: a connection of their own skips the pool's per-command checkout (a
        # health-check read on the event loop, which shares the GIL with the engine).
        self._writer = Redis(connection_pool=redis.connection_pool, single_connection_client=True)
        self.lifecycle = Lifecycle(redis, self.keys, config.queue_name, config.worker_id, ttl, config.lease_ttl_s,
                                   writer=self._writer)
        self.publisher = Publisher(self.lifecycle, self.runs, config.worker_id, give_up_s=config.lease_ttl_s)
        self.publisher.on_fenced = self._lose
        self.leases = LeaseKeeper(self.lifecycle, self.runs, config.lease_ttl_s, self._lose)
        self.reaper = Reaper(self.lifecycle, config.max_tries, config.reap_interval_s)
        self.engine: Engine | None = None
        self.model: LoadedModel | None = None
        self.dead_lettered = 0
        self.data_lost = 0
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, config: WorkerConfig) -> ModelService:
        """Connect to Redis, load the model on its MLX thread, start the background loops."""
        if not config.model:
            raise RuntimeError("MLXQ_MODEL is not set: give a local model path (or a hub id on a Mac)")
        service = cls(config, redis_client(config.redis_url))
        await service.lifecycle.open()
        loop = asyncio.get_running_loop()

        def sink(outs: list[RequestOutput]) -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(service.publisher.feed, outs)

        opts = EngineOptions(config.capacity, config.prefill_batch_size, config.prefill_step_size,
                             stream_interval_s=config.stream_interval_ms / 1000)
        service.engine, service.model = await start_engine(config.model, sink, opts)

        def on_dead() -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(service._on_engine_dead)

        service.engine.on_dead = on_dead
        watcher = CancelWatcher(redis=service.redis, keys=service.keys, held=service.runs.keys,
                                on_cancel=service._cancel, poll_s=config.cancel_poll_s)
        loops = (service.publisher.run(), watcher.run(), service.leases.run(), service.reaper.run(),
                 waker.listen(service.redis, service.keys.wake_channel(config.name)))
        service._tasks = [asyncio.create_task(c) for c in loops]
        # A full collection walks every object the collector tracks: with the model and its libraries loaded
        # it stalls the engine (and every stream) mid-decode. What is alive now lives as long as the worker:
        # take it out of the collector's sight, as vLLM does.
        gc.collect()
        gc.freeze()
        log.info("worker %s serving %s on queue %s (capacity %d; %d start-up objects frozen out of GC)",
                 config.worker_id, config.name, config.queue_name, config.capacity, gc.get_freeze_count())
        return service

    async def aclose(self) -> None:
        """Abort what still runs, stop the engine (joining its MLX thread), close Redis."""
        if self.engine is not None:
            for rid in list(self.runs):
                self.engine.abort(rid)
            await self.engine.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._writer.aclose()
        await self.redis.aclose()
        log.info("stats: %s", self.stats_line())

    def stats_line(self) -> str:
        """Counters as one ``key=value`` line (benchmarks parse it from the log)."""
        steps = self.engine.stats.steps if self.engine is not None else 0
        p = self.publisher.stats
        return (f"engine_steps={steps} redis_writes={p.writes} other_writes={p.other_writes} events={p.events} "
                f"fenced={p.fenced} reaped={self.reaper.reaped} data_lost={self.data_lost} "
                f"dead_lettered={self.dead_lettered}")

    # --- arq's seam: claims --------------------------------------------------------------------------
    async def claim(self, ids: list[str], free: int) -> list[Claimed]:
        """Start up to ``free`` of the due ``ids`` in one call; each started job runs in a coroutine."""
        starts = await self.lifecycle.start(ids, free)
        gone = [s.rid for s in starts if s.claim is Claim.GONE]
        if gone:
            await self.reject([rid.encode() for rid in gone], "no job record (it expired, or Redis lost it)")
        for s in starts:
            if s.claim is Claim.DEFERRED:
                log.info("job %s: another run still holds its lease; left queued", s.rid)
        started = [s for s in starts if s.claim is Claim.STARTED]
        if started and self.engine is not None:  # let an idle engine wait for all of them
            self.engine.expect(len(started), self.config.admit_wait_ms / 1000)
        return [Claimed(s.rid, self._run(s)) for s in started]

    async def reject(self, entries: Sequence[bytes], reason: str) -> None:
        """Move queue entries no worker can run to the dead-letter list (``<prefix>:dead``)."""
        try:
            self.dead_lettered += await self.lifecycle.reject(entries, reason)
        except (RedisError, OSError) as exc:
            log.warning("could not move %d queue entries aside: %r", len(entries), exc)
            return
        for entry in entries:
            log.warning("queue %s: entry %r moved to %s: %s", self.config.queue_name, entry,
                        self.keys.dead_letters(), reason)

    # --- one job ---------------------------------------------------------------------------------------
    async def _run(self, start: Start) -> Outcome:
        """One started job, to its terminal event or handed back, within arq's job timeout (a backstop: the
        engine's deadline comes first)."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.config.arq_job_timeout_s):
                state = await self._serve(start)
        except TimeoutError:
            log.warning("job %s: ran past the arq job timeout (%.0fs); handed back or failed",
                        start.rid, self.config.arq_job_timeout_s)
            return Outcome.FAILED
        log.debug("job %s: %s in %.3fs", start.rid, state.value, time.monotonic() - t0)
        return Outcome.COMPLETE if state is State.ENDED else Outcome.RETRIED

    async def _serve(self, start: Start) -> State:
        envelope = read_job(start.job, self.config.max_payload_bytes)
        run = self.lifecycle.run(start, self.config.name, envelope.enqueue_ms)
        try:
            return await self._serve_run(run, start, envelope)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the job still gets its one terminal event
            log.exception("job %s: failed", run.rid)
            self.runs.pop(run.rid, None)
            return await self._end(run, run.error(ErrorCode.INTERNAL, f"the worker failed: {exc!r}"))

    async def _serve_run(self, run: Run, start: Start, envelope: Envelope) -> State:
        last = start.last
        if last is not None and is_terminal(last):  # ended, yet queued: only a partial loss of Redis' data
            (ok,) = await self.lifecycle.write([Record(run, [], Write.END)])
            return State.ENDED if ok else State.FENCED
        if last is not None and last.type != "reset":  # its last run left no reset (a partial loss of data)
            await self.publisher.write([(run, run.reset("job restarted"))])
        if start.cancelled:
            return await self._end(run, run.done(FinishReason.CANCELLED))
        if run.attempt > self.config.max_tries:
            msg = f"the job was tried {run.attempt - 1} times; the limit is {self.config.max_tries}"
            return await self._end(run, run.error(ErrorCode.WORKER_LOST, msg))
        try:
            if envelope.problem:
                raise BadRequest(envelope.problem)
            req = self._validate(envelope.payload, run.rid)
            prompt = await self._tokenize_off_loop(req)
        except BadRequest as exc:
            log.info("job %s rejected: %s", run.rid, exc)
            return await self._end(run, run.error(ErrorCode.BAD_REQUEST, str(exc)))
        return await self._generate(run, req, prompt)

    async def _end(self, run: Run, event: Wire) -> State:
        await self.publisher.write([(run, event)])
        return run.state

    async def _generate(self, run: Run, req: GenerateRequest, prompt: EncodedPrompt) -> State:
        assert self.engine is not None
        self.runs[run.rid] = run
        deadline = time.monotonic() + self.config.job_timeout_s
        self.engine.add(to_engine_request(req, prompt.tokens, deadline, cache_boundary=prompt.cache_boundary))
        try:
            return await run.finished
        except asyncio.CancelledError:
            await asyncio.shield(self._interrupted(run))
            raise

    async def _interrupted(self, run: Run) -> None:
        """Shutdown or arq's timeout cancelled the run: hand the job back, or end it on its last try."""
        assert self.engine is not None
        self.engine.abort(run.rid)
        if self.runs.pop(run.rid, None) is None:
            return  # it ended (or was fenced) meanwhile
        if run.attempt >= self.config.max_tries:
            msg = f"the job was interrupted on its last try ({run.attempt}/{self.config.max_tries})"
            await self.publisher.write([(run, run.error(ErrorCode.WORKER_LOST, msg))])
            return
        await self.publisher.write([(run, run.reset("worker shutting down; job re-queued"))], Write.HAND_BACK)
        log.info("job %s: interrupted; handed back to the queue", run.rid)

    def _cancel(self, rid: str) -> None:
        """A client cancelled: end the job now, without waiting for the step in flight, and drop its
        sequence from the batch between steps (the engine's own terminal output is then ignored)."""
        if rid not in self.runs or self.engine is None:
            return
        self.engine.abort(rid)
        self.publisher.feed_cancel(rid)

    async def _lose(self, runs: list[Run]) -> None:
        """Runs whose lease is gone: stop them. Each writes nothing more, unless Redis lost the job's data,
        when nobody else could end it: then it ends with ``error(data_lost)`` (the LOST write checks that)."""
        runs = [run for run in runs if run.state is State.RUNNING]  # the lease keeper and a write may both see it
        for run in runs:
            run.state = State.FENCED  # until the LOST write says otherwise
            self.runs.pop(run.rid, None)
            if self.engine is not None:
                self.engine.abort(run.rid)
        await self.publisher.write([(run, run.error(ErrorCode.DATA_LOST, _DATA_LOST)) for run in runs], Write.LOST)
        for run in runs:
            if run.state is State.ENDED:
                self.data_lost += 1
                log.warning("job %s: Redis lost its data while it ran; ended with error(data_lost)", run.rid)
            else:
                log.warning("job %s: fenced: its lease is gone (another run or the reaper owns the job); "
                            "this run writes nothing more", run.rid)

    def _on_engine_dead(self) -> None:
        # Every in-flight job already got error(engine_error); exit so the supervisor starts a fresh process.
        log.critical("engine could not be rebuilt; exiting with %d", ENGINE_DEAD_EXIT)
        asyncio.get_running_loop().call_later(0.5, os._exit, ENGINE_DEAD_EXIT)

    # --- validation --------------------------------------------------------------------------------
    def _validate(self, payload: Any, job_id: str) -> GenerateRequest:
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

    async def _tokenize_off_loop(self, req: GenerateRequest) -> EncodedPrompt:
        # A long prompt takes a while to tokenize: keep the event loop (events, leases) responsive.
        chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or [])
        if chars > self.config.max_payload_bytes:
            raise BadRequest(f"the prompt has {chars} characters; the limit is {self.config.max_payload_bytes}")
        if chars < _INLINE_TOKENIZE_CHARS:
            return self._tokenize(req, inline=True)
        return await asyncio.to_thread(self._tokenize, req, False)

    def _tokenize(self, req: GenerateRequest, inline: bool) -> EncodedPrompt:
        """Inline: without releasing the GIL (see ``PromptEncoder``); else through transformers, which
        releases it while a long prompt encodes. With the system-prompt boundary the engine caches at."""
        assert self.model is not None
        messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
        try:
            if inline:
                encoded = self.model.prompts.encode_with_boundary(req.prompt, messages)
            else:
                encoded = encode_prompt_with_boundary(self.model.tokenizer, req.prompt, messages)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            raise BadRequest(f"could not tokenize the prompt: {exc}") from None
        tokens = encoded.tokens
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
        return encoded


def _summarize(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(_clip(str(p), 64) for p in err["loc"]) or "payload"
        parts.append(f"{where}: {_clip(err['msg'], 300)}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "..."
