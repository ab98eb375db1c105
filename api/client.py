"""The producer client a web backend uses: submit jobs, follow their events, wait for results, cancel.

Following a job's events (exactly once, in seq order, across reconnects) is :mod:`api.follow`'s; an embedding
job's answer :mod:`api.embeddings`'; batches :mod:`api.batches`'. :class:`Client` is their one front.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .affinity import affinity_keys
from .batches import BatchStore, jsonl
from .config import ClientConfig
from .connection import RetryPolicy, client_redis, denied, is_denied, redact, with_retries
from .deltas import Delta
from .embeddings import Embeddings, embedding_inputs, embeddings_of
from .errors import (
    BadRequest,
    DuplicateJob,
    JobFailed,
    JobNotFound,
    NoWorker,
    QueueFull,
    QueueOutOfMemory,
    QueueUnavailable,
    describe,
)
from .files import FileStore
from .follow import Follower, JobView, Result, deltas_of, kept_events, result_of, text_of
from .protocol import producer
from .protocol.enqueuer import Command, Enqueuer
from .protocol.jobrecord import KeptResult, job_record
from .protocol.keys import Keys, queue_score
from .protocol.producer import Enqueue
from .registry import ModelInfo, QueueInfo, live_workers, models_of, other_prefixes, queues
from .schema import DoneEvent, ErrorEvent, Event, GenerateRequest, WorkerStatus, job_bytes_limit
from .settings import parse_redis_url
from .subscriber import Subscriber
from .tenants import DEFAULT_TENANT, Policy, TenantUse, check_name, remove, store
from .tenants import use as tenant_use

# Result, Embeddings, JobView and kept_events live in api.follow and api.embeddings; named here too, as before.
__all__ = ["Client", "Embeddings", "JobView", "Result", "kept_events"]

JOB_TTL_MS = 86_400_000  # a job record lives a day (arq's default): queued, running and re-run within it
_SERVED_FOR_S = 1.0  # a model seen served is taken as served this long without reading the records again


class Client:
    """Async client for one mlxq deployment. Use as ``async with Client(url) as client:``.

    ``redis``: a ``redis.asyncio.Redis`` of the caller's to use instead of one made from the URL (an app that
    has one already, or a test's fake); every operation (submits, their batched enqueues, cancels, reads) runs on
    it or its pool, and the client leaves it open when it closes: its owner closes it. ``tenant``: whose jobs its
    submits are, unless a request names its own (``GenerateRequest.tenant``; default ``default``).
    """

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 max_payload_bytes: int | None = None, retry_deadline: float | None = None,
                 max_images: int | None = None, max_image_bytes: int | None = None,
                 config: ClientConfig | None = None, redis: Redis | None = None, tenant: str | None = None) -> None:
        env = config or ClientConfig.from_env()
        # Every submit's tenant unless the request names one (a malformed name: BadRequest naming the field).
        self.tenant = check_name(tenant) if tenant is not None else None
        self.config = env
        url = parse_redis_url("redis_url", redis_url) if redis_url else env.redis_url
        self.keys = Keys(prefix or env.prefix)
        # As the workers' MLXQ_MAX_PAYLOAD_BYTES (the config's, unless given).
        self.max_payload_bytes = env.max_payload_bytes if max_payload_bytes is None else max_payload_bytes
        # An image job may be larger by the workers' image allowance (MLXQ_MAX_IMAGES x MLXQ_MAX_IMAGE_BYTES).
        self.max_image_job_bytes = job_bytes_limit(
            self.max_payload_bytes, env.max_images if max_images is None else max_images,
            env.max_image_bytes if max_image_bytes is None else max_image_bytes)
        # Every operation retries an unreachable Redis for this long (QueueUnavailable), and never a refusal
        # of its credentials or commands (AccessDenied).
        self.retry = RetryPolicy(deadline_s=env.retry_deadline_s if retry_deadline is None else retry_deadline)
        self.where = redact(url) if redis is None else _where(redis)
        self._owns_redis = redis is None
        self._redis = client_redis(url, self.retry) if redis is None else redis
        self._enqueuer = Enqueuer(self._redis)
        self._follower = Follower(self._redis, self.keys, self.retry, self.where)
        self._served: dict[str, float] = {}  # model -> when a live worker was last seen serving it
        self._checking: dict[str, asyncio.Task[None]] = {}  # model -> the read of the health records under way

    @property
    def redis(self) -> Redis:
        """The connection this client reads and writes through (the dashboard's reads share it)."""
        return self._redis

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the shared subscription and the connection pool."""
        await self._follower.aclose()
        await self._enqueuer.aclose()
        if self._owns_redis:
            await self._redis.aclose()

    # --- producing ---------------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest | dict[str, Any] | None = None, /, *,
                     require_worker: bool = False, writes: Sequence[Command] = (), **fields: Any) -> str:
        """Validate and enqueue a job on its model's queue; returns its id (the arq job id).

        Pass a :class:`GenerateRequest`, a dict of its fields, or the fields as keywords. Raises
        :class:`QueueFull` when the model's queue holds ``MLXQ_MAX_QUEUED`` jobs (or the tenant's its
        ``max_queued``), and with ``require_worker``
        :class:`NoWorker` when no live worker serves the model (else such a job waits for one, until it
        expires). A job still queued ``expires_in`` seconds after this (default ``MLXQ_JOB_EXPIRY``) ends with
        ``error(expired)``. ``bulk=True`` (the field): the bulk band, idle capacity only (a batch's lines; its
        queues' cap ``MLXQ_MAX_QUEUED`` counts the band's jobs apart from the model's interactive ones).
        ``writes``: Redis commands of the caller's, run in the same round trip just before the job is queued, in
        one transaction with it (a record that must exist once the job does; the gateway's stored responses).
        """
        req = _request(request, fields)
        if self.tenant is not None and "tenant" not in req.model_fields_set:
            req = req.model_copy(update={"tenant": self.tenant})
        if require_worker:
            await self._require_worker(req.model)
        now_ms = int(time.time() * 1000)
        # Fields left at their defaults stay out: a smaller record, and one a worker that predates a field reads.
        job = job_record(req.model_dump(mode="json", exclude_defaults=True), now_ms, affinity_keys(req))
        limit = self.max_image_job_bytes if req.image_parts else self.max_payload_bytes
        if len(job) > limit:  # within the limit workers apply before decoding a job
            raise BadRequest(f"the job has {len(job)} bytes of JSON; the limit is {limit}")
        cfg = self.config
        expiry_s = cfg.job_expiry_s if req.expires_in is None else req.expires_in
        expiry_ms = now_ms + int(expiry_s * 1000) if expiry_s > 0 else 0
        keys, args = Enqueue(req.id, job, req.model, req.tenant,
                             queue_score(now_ms, req.priority, int(cfg.priority_aging_s * 1000)),
                             max(0, cfg.max_queued), expiry_ms, JOB_TTL_MS, req.bulk).call(self.keys)
        # A retry sends the same record: ENQUEUE takes it as this submit's own (its reply was lost).
        try:
            queued = await with_retries(lambda: self._enqueuer.enqueue(keys, args, writes), self.retry,
                                      self.where)
        except ResponseError as exc:
            if "OOM command not allowed" in str(exc):  # a Redis at its maxmemory (noeviction) refuses writes
                raise QueueOutOfMemory(req.model, "OOM command not allowed when used memory > 'maxmemory'") from None
            raise
        if queued == 0:
            raise DuplicateJob(f"a job with id {req.id!r} already exists")
        if queued == -2:
            raise QueueFull(req.model, 0, tenant=req.tenant)
        if queued < 0:
            raise QueueFull(req.model, cfg.max_queued)
        return req.id

    async def _require_worker(self, model: str) -> None:
        seen = self._served.get(model)
        if seen is not None and time.monotonic() - seen < _SERVED_FOR_S:
            return
        # Submits that arrive together (a burst of requests) share one read of the health records.
        check = self._checking.get(model)
        if check is None:
            check = self._checking[model] = asyncio.ensure_future(self._check_served(model))
            check.add_done_callback(lambda done: self._checked(model, done))
        await asyncio.shield(check)

    async def _check_served(self, model: str) -> None:
        models = await self.models()
        if model not in models or not models[model].offered:  # a model a live worker loads on demand counts
            served = [name for name, m in models.items() if m.offered]
            elsewhere = None
            if not served:  # nothing under our prefix: perhaps the workers' MLXQ_PREFIX is another
                elsewhere = await self.other_prefixes()
            raise NoWorker(model, served, elsewhere)
        self._served[model] = time.monotonic()

    def _checked(self, model: str, check: asyncio.Task[None]) -> None:
        self._checking.pop(model, None)
        if not check.cancelled():
            check.exception()  # retrieved here too: every submit that awaited it may have gone

    async def cancel(self, rid: str) -> bool:
        """Ask for the job to stop: it ends with ``done(cancelled)`` wherever it is (queued, prefill, decode).

        Returns False if it had ended already (nothing to cancel); raises :class:`JobNotFound` for an id that is
        neither queued, running nor recently ended.
        """
        outcome = await with_retries(lambda: producer.cancel(self._redis, self.keys, rid), self.retry, self.where)
        if outcome == 0:
            raise JobNotFound(f"job {rid} is unknown, or ended more than a few minutes ago")
        return bool(outcome == 1)

    # --- batches (OpenAI's Batch API without the gateway: any gateway's feeder, or `mlxq batches feed`, runs
    # them) ------------------------------------------------------------------------------------------------
    def batch_store(self) -> BatchStore:
        """The deployment's batches (and, as ``.files``, its files), as this client's tenant sees them."""
        return BatchStore(self._redis, self.keys, FileStore(self._redis, self.keys))

    @property
    def _owner(self) -> str:
        return self.tenant or DEFAULT_TENANT

    async def create_batch(self, lines: Sequence[dict[str, Any] | bytes] | bytes | str | Path, *, endpoint: str,
                           metadata: dict[str, str] | None = None, completion_window: str = "24h",
                           output_expires_after: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload ``lines`` (request lines ``{custom_id, method, url, body}``, JSONL bytes, or a JSONL file's
        path) as a batch input file and start a batch of them; OpenAI's batch object (``validating``). A gateway's
        feeder (or ``mlxq batches feed``) runs it; :meth:`batch` follows it. ``output_expires_after``
        (``{"anchor": "created_at", "seconds": N}``, N from 3,600 to 2,592,000): when its output and error files
        expire, N seconds after each is written."""
        data = jsonl(lines)
        name = Path(lines).name if isinstance(lines, str | Path) else "batch.jsonl"
        store = self.batch_store()
        file = await with_retries(lambda: store.files.create(data, name, "batch", self._owner), self.retry,
                                  self.where)
        return await with_retries(lambda: store.create(file["id"], endpoint, self._owner, metadata=metadata,
                                                       completion_window=completion_window,
                                                       output_expires_after=output_expires_after),
                                  self.retry, self.where)

    async def batch(self, batch_id: str) -> dict[str, Any]:
        """A batch's OpenAI batch object now (:class:`NotFound` for an unknown one, or another tenant's)."""
        return await with_retries(lambda: self.batch_store().get(batch_id, self._owner), self.retry, self.where)

    async def batches(self, *, after: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """The tenant's batches, newest first (a page of ``limit`` after ``after``)."""
        page = await with_retries(lambda: self.batch_store().listing(self._owner, after=after, limit=limit),
                                  self.retry, self.where)
        return list(page["data"])

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """Cancel a batch: what finished is kept, the rest ends ``batch_cancelled`` (:class:`BadRequest` for an
        ended batch)."""
        return await with_retries(lambda: self.batch_store().cancel(batch_id, self._owner), self.retry, self.where)

    async def batch_results(self, batch_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """An ended batch's output and error lines (OpenAI's line formats), parsed; empty lists while it runs."""
        return await with_retries(lambda: self.batch_store().results(batch_id, self._owner), self.retry,
                                  self.where)

    # --- the deployment ------------------------------------------------------------------------------
    async def workers(self) -> list[WorkerStatus]:
        """The live workers, from their health records."""
        return await with_retries(lambda: live_workers(self._redis, self.keys), self.retry, self.where)

    async def models(self) -> dict[str, ModelInfo]:
        """The models live workers serve (or served until their engine died), by name."""
        return models_of(await self.workers())

    async def other_prefixes(self) -> dict[str, list[str]]:
        """Other prefixes of this Redis whose live workers serve models: prefix -> their models (a bounded look,
        for the hint when none serves under this client's prefix)."""
        return await with_retries(lambda: other_prefixes(self._redis, self.keys), self.retry, self.where)

    async def queues(self) -> list[QueueInfo]:
        """Every model queue that holds jobs: its depth and the age of its oldest waiting job."""
        return await with_retries(lambda: queues(self._redis, self.keys), self.retry, self.where)

    async def tenants(self, queues: list[QueueInfo] | None = None) -> list[TenantUse]:
        """Each tenant with a policy entry, jobs queued or running: its policy and live use (``mlxq tenants``).
        ``queues``: :meth:`queues`' answer, if read already."""
        if queues is None:
            queues = await self.queues()
        queued: dict[str, int] = {}
        for q in queues:
            for tenant, n in q.tenants.items():
                queued[tenant] = queued.get(tenant, 0) + n
        return await with_retries(lambda: tenant_use(self._redis, self.keys, queued), self.retry, self.where)

    async def set_tenant(self, name: str, **policy: Any) -> Policy:
        """Set fields of a tenant's policy (``weight``, ``max_running``, ``max_queued``, ``tokens_per_minute``;
        None keeps one); the policy now. Applies fleet-wide at once."""
        return await with_retries(lambda: store(self._redis, self.keys, name, **policy), self.retry, self.where)

    async def remove_tenant(self, name: str) -> bool:
        """Drop a tenant's policy entry (its queued jobs stay, under the default policy); whether it had one."""
        return await with_retries(lambda: remove(self._redis, self.keys, name), self.retry, self.where)

    async def ping(self, timeout: float = 1.0) -> None:
        """Raise :class:`QueueUnavailable` (or :class:`AccessDenied`) unless Redis answers within ``timeout``
        seconds: one try, no retries (a readiness check must answer at once)."""
        try:
            async with asyncio.timeout(timeout):
                await self._redis.ping()
        except Exception as exc:
            if is_denied(exc):
                raise denied(exc, self.where) from exc
            raise QueueUnavailable(f"Redis at {self.where} did not answer a ping: {exc!r}") from exc

    # --- consuming ---------------------------------------------------------------------------------
    async def events(self, rid: str, *, timeout: float | None = None) -> AsyncIterator[Event]:
        """Every event of job ``rid`` exactly once, in seq order, ending with its terminal event.

        ``timeout`` bounds the whole wait (:class:`WaitTimeout`). Reconnects on Redis connection errors.
        """
        async with aclosing(self._follower.events(rid, timeout, None)) as events:  # a reader that stops unsubscribes
            async for ev in events:
                yield ev

    async def submit_and_follow(self, request: GenerateRequest | dict[str, Any] | None = None, /, *,
                                timeout: float | None = None, require_worker: bool = False,
                                writes: Sequence[Command] = (), **fields: Any) -> AsyncIterator[Event]:
        """Submit a job and yield its events, as :meth:`events` does; every event's ``id`` is the job id.

        The channel is subscribed before the job is enqueued, so no event can precede the subscription and
        the replay-log read that :meth:`events` starts with is skipped: one round trip less per job.
        ``require_worker`` refuses a model no live worker serves, and ``writes`` go with the job, as :meth:`submit`
        does.
        """
        req = _request(request, fields)  # a bad request raises before anything is subscribed
        if require_worker:
            await self._require_worker(req.model)
        sub = await with_retries(lambda: self._hub().open(self.keys.events(req.id)), self.retry, self.where)
        try:
            await self.submit(req, writes=writes)
        except BaseException:
            await sub.close()
            raise
        async with aclosing(self._follower.events(req.id, timeout, sub)) as events:
            async for ev in events:
                yield ev

    def _hub(self) -> Subscriber:
        return self._follower.hub()

    async def stream_text(self, rid: str, *, timeout: float | None = None) -> AsyncIterator[str]:
        """Text deltas of job ``rid``; raises :class:`JobFailed` on an error event.

        After a ``reset`` (the job re-ran elsewhere) the text already yielded is skipped when the new run
        repeats it (greedy decoding does); if the new run diverges, :class:`JobFailed` is raised.
        """
        async for delta in text_of(rid, self.events(rid, timeout=timeout)):
            yield delta

    async def stream_deltas(self, rid: str, *, timeout: float | None = None) -> AsyncIterator[Delta]:
        """What job ``rid`` makes, as :class:`~api.deltas.Delta` s: its text, and apart from it its reasoning
        (``reasoning="split"``), log-probabilities (``logprobs``) and tool calls (``tools``), each piece once
        across re-runs as :meth:`stream_text` gives text; raises :class:`JobFailed` on an error event."""
        async for delta in deltas_of(rid, self.events(rid, timeout=timeout)):
            yield delta

    async def result(self, rid: str, *, timeout: float | None = None) -> Result:
        """Wait for job ``rid`` to end; its :class:`Result`, or :class:`JobFailed`. Read from its events while
        they are kept (minutes after its end), then from its kept result (its request's ``keep_result_s``, or
        ``MLXQ_KEEP_RESULT``: hours), which has no token ids or log-probabilities."""
        return await result_of(rid, self.events(rid, timeout=timeout))

    async def kept(self, rid: str) -> KeptResult | None:
        """Job ``rid``'s kept result, if it ended and its result is still kept (else None)."""
        return await self._follower.kept(rid)

    async def job(self, rid: str) -> JobView:
        """Where job ``rid`` stands now, without waiting (``mlxq job``): ended (its result, or its error),
        running or queued (its text so far), or unknown (never submitted, or nothing of it is kept any more)."""
        return await self._follower.job(rid)

    async def generate(self, *, timeout: float | None = None, **fields: Any) -> Result:
        """Submit and wait: ``await client.generate(model=..., prompt=..., max_tokens=...)``."""
        req = _request(None, fields)
        return await result_of(req.id, self.submit_and_follow(req, timeout=timeout))

    async def embed(self, *, model: str, input: str | list[str] | list[int] | list[list[int]],
                    dimensions: int | None = None, timeout: float | None = None, **fields: Any) -> Embeddings:
        """Submit an embedding job and wait for its vectors: ``await client.embed(model=..., input=["a", "b"])``.

        ``input``: a text, a list of texts, a list of token ids, or a list of such lists (each an input; ids are
        embedded as given, texts as the model's tokenizer makes them); ``dimensions``: each vector cut to that
        many values and normalised again. Other fields as :class:`GenerateRequest` takes them (``priority``,
        ``tenant``, ...). Raises :class:`JobFailed` when the worker refuses it (an input too long for the model,
        a model that does not embed)."""
        req = _request(None, {**fields, "model": model, "input": embedding_inputs(input), "dimensions": dimensions})
        async for ev in self.submit_and_follow(req, timeout=timeout):
            if isinstance(ev, ErrorEvent):
                raise JobFailed(ev)
            if isinstance(ev, DoneEvent):
                return embeddings_of(req.id, ev)
        raise AssertionError("unreachable: events() ends with a terminal event")

    async def stream(self, *, timeout: float | None = None, **fields: Any) -> AsyncIterator[str]:
        """Submit and yield text deltas; cancels the job if the consumer stops reading before its end."""
        req = _request(None, fields)
        finished = False
        try:
            async for delta in text_of(req.id, self.submit_and_follow(req, timeout=timeout)):
                yield delta
            finished = True
        except (BadRequest, DuplicateJob, NoWorker, QueueFull):
            finished = True  # nothing of ours was queued (or the id is another job's): nothing to cancel
            raise
        finally:
            if not finished:
                await asyncio.shield(self.cancel(req.id))


def _where(redis: Redis) -> str:
    """A given connection's server, as errors name it (no password)."""
    kw = redis.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def _request(request: Any, fields: dict[str, Any]) -> GenerateRequest:
    if isinstance(request, GenerateRequest) and not fields:
        return request
    if request is not None and fields:
        raise BadRequest("pass a request or keyword fields, not both")
    if request is not None and not isinstance(request, dict):
        raise BadRequest(f"a request is a GenerateRequest or a dict, not {type(request).__name__}")
    try:
        return GenerateRequest.model_validate(request if request is not None else fields)
    except ValidationError as exc:
        raise BadRequest(describe(exc)) from None
