"""The fleet's web dashboard: a page at ``/dashboard`` and the JSON it polls, mounted by the gateway's app (and
served alone by ``mlxq dashboard``).

- ``GET /dashboard``, ``/dashboard/static/{file}``: the page (plain HTML, CSS and script shipped in the package;
  no data in them, so no key is needed to load them);
- ``GET /dashboard/api/session``: whether the request's key may read, and act;
- ``GET /dashboard/api/overview``: models and queues, workers (lost ones too), running, recent and dead-lettered
  jobs and the charts' history (``api.fleet``); the same for every reader, so one read a second is shared;
- ``GET /dashboard/api/jobs/{id}``: one job with its events; prompts and outputs for an admin key only;
- ``POST /dashboard/api/jobs/{id}/cancel`` and ``POST /dashboard/api/dead/retry`` (``{"hex": ...}``): the actions,
  admin keys only.

Every data route wants a key of ``MLXQ_API_KEYS`` or ``MLXQ_ADMIN_KEYS`` (none configured: reading is open);
actions want one of ``MLXQ_ADMIN_KEYS`` (none configured: there are no admins). The page sends the key it is
given as ``Authorization: Bearer`` on its requests (it keeps it in the tab's sessionStorage). No GET changes
anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ..client import Client
from ..errors import BadRequest, JobNotFound, MlxqError
from ..fleet import job, overview, retry_dead_letter
from .auth import Auth
from .config import GatewayConfig
from .errors import GatewayError, Kind, Problem, problem_of

__all__ = ["Dashboard", "create_dashboard_app", "routes"]

log = logging.getLogger(__name__)

_SHARED_S = 1.0  # one overview read serves every dashboard asking within this long
_STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}
# The page runs only its own script and styles, and is never framed.
_HEADERS = {"content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-store"}


class _Forbidden(Exception):
    """A reader's key asked for an admin's action (a 403)."""


class Dashboard:
    """The dashboard's routes over one queue client (``client()``: the app's, once its lifespan opened it)."""

    def __init__(self, client: Callable[[], Client], api_keys: frozenset[str], admin_keys: frozenset[str]) -> None:
        self._client = client
        self.readers = Auth(api_keys | admin_keys) if api_keys else Auth(frozenset())
        self.admins = Auth(admin_keys)
        self._shared: tuple[float, dict[str, Any]] | None = None
        self._reading: asyncio.Task[dict[str, Any]] | None = None

    def _admin(self, request: Request) -> bool:
        """Whether the request carries an admin key; raises a 401 unless it may read at all."""
        if self.admins.required:
            try:
                self.admins.check(request.headers)
                return True
            except GatewayError:
                pass
        self.readers.check(request.headers)
        return False

    async def page(self, request: Request) -> Response:
        """``GET /dashboard`` and its static files."""
        name = request.path_params.get("name", "index.html")
        if name not in _STATIC:
            return _error(Problem(Kind.NOT_FOUND, f"no such file {name!r}", "not_found"))
        body = resources.files("mlxq.api.gateway").joinpath("page", name).read_bytes()
        return Response(body, media_type=_STATIC[name], headers=_HEADERS)

    async def session(self, request: Request) -> JSONResponse:
        """``GET /dashboard/api/session``: what the request's key may do (never a 401: the page asks before it
        reads, so a visitor without a key sees a sign-in prompt rather than failed requests)."""
        try:
            admin = self._admin(request)
        except GatewayError:
            return JSONResponse({"reader": False, "admin": False, "keys_required": True})
        return JSONResponse({"reader": True, "admin": admin, "keys_required": self.readers.required})

    async def overview(self, request: Request) -> Response:
        """``GET /dashboard/api/overview``."""
        return await self._answer(request, lambda admin: self._overview(admin))

    async def _overview(self, admin: bool) -> dict[str, Any]:
        now = time.monotonic()
        if self._shared is not None and now - self._shared[0] < _SHARED_S:
            return {**self._shared[1], "admin": admin}
        if self._reading is None:  # readers that come together share one read
            self._reading = asyncio.ensure_future(overview(self._client()))
            self._reading.add_done_callback(lambda _: setattr(self, "_reading", None))
        data = await asyncio.shield(self._reading)
        self._shared = (now, data)
        return {**data, "admin": admin}

    async def job(self, request: Request) -> Response:
        """``GET /dashboard/api/jobs/{rid}``."""
        rid = request.path_params["rid"]
        return await self._answer(request, lambda admin: job(self._client(), rid, full=admin))

    async def cancel(self, request: Request) -> Response:
        """``POST /dashboard/api/jobs/{rid}/cancel``: the client's cancel."""
        rid = request.path_params["rid"]

        async def act(_: bool) -> dict[str, Any]:
            requested = await self._client().cancel(rid)
            log.info("dashboard: cancel of job %s %s", rid, "requested" if requested else "not needed (it ended)")
            return {"id": rid, "cancel_requested": requested}
        return await self._answer(request, act, needs_admin=True)

    async def retry(self, request: Request) -> Response:
        """``POST /dashboard/api/dead/retry`` with ``{"hex": <the dead letter's entry, hex>}``."""
        async def act(_: bool) -> dict[str, Any]:
            try:
                entry = (await request.json())["hex"]
            except (ValueError, KeyError, TypeError):
                raise BadRequest('the body must be {"hex": "<the dead letter\'s entry, hex>"}') from None
            new_id = await retry_dead_letter(self._client(), str(entry))
            log.info("dashboard: dead letter %s submitted again as job %s", entry, new_id)
            return {"id": new_id}
        return await self._answer(request, act, needs_admin=True)

    async def _answer(self, request: Request, work: Callable[[bool], Awaitable[dict[str, Any]]],
                      needs_admin: bool = False) -> Response:
        try:
            is_admin = self._admin(request)
            if needs_admin and not is_admin:
                raise _Forbidden("this action needs a key of MLXQ_ADMIN_KEYS")
            body = await work(is_admin)
        except _Forbidden as exc:
            log.warning("%s %s -> 403: %s", request.method, request.url.path, exc)
            return JSONResponse({"error": {"message": str(exc), "code": "admin_key_required"}}, 403)
        except JobNotFound as exc:
            return _error(Problem(Kind.NOT_FOUND, str(exc), "job_not_found"))
        except (GatewayError, MlxqError) as exc:
            problem = exc.problem if isinstance(exc, GatewayError) else problem_of(exc)
            log.warning("%s %s -> %d %s: %s", request.method, request.url.path, problem.status, problem.code,
                        problem.message)
            return _error(problem)
        return JSONResponse(body, headers={"cache-control": "no-store"})


def _error(problem: Problem) -> Response:
    return JSONResponse({"error": {"message": problem.message, "code": problem.code}}, problem.status,
                        headers=problem.headers())


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    """The dashboard's routes, under ``/dashboard``."""
    return [
        Route("/dashboard", dashboard.page, methods=["GET"]),
        Route("/dashboard/static/{name}", dashboard.page, methods=["GET"]),
        Route("/dashboard/api/session", dashboard.session, methods=["GET"]),
        Route("/dashboard/api/overview", dashboard.overview, methods=["GET"]),
        Route("/dashboard/api/jobs/{rid}", dashboard.job, methods=["GET"]),
        Route("/dashboard/api/jobs/{rid}/cancel", dashboard.cancel, methods=["POST"]),
        Route("/dashboard/api/dead/retry", dashboard.retry, methods=["POST"]),
    ]


def create_dashboard_app(config: GatewayConfig | None = None) -> Starlette:
    """The dashboard alone (``mlxq dashboard``: a host with no gateway), over a queue client of its own."""
    config = config or GatewayConfig.from_env()
    opened: list[Client] = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        opened.append(Client(config=config.client))
        log.info("dashboard reading the queue at %s (prefix %s)", opened[0].where, opened[0].keys.prefix)
        try:
            yield
        finally:
            await opened[0].aclose()

    async def home(request: Request) -> Response:  # the address uvicorn prints: alone, the page is the app
        return RedirectResponse("/dashboard")

    board = Dashboard(lambda: opened[0], config.api_keys, config.admin_keys)
    return Starlette(routes=[Route("/", home, methods=["GET"]), *routes(board)], lifespan=lifespan)
