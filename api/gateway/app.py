"""The gateway's ASGI app (Starlette): OpenAI's and Anthropic's HTTP APIs in front of the queue.

- ``POST /v1/chat/completions``, ``/v1/completions`` (OpenAI) and ``/v1/messages`` (Anthropic);
- ``/v1/responses`` (OpenAI's Responses API, stored responses and background mode: ``responses_api.py``);
- ``POST /v1/embeddings`` (OpenAI's, for embedding models: ``embeddings_api.py``);
- ``/v1/files`` and ``/v1/batches`` (OpenAI's Files and Batch APIs; each gateway feeds batches: ``batches_api.py``);
- ``GET /v1/models`` (and ``/v1/models/{model}``): what live workers serve, with their worker counts, in
  Anthropic's format for a request with ``anthropic-version``;
- ``GET /health``: 200 while Redis answers, else 503 (no key needed).

A generation request is authenticated, parsed into one job, submitted and followed to its start; the response
is the whole text or an SSE stream. A client that goes away cancels its job, as does shutdown for every open
stream. Every failure is answered in the API's own error format.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..client import Client
from ..errors import MlxqError, NoWorker
from ..registry import ModelInfo
from .anthropic_api import MESSAGES
from .auth import Auth
from .batches_api import Batches
from .config import GatewayConfig
from .dashboard import Dashboard
from .dashboard import routes as dashboard_routes
from .dialect import Ask, Dialect
from .embeddings_api import EmbeddingsAPI
from .errors import GatewayError, Kind, Problem, problem_of
from .job import Choices
from .openai_api import CHAT, COMPLETIONS, openai_error
from .responses_api import Responses
from .sse import EventStream, Streams
from .webhooks import Deliverer, WebhookSettings

__all__ = ["Gateway", "create_app"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_GONE = 499  # the status logged for a client that went away before its answer (nginx's)
_EXIT_POLL_S = 0.25  # how often the server's shutdown flag is read


class _Gone(Exception):
    """The HTTP client disconnected while its request waited."""


class Gateway:
    """What the routes share: the configuration, the key check and the queue client (one per process)."""

    def __init__(self, config: GatewayConfig, client: Client | None = None) -> None:
        self.config = config
        self.auth = Auth(config.api_keys)
        self._client = client
        self._owns_client = client is None
        self.streams = Streams()
        self.responses = Responses(self)  # /v1/responses
        self.embeddings = EmbeddingsAPI(self)  # /v1/embeddings
        self.webhooks = WebhookSettings.of(config)  # None: no webhook endpoint configured
        self._deliverer: Deliverer | None = None
        self.batches = Batches(self)  # /v1/files, /v1/batches, and this gateway's batch feeder

    @property
    def client(self) -> Client:
        assert self._client is not None, "the app's lifespan opens the client"
        return self._client

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self._owns_client:
            self._client = Client(config=self.config.client)
        log.info("gateway serving the queue at %s (prefix %s; %s; event loop %s)", self.client.where,
                 self.client.keys.prefix, "API keys required" if self.auth.required else "no API keys",
                 type(asyncio.get_running_loop()).__module__.split(".")[0])
        if self.webhooks is not None:  # every gateway with endpoints delivers (one consumer group)
            self._deliverer = Deliverer(self.client.redis, self.client.keys, self.webhooks,
                                        settle=self.responses.settle_entry)
            self._deliverer.start()
            log.info("delivering webhooks to %d endpoint(s)", len(self.webhooks.urls))
        exiting = asyncio.ensure_future(self._end_streams_on_exit())
        self.batches.start()
        # What exists now (modules, schemas, the app) lives as long as the process: the collector's full passes,
        # which streams' objects trigger every few hundred requests, need not walk it each time.
        gc.freeze()
        try:
            yield
        finally:
            exiting.cancel()
            if self._deliverer is not None:
                await self._deliverer.aclose()
            await self.batches.aclose()
            await self.responses.aclose()
            if self._owns_client and self._client is not None:
                await self._client.aclose()

    async def _end_streams_on_exit(self) -> None:
        """Once the server is shutting down, end open streams (their jobs cancelled) rather than wait for them
        to end: the server's graceful period is for the requests that end soon. Under uvicorn in its main
        thread (``mlxq gateway``), whose SIGTERM handler is its server's: the one way to read its shutdown."""
        server: Any = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        if not hasattr(server, "should_exit"):
            return
        while True:  # streams a kept-alive connection starts during the shutdown are ended too
            if server.should_exit and (n := self.streams.close_all()):
                log.info("shutting down: %d open stream(s) ended, their jobs cancelled", n)
            await asyncio.sleep(_EXIT_POLL_S)

    # --- generation ---------------------------------------------------------------------------------
    async def generate(self, request: Request, dialect: Dialect) -> Response:
        """One generation request, in ``dialect``'s formats."""
        t0 = time.perf_counter()
        job: Choices | None = None
        try:
            tenant = self.auth.check(request.headers)  # the key's: never a field or header the caller sets
            ask = dialect.parse(await self._body(request), self.config)
            job = Choices(self.client, [r.model_copy(update={"tenant": tenant}) for r in ask.requests()])
            await _unless_gone(request, job.open())
            if ask.stream:  # the stream closes the job; so does the task after it, should it never start
                stream, closing, job = self._stream(request, dialect, ask, job, t0), BackgroundTask(job.close), None
                return EventStream(stream, self.streams, headers={"x-mlxq-job-id": ask.request.id},
                                   background=closing)
            texts = await _unless_gone(request, job.whole())
            _log_done(request, dialect, job, t0)
            return JSONResponse(dialect.response(ask, job, texts), headers={"x-mlxq-job-id": job.rid})
        except _Gone:
            log.debug("%s %s: the client went away (job %s) -> %d", request.method, request.url.path,
                      job.rid if job else "-", _GONE)
            return Response(status_code=_GONE)
        except Exception as exc:
            return await self._failed(request, dialect, exc, job)
        finally:
            if job is not None:
                await job.close()

    async def _stream(self, request: Request, dialect: Dialect, ask: Ask, job: Choices, t0: float
                      ) -> AsyncGenerator[bytes, None]:
        try:
            async for frame in dialect.frames(ask, job):
                yield frame
            _log_done(request, dialect, job, t0)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the server stops): its job
            # is cancelled (GeneratorExit: it went while a frame was being written)
            log.debug("%s %s: the client left the stream of job %s", request.method, request.url.path, job.rid)
            raise
        except Exception as exc:
            problem = problem_of(exc)
            _log_problem(request, problem, job.rid, "mid-stream")
            yield dialect.error_frame(problem)
        finally:
            await job.close()

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _failed(self, request: Request, dialect: Dialect, exc: Exception, job: Choices | None) -> Response:
        problem = await self._problem(exc)
        rid = job.rid if job is not None and job.submitted else None  # a refused request queued no job
        _log_problem(request, problem, rid, "", exc)
        headers = {**problem.headers(), **({"x-mlxq-job-id": rid} if rid else {})}
        return JSONResponse(dialect.error_body(problem), problem.status, headers=headers)

    async def _problem(self, exc: Exception) -> Problem:
        if not isinstance(exc, NoWorker):
            return problem_of(exc)
        try:  # a model some worker has (its engine dead, or draining) is no typo: 503, not 404
            known = exc.model in await self.client.models()
        except MlxqError:
            known = False
        return problem_of(exc, model_known=known)

    # --- the deployment -----------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        """``GET /v1/models`` and ``GET /v1/models/{model}``: what live workers serve now."""
        anthropic = "anthropic-version" in request.headers
        dialect: Dialect = MESSAGES if anthropic else CHAT
        wanted = request.path_params.get("model")
        try:
            self.auth.check(request.headers)
            live = {name: m for name, m in (await self.client.models()).items() if m.offered}
            if wanted is not None and wanted not in live:
                raise GatewayError(Problem(Kind.NOT_FOUND, f"no live worker serves model {wanted!r}",
                                           "model_not_found"))
        except Exception as exc:
            return await self._failed(request, dialect, exc, None)
        cards = [_card(m, anthropic) for name, m in live.items() if wanted in (None, name)]
        log.debug("%s %s -> 200 (%d models)", request.method, request.url.path, len(cards))
        if wanted is not None:
            return JSONResponse(cards[0])
        if anthropic:
            return JSONResponse({"data": cards, "has_more": False, "first_id": cards[0]["id"] if cards else None,
                                 "last_id": cards[-1]["id"] if cards else None})
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, request: Request) -> Response:
        """``GET /health``: ready while Redis answers."""
        try:
            await self.client.ping()
        except MlxqError as exc:
            log.warning("GET /health -> 503: %s", exc)
            return JSONResponse({"status": "unavailable", "error": str(exc)}, 503)
        log.debug("GET /health -> 200")
        return JSONResponse({"status": "ok"})


def _card(m: ModelInfo, anthropic: bool) -> dict[str, Any]:
    """One model, in the API's format, with what the queue knows of it."""
    # "loaded": false for a model live workers load on demand (its first job waits for the load).
    queue = {"workers": m.workers, "capacity": m.capacity, "context_length": m.context_length,
             "accepts_images": m.accepts_images, "loaded": m.workers > 0, "loadable_on": m.loadable}
    if anthropic:
        return {"type": "model", "id": m.name, "display_name": m.name, "created_at": "1970-01-01T00:00:00Z",
                **queue}
    return {"id": m.name, "object": "model", "created": 0, "owned_by": "mlxq", **queue}


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then it is cancelled and :class:`_Gone` raised. The
    work runs in this task; a watcher task cancels it."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:  # the watcher's cancellation, and nobody else's
            raise _Gone from None
        raise
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_large(limit: int) -> GatewayError:
    return GatewayError(Problem(Kind.TOO_LARGE, f"the request body is larger than {limit} bytes (the gateway's "
                                "MLXQ_GATEWAY_MAX_BODY)", "request_too_large"))


def _log_done(request: Request, dialect: Dialect, job: Choices, t0: float) -> None:
    if log.isEnabledFor(logging.DEBUG):
        done = job.first.done
        tokens = job.completion_tokens
        log.debug("%s %s (%s) job %s model %s -> 200: %d tokens, %s, %.1f ms", request.method, request.url.path,
                  dialect.name, job.rid, job.request.model, tokens,
                  done.finish_reason.value if done else "-", (time.perf_counter() - t0) * 1000)


def _log_problem(request: Request, problem: Problem, rid: str | None, when: str,
                 exc: BaseException | None = None) -> None:
    unexpected = exc is not None and problem.code == "internal" and not isinstance(exc, MlxqError | GatewayError)
    log.warning("%s %s job %s -> %d %s%s: %s", request.method, request.url.path, rid or "-", problem.status,
                problem.code, f" ({when})" if when else "", problem.message, exc_info=exc if unexpected else None)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's format."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    kind = Kind.NOT_FOUND if status == 404 else Kind.INVALID
    body = openai_error(Problem(kind, f"{request.method} {request.url.path}: {exc}", "unknown_route"))
    return JSONResponse(body, status)


class _App(Starlette):
    """Starlette, but a generation request (a POST to one of their paths) goes straight to the gateway: not
    through Starlette's router and middleware, which would also wrap every frame a stream sends in three more
    calls. The middleware has nothing to do for these requests: the gateway answers their every failure itself,
    in its API's format. Other methods on these paths still take the router's way (a 405)."""

    def __init__(self, gw: Gateway, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gateway = gw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        dialect = _GENERATION.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if dialect is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # as Starlette's own call sets it
        response = await self.gateway.generate(Request(scope, receive, send), dialect)
        await response(scope, receive, send)


_GENERATION: dict[str, Dialect] = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS,
                                   "/v1/messages": MESSAGES}


def create_app(config: GatewayConfig | None = None, *, client: Client | None = None) -> Starlette:
    """The gateway's ASGI app. ``client``: a queue client of the caller's (else it opens its own, from
    ``config.client``, for the app's lifetime)."""
    gw = Gateway(config or GatewayConfig.from_env(), client)

    def post(dialect: Dialect) -> Any:
        async def route(request: Request) -> Response:
            return await gw.generate(request, dialect)
        return route

    routes = [
        *(Route(path, post(dialect), methods=["POST"]) for path, dialect in _GENERATION.items()),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.models, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        *gw.responses.routes(),
        *gw.embeddings.routes(),
        *gw.batches.routes(),
        *dashboard_routes(Dashboard(lambda: gw.client, gw.config.api_keys, gw.config.admin_keys)),
    ]
    return _App(gw, routes=routes, lifespan=gw.lifespan, exception_handlers={HTTPException: _http_error})
