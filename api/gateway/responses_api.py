"""OpenAI's Responses API over the queue: ``/v1/responses`` and the routes of a stored response.

- ``POST /v1/responses``: one job, made as the same chat request would make it (``response_input.py``); the
  response whole, streamed (OpenAI's events, ``response_events.py``), or, with ``background``, queued: the
  POST answers at once and any gateway retrieves it later. ``store`` (the default) keeps it (``api/responses.py``)
  for ``GET``, ``previous_response_id`` and ``input_items``.
- ``GET /v1/responses/{id}``: the response now, rebuilt from its job's log while it runs; ``?stream=true``
  replays its events from the start (or after ``starting_after``) and follows it to its end.
- ``POST /v1/responses/{id}/cancel`` (background responses), ``DELETE /v1/responses/{id}``,
  ``GET /v1/responses/{id}/input_items``.

A response belongs to its key's tenant: another tenant's key gets the 404 an unknown id gets. The first gateway
to see a stored response's job end records its end (:meth:`Responses.settled` is then called for a background
one: where webhooks plug in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..client import JOB_TTL_MS
from ..errors import BadRequest, DuplicateJob, JobNotFound, MlxqError, NoWorker, QueueFull, WaitTimeout
from ..protocol.enqueuer import Command
from ..protocol.notify import WebhookEntry, unwatch, watching
from ..responses import ResponseStore, StoredResponse, job_events, response_id_of
from ..schema import Event, GenerateRequest, new_request_id
from .errors import GatewayError, Kind, Problem, invalid, problem_of
from .openai_api import openai_error
from .response_events import JobSteps, ResponseEvents, Step, frame, lost_step, replay
from .response_input import ResponsesRequest, input_items, parse_request, to_ask
from .sse import EventStream, Last

if TYPE_CHECKING:
    from .app import Gateway

__all__ = ["Responses"]

log = logging.getLogger(__name__)

MAX_CHAIN = 256  # previous_response_id links followed for one request
_CANCEL_WAIT_S = 10.0  # how long a cancel waits for the job's end before answering with the response as it is
_GONE = 499  # the status logged for a client that went away before its answer (nginx's, as app's)
_CANCEL_ON_EXIT_S = 2.0  # a stream's cancel of its job on the way out gives up after this (Redis unreachable)


class Responses:
    """The Responses API routes of one gateway process, and the background responses it follows to their end."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._store: ResponseStore | None = None
        self._following: set[asyncio.Task[None]] = set()

    @property
    def store(self) -> ResponseStore:
        if self._store is None:  # the client opens with the app's lifespan
            self._store = ResponseStore(self.gw.client, self.gw.config.response_retention_s)
        return self._store

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{rid}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{rid}", self.delete, methods=["DELETE"]),
                Route("/v1/responses/{rid}/cancel", self.cancel, methods=["POST"]),
                Route("/v1/responses/{rid}/input_items", self.input_items, methods=["GET"])]

    async def aclose(self) -> None:
        """Stop following background responses (their jobs run on; any gateway's GET records their end)."""
        for task in self._following:
            task.cancel()
        await asyncio.gather(*self._following, return_exceptions=True)

    async def settled(self, response: StoredResponse) -> None:
        """A background response's end was recorded, once fleet-wide (by whichever gateway saw it first). Its
        webhook event is not sent from here: EMIT made it when the job ended (:func:`~api.protocol.notify.watch`),
        so no gateway has to be up, or to see the end, for it to be sent."""
        log.info("background response %s ended: %s", response.id, response.status)

    async def settle_entry(self, entry: WebhookEntry) -> None:
        """Before a ``response.*`` webhook event goes out: its response's end recorded (from its job's log or
        kept result), so the receiver's GET finds it settled, however long ago its job ended."""
        if not entry.type.startswith("response."):
            return
        record = await self.store.get(entry.id, entry.tenant)
        if record is not None and record.final is None:
            await self._refresh(record)

    # --- POST /v1/responses ---------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        submitted: StoredResponse | None = None
        try:
            tenant = self.gw.auth.check(request.headers)
            req = parse_request(await self.gw._body(request))
            context, root = await self._context(req.previous_response_id, tenant)
            job_id = new_request_id()
            rid = response_id_of(job_id)
            items = input_items(req, rid)
            root = root or rid
            ask = to_ask(req, context, items, self.gw.config, root if req.store or context else None)
            job = ask.request.model_copy(update={"id": job_id, "tenant": tenant})
            record = StoredResponse(rid, tenant, req.background, _created(rid, req, job), items, root,
                                    job.calls_tools)
            # Its record (and, notified, the request that its end become a webhook event, made by EMIT) are
            # written with its ENQUEUE, in one round trip: there once the job is, at no cost to its start.
            writes = self.store.creation(record) if req.store else []
            notify = req.background and req.store and self.gw.webhooks is not None
            if notify:
                writes.append(watching(self.gw.client.keys, job_id, "response", rid, tenant, JOB_TTL_MS // 1000))
            followed: AsyncGenerator[Event, None] | None = None
            if req.background:
                await self._submit(job, record, writes, notify)
            else:  # subscribed before it is queued, as chat completions: no replay read at its start
                followed = self._submitting(job, rid if req.store else None, writes)
            submitted = record
            log.debug("POST /v1/responses: %s (job %s, background %s, stream %s)", rid, job_id, req.background,
                      req.stream)
            return await self._answer(request, req, record, followed)
        except Exception as exc:
            if submitted is not None and not submitted.background:
                await self._cancel_job(submitted.job_id)
            return await self._failed(request, exc)

    async def _submit(self, job: GenerateRequest, record: StoredResponse, writes: list[Command],
                      notify: bool) -> None:
        """Queue a background response's job with its ``writes``; if it is refused, its record (and watch) go."""
        try:
            await self.gw.client.submit(job, require_worker=True, writes=writes)
        except BaseException:
            if writes:
                with contextlib.suppress(MlxqError):
                    await self.store.delete(record.id)
            if notify:
                with contextlib.suppress(Exception):
                    await unwatch(self.gw.client.redis, self.gw.client.keys, job.id)
            raise

    async def _submitting(self, job: GenerateRequest, stored: str | None, writes: list[Command]
                          ) -> AsyncGenerator[Event, None]:
        """The job queued with its ``writes`` at the first read (subscribed first), then its events; a submit
        refused (nothing was queued) removes the stored response ``stored`` (its id, if stored) before the
        refusal goes on."""
        events = self.gw.client.submit_and_follow(job, require_worker=True, writes=writes)
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            try:
                first = await anext(events)
            except (BadRequest, DuplicateJob, NoWorker, QueueFull):
                if stored is not None:
                    with contextlib.suppress(MlxqError):
                        await self.store.delete(stored)
                raise
            yield first
            async for ev in events:
                yield ev

    async def _answer(self, request: Request, req: ResponsesRequest, record: StoredResponse,
                      followed: AsyncGenerator[Event, None] | None = None) -> Response:
        headers = {"x-mlxq-job-id": record.job_id}
        if req.background:  # answered at once; its end recorded by any gateway's GET too
            if self.gw.webhooks is None:  # followed here to its end (with webhooks, their deliverer records it)
                self._follow(record)
            if req.stream:
                return EventStream(self._frames(record, None, stored=True, owns_job=False), self.gw.streams,
                                   headers=headers)
            return JSONResponse(replay(record.created, record.calls_tools, []).response, headers=headers)
        from .app import _Gone, _unless_gone  # the app imports this module: imported here, once it is loaded

        steps = self._steps(record.job_id, events=followed)
        try:
            if req.stream:  # it starts once the job did: a job refused before its start is an HTTP error
                first = await _unless_gone(request, anext(steps))
                try:
                    await self._refused(record, req.store, first)
                except BaseException:
                    await steps.aclose()
                    raise
                frames = self._frames(record, None, stored=req.store, owns_job=True, source=_chained(first, steps))
                return EventStream(frames, self.gw.streams, headers=headers)
            events = ResponseEvents(record.created, record.calls_tools)
            events.opening()
            done = await _unless_gone(request, _fed(steps, events))
        except _Gone:  # the client went away while it waited: its job is cancelled
            await steps.aclose()
            await self._cancel_job(record.job_id)
            return Response(status_code=_GONE)
        if req.store:
            await self._settle(record, events, done)
        if events.response["status"] == "failed":
            raise GatewayError(_job_problem(events.response["error"]))
        return JSONResponse(events.response, headers=headers)

    async def _refused(self, record: StoredResponse, stored: bool, first: Step) -> None:
        """Raise the HTTP error of a job that failed before it started (``first``, its first step, its end)."""
        if first[0] != "end" or "error" not in first[1]:
            return
        events = replay(record.created, record.calls_tools, [first])
        if stored:
            await self._settle(record, events, [first])
        raise GatewayError(_job_problem(first[1]["error"]))

    async def _context(self, previous: str | None, tenant: str) -> tuple[list[dict[str, Any]], str | None]:
        """The items the previous responses of the chain leave (their inputs and outputs, oldest first), and
        the chain's root: every turn of a chain shares its root's affinity key, so it lands where its prefix is."""
        if previous is None:
            return [], None
        chain: list[StoredResponse] = []
        rid: str | None = previous
        while rid is not None:
            if len(chain) == MAX_CHAIN:
                raise invalid(f"previous_response_id: the conversation is longer than {MAX_CHAIN} responses; "
                              "start a new one with its items as input", "invalid_request_error")
            record = await self.store.get(rid, tenant)
            if record is None:
                raise _not_found(rid, "previous_response_id")
            await self._refresh(record)
            if record.final is None:
                raise invalid(f"previous response {rid} is still {record.status}: it can be continued once it "
                              "ends", "invalid_request_error")
            chain.append(record)
            rid = record.created.get("previous_response_id")
        items: list[dict[str, Any]] = []
        for record in reversed(chain):
            assert record.final is not None
            items += record.input_items + record.final["output"]
        return items, chain[0].root

    # --- following a job ------------------------------------------------------------------------------
    async def _run(self, job_id: str, events: ResponseEvents, timeout: float | None = None) -> list[Step]:
        """Follow the job to its end, feeding ``events``; the steps it took (``WaitTimeout`` after ``timeout``)."""
        return await _fed(self._steps(job_id, timeout), events)

    async def _steps(self, job_id: str, timeout: float | None = None,
                     events: AsyncIterator[Event] | None = None) -> AsyncGenerator[Step, None]:
        """The job's steps from its start (its log replayed, then live; or ``events``) to its end."""
        steps = JobSteps(job_id)
        try:
            if events is None:
                events = self.gw.client.events(job_id, timeout=timeout)
            async with contextlib.aclosing(events) as each:  # type: ignore[type-var]
                async for ev in each:
                    for step in steps.feed(ev):
                        yield step
                    if steps.ended:
                        return
        except JobNotFound:
            yield lost_step()

    def _follow(self, record: StoredResponse) -> None:
        """Follow a background response to its end, here, so its end is recorded without anyone asking; a
        gateway that stops before then leaves it to the next GET (on any gateway)."""
        async def follow() -> None:
            events = ResponseEvents(record.created, record.calls_tools)
            events.opening()
            try:
                steps = await self._run(record.job_id, events)
                await self._settle(record, events, steps)
            except Exception as exc:  # Redis away past its retries: a later GET records the end
                log.warning("background response %s: not followed to its end here: %s", record.id, exc)

        task = asyncio.ensure_future(follow())
        self._following.add(task)
        task.add_done_callback(self._following.discard)

    async def _settle(self, record: StoredResponse, events: ResponseEvents, steps: list[Step]) -> None:
        """Record the end of a stored response; the first gateway to record it calls :meth:`settled`."""
        if not events.ended or record.final is not None:
            return
        try:
            first = await self.store.settle(record, events.response, steps)
        except MlxqError as exc:
            log.warning("response %s: its end was not recorded: %s", record.id, exc)
            return
        if first and record.background:
            await self.settled(record)

    async def _refresh(self, record: StoredResponse) -> ResponseEvents:
        """The response now: rebuilt from its job's events while it runs; its end recorded once it ended."""
        if record.final is not None:
            return replay(record.created, record.calls_tools, record.steps)
        logged = await job_events(self.gw.client, record.job_id)
        steps_of = JobSteps(record.job_id)
        steps = [lost_step()] if logged is None else [s for ev in logged for s in steps_of.feed(ev)]
        events = replay(record.created, record.calls_tools, steps)
        await self._settle(record, events, steps)
        return events

    async def _cancel_job(self, job_id: str) -> None:
        with contextlib.suppress(MlxqError, TimeoutError):
            async with asyncio.timeout(_CANCEL_ON_EXIT_S):
                await self.gw.client.cancel(job_id)

    # --- streams --------------------------------------------------------------------------------------
    async def _frames(self, record: StoredResponse, after: int | None, *, stored: bool, owns_job: bool,
                      source: AsyncGenerator[Step, None] | None = None) -> AsyncGenerator[bytes, None]:
        """The response's events from its start (those after ``after``), to its end. ``owns_job``: the stream
        is the job's only reader (not a background response): its end before the job's cancels the job.
        ``source``: its job's steps, when the caller read some already."""
        events = ResponseEvents(record.created, record.calls_tools)
        done: list[Step] = []
        if source is None:
            source = _stored(record.steps) if record.final is not None else self._steps(record.job_id)
        opening = _frames(events.opening(), after)
        try:
            if events.background and opening:  # its job may wait in the queue: the client hears of it now
                yield opening
                opening = b""
            # Otherwise its job has started (its start came with its first tokens, in one EMIT): the opening goes
            # out with the next step's events, in one write, as chat's first chunk goes with its first text.
            async for step in source:
                done.append(step)
                fast = events.text_frame(step) if after is None else None
                frames = opening + (fast if fast is not None else _frames(events.feed(step), after))
                if events.ended or frames:  # else every event is at or before starting_after: nothing to send
                    opening = b""
                    yield Last(frames) if events.ended else frames
            if opening:  # no step had events (none of them after starting_after)
                yield opening
            if stored:
                await self._settle(record, events, done)
        except Exception as exc:  # not the client leaving (CancelledError, GeneratorExit): that ends it silently
            problem = problem_of(exc)
            log.warning("response %s: its stream failed: %s", record.id, problem.message)
            events.seq += 1
            error = {"type": "error", "sequence_number": events.seq, "code": problem.code, "message": problem.message,
                     "param": None}
            yield Last(opening + _frames([error], None))
        finally:
            await source.aclose()  # it unsubscribes now
            if owns_job and not events.ended:
                await self._cancel_job(record.job_id)

    # --- GET, cancel, DELETE, input_items -------------------------------------------------------------
    async def _record(self, request: Request) -> StoredResponse:
        tenant = self.gw.auth.check(request.headers)
        rid = request.path_params["rid"]
        record = await self.store.get(rid, tenant)
        if record is None:
            raise _not_found(rid, "response_id")
        return record

    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``: its events)."""
        try:
            record = await self._record(request)
            if request.query_params.get("stream", "").lower() == "true":
                after = _int_param(request, "starting_after")
                frames = self._frames(record, after, stored=True, owns_job=False)
                return EventStream(frames, self.gw.streams, headers={"x-mlxq-job-id": record.job_id})
            return JSONResponse((await self._refresh(record)).response)
        except Exception as exc:
            return await self._failed(request, exc)

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: a background response's job cancelled; the response once it
        ended (or as it is, should its end not come within a few seconds)."""
        try:
            record = await self._record(request)
            if not record.background:
                raise GatewayError(Problem(Kind.INVALID, "Only responses created with background=true can be "
                                           "cancelled.", None))
            if record.final is None:
                with contextlib.suppress(JobNotFound):
                    await self.gw.client.cancel(record.job_id)
                with contextlib.suppress(WaitTimeout):
                    await self._run(record.job_id, ResponseEvents(record.created, record.calls_tools),
                                    _CANCEL_WAIT_S)
            return JSONResponse((await self._refresh(record)).response)
        except Exception as exc:
            return await self._failed(request, exc)

    async def delete(self, request: Request) -> Response:
        """``DELETE /v1/responses/{id}``: the record gone (and its job cancelled, if it still runs)."""
        try:
            record = await self._record(request)
            if record.final is None:
                await self._cancel_job(record.job_id)
            await self.store.delete(record.id)
            return JSONResponse({"id": record.id, "object": "response.deleted", "deleted": True})
        except Exception as exc:
            return await self._failed(request, exc)

    async def input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: a cursor page (``after``, ``limit`` 1-100, ``order``)."""
        try:
            record = await self._record(request)
            limit = _int_param(request, "limit") or 20
            order = request.query_params.get("order", "desc")
            if not 1 <= limit <= 100 or order not in ("asc", "desc"):
                raise invalid("limit is 1 to 100; order is asc or desc", "invalid_request_error")
            items = record.input_items if order == "asc" else record.input_items[::-1]
            after = request.query_params.get("after")
            if after is not None:
                ids = [item["id"] for item in items]
                if after not in ids:
                    raise GatewayError(Problem(Kind.INVALID, f"after: no input item {after!r}", None))
                items = items[ids.index(after) + 1:]
            page = items[:limit]
            return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                 "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
        except Exception as exc:
            return await self._failed(request, exc)

    async def _failed(self, request: Request, exc: Exception) -> Response:
        problem = await self.gw._problem(exc)
        param = getattr(exc, "param", None)
        unexpected = problem.code == "internal" and not isinstance(exc, MlxqError | GatewayError)  # a bug: its trace
        log.warning("%s %s -> %d %s: %s", request.method, request.url.path, problem.status, problem.code,
                    problem.message, exc_info=exc if unexpected else None)
        body = openai_error(problem)
        body["error"]["param"] = param
        return JSONResponse(body, problem.status, headers=problem.headers())


class _NotFound(GatewayError):
    def __init__(self, problem: Problem, param: str) -> None:
        super().__init__(problem)
        self.param = param


def _not_found(rid: str, param: str) -> GatewayError:
    return _NotFound(Problem(Kind.NOT_FOUND, f"Response with id '{rid}' not found.", None), param)


def _job_problem(error: dict[str, Any]) -> Problem:
    kind = Kind.INVALID if error.get("code") == "invalid_prompt" else Kind.UPSTREAM
    return Problem(kind, str(error.get("message")), error.get("code"))


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise invalid(f"{name} must be an integer", "invalid_request_error") from None


def _frames(events: list[dict[str, Any]], after: int | None) -> bytes:
    """SSE frames of ``events`` (those after ``after``), joined into one write."""
    return b"".join(frame(e) for e in events if after is None or e["sequence_number"] > after)


async def _stored(steps: list[Step]) -> AsyncGenerator[Step, None]:
    for step in steps:
        yield step


async def _chained(first: Step, rest: AsyncGenerator[Step, None]) -> AsyncGenerator[Step, None]:
    yield first
    async with contextlib.aclosing(rest):
        async for step in rest:
            yield step


async def _fed(steps: AsyncGenerator[Step, None], events: ResponseEvents) -> list[Step]:
    """Every step of ``steps``, each fed to ``events``."""
    done = []
    async with contextlib.aclosing(steps):
        async for step in steps:
            done.append(step)
            events.feed(step)
    return done


def _created(rid: str, req: ResponsesRequest, job: GenerateRequest) -> dict[str, Any]:
    """The response object as created: no output yet; queued (background) or in progress."""
    reasoning = req.reasoning
    return {
        "id": rid, "object": "response", "created_at": int(time.time()),
        "status": "queued" if req.background else "in_progress", "background": req.background,
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": req.model, "output": [],
        "parallel_tool_calls": job.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": reasoning.summary if reasoning else None},
        "store": req.store, "temperature": job.temperature, "top_p": job.top_p,
        "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
        "usage": None, "metadata": req.metadata or {}, "user": req.user,
        "prompt_cache_key": req.prompt_cache_key, "completed_at": None,
    }
