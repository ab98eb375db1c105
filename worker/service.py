"""One model served from Redis: arq jobs go into the engine, events come out, cancels are honoured.

Each arq job is a thin coroutine (:meth:`ModelService.run_job`): validate, hand the request to the
engine, await its terminal event. The coroutine never touches MLX, so cancelling it (arq timeout,
shutdown) only posts an abort that the engine applies between steps on its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis

from api.connection import redis_client
from api.keys import seq_of_entry_id
from api.schema import DoneEvent, ErrorCode, Event, FinishReason, GenerateRequest, ResetEvent, Usage, decode_event
from engine.engine import Engine
from engine.loader import EngineOptions, LoadedModel, start_engine
from engine.prompt import encode_prompt
from engine.request import RequestOutput

from .cancels import CancelWatcher
from .config import WorkerConfig
from .job import Job
from .publisher import Publisher
from .translate import error_event, timings, to_engine_request

__all__ = ["BadRequest", "ModelService"]

log = logging.getLogger(__name__)


class BadRequest(Exception):
    """The job can never succeed as sent; becomes an ``error(bad_request)`` event."""


class ModelService:
    """Joins one model's engine to Redis for an arq worker."""

    def __init__(self, config: WorkerConfig, redis: Redis) -> None:
        self.config = config
        self.keys = config.keys
        self.redis = redis
        self.jobs: dict[str, Job] = {}
        self.publisher = Publisher(redis, self.keys, config.worker_id, self.jobs)
        self.engine: Engine | None = None
        self.model: LoadedModel | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, config: WorkerConfig) -> ModelService:
        """Connect to Redis, load the model on its MLX thread, start publishing and watching cancels."""
        if not config.model:
            raise RuntimeError("MLXQ_MODEL is not set: give a local model path (or a hub id on a Mac)")
        service = cls(config, redis_client(config.redis_url))
        loop = asyncio.get_running_loop()

        def sink(outs: list[RequestOutput]) -> None:  # runs on the MLX thread
            loop.call_soon_threadsafe(service.publisher.feed, outs)

        opts = EngineOptions(config.capacity, config.prefill_batch_size, config.prefill_step_size)
        service.engine, service.model = await start_engine(config.model, sink, opts)
        watcher = CancelWatcher(redis=service.redis, keys=service.keys, held=service.jobs.keys,
                                on_cancel=service.engine.abort, poll_s=config.cancel_poll_s)
        service._tasks = [asyncio.create_task(service.publisher.run()), asyncio.create_task(watcher.run())]
        log.info("worker %s serving %s on queue %s (capacity %d)",
                 config.worker_id, config.name, config.queue_name, config.capacity)
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
        await self.redis.aclose()
        log.info("stats: %s", self.stats_line())

    def stats_line(self) -> str:
        """Counters as one ``key=value`` line (benchmarks parse it from the log)."""
        steps = self.engine.stats.steps if self.engine is not None else 0
        p = self.publisher.stats
        return f"engine_steps={steps} redis_writes={p.writes} events={p.events} dropped={p.dropped}"

    # --- one job -----------------------------------------------------------------------------------
    async def run_job(self, payload: Any, job_id: str, job_try: int = 1, enqueue_time: float | None = None) -> str:
        """Run one arq job to its terminal event; returns the terminal event's type."""
        job = Job(job_id, self.config.name, enqueue_time or time.time(), attempt=job_try)
        last, cancelled = await self._history(job_id)
        if last is not None and last.type in ("done", "error"):
            return last.type  # an earlier run already finished it
        if last is not None:
            job.seq = last.seq + 1
            await self.publisher.write([(job, ResetEvent(id=job_id, seq=job.next_seq(),
                                                         reason="job restarted", attempt=job_try))])
        if cancelled:
            return await self._end(job, self._cancelled_event(job))
        try:
            req = self._validate(payload, job_id)
            tokens = self._tokenize(req)
        except BadRequest as exc:
            log.info("job %s rejected: %s", job_id, exc)
            return await self._end(job, error_event(job, ErrorCode.BAD_REQUEST, str(exc)))
        return await self._run(job, req, tokens)

    async def _run(self, job: Job, req: GenerateRequest, tokens: list[int]) -> str:
        assert self.engine is not None
        self.jobs[job.rid] = job
        deadline = time.monotonic() + self.config.job_timeout_s
        self.engine.add(to_engine_request(req, tokens, deadline))
        try:
            return await job.finished
        except asyncio.CancelledError:
            # Shutdown or an arq timeout: detach (no terminal event) so a re-run can resume with `reset`,
            # unless no try remains, in which case the job must end here.
            self.engine.abort(job.rid)
            if job.attempt >= self.config.max_tries:
                await asyncio.shield(self._fail_lost(job))
            else:
                self.jobs.pop(job.rid, None)
            raise

    async def _fail_lost(self, job: Job) -> None:
        msg = f"the job was interrupted on its last try ({job.attempt}/{self.config.max_tries})"
        await self.publisher.write([(job, error_event(job, ErrorCode.WORKER_LOST, msg))])

    async def _end(self, job: Job, event: Event) -> str:
        await self.publisher.write([(job, event)])
        return event.type

    def _cancelled_event(self, job: Job) -> DoneEvent:
        return DoneEvent(id=job.rid, seq=job.next_seq(), finish_reason=FinishReason.CANCELLED,
                         usage=Usage(prompt_tokens=0, completion_tokens=0), timings=timings(job))

    async def _history(self, rid: str) -> tuple[Event | None, bool]:
        """The job's last published event (set if this is a re-run) and whether a cancel is pending."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrevrange(self.keys.log(rid), count=1)
        pipe.exists(self.keys.cancel(rid))
        entries, cancelled = await pipe.execute()
        last = decode_event(entries[0][1][b"e"]) if entries else None
        if last is not None and last.seq != seq_of_entry_id(entries[0][0]):
            log.warning("job %s: log entry id and seq disagree", rid)
        return last, bool(cancelled)

    # --- validation --------------------------------------------------------------------------------
    def _validate(self, payload: Any, job_id: str) -> GenerateRequest:
        try:
            req = GenerateRequest.model_validate(payload)
        except ValidationError as exc:
            raise BadRequest(_summarize(exc)) from None
        cfg = self.config
        if req.id != job_id:
            raise BadRequest(f"request id {req.id!r} does not match job id {job_id!r}")
        if req.model not in (cfg.model, cfg.model_name):
            raise BadRequest(f"unknown model {req.model!r}: this queue serves {cfg.name!r}")
        if req.max_tokens > cfg.max_tokens_limit:
            raise BadRequest(f"max_tokens {req.max_tokens} exceeds this worker's limit {cfg.max_tokens_limit}")
        return req

    def _tokenize(self, req: GenerateRequest) -> list[int]:
        assert self.model is not None
        messages = [m.model_dump() for m in req.messages] if req.messages is not None else None
        try:
            tokens = encode_prompt(self.model.tokenizer, req.prompt, messages)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            raise BadRequest(f"could not tokenize the prompt: {exc}") from None
        limit = min(self.config.max_prompt_tokens, self.model.context_length or self.config.max_prompt_tokens)
        if not tokens:
            raise BadRequest("the prompt is empty after tokenization")
        if len(tokens) > limit:
            raise BadRequest(f"prompt has {len(tokens)} tokens; the limit is {limit}")
        ctx = self.model.context_length
        if ctx is not None and len(tokens) + req.max_tokens > ctx:
            raise BadRequest(
                f"prompt ({len(tokens)} tokens) + max_tokens ({req.max_tokens}) exceeds the context ({ctx})"
            )
        return tokens


def _summarize(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{where}: {err['msg']}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return "invalid request: " + "; ".join(parts) + more
