"""OpenAI's Files and Batch APIs over the queue: the routes (``api/files.py`` keeps the files, ``api/batches.py``
the batches, ``api/feeder.py`` runs them; every gateway runs a feeder).

- ``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files`` (``after``, ``limit``, ``order``,
  ``purpose``), ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
- ``POST /v1/batches``, ``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel``.

Files and batches belong to their key's tenant: another tenant's id gets the 404 an unknown one gets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..batches import BatchStore
from ..errors import BadRequest, NotFound
from ..feeder import BatchFeeder, FeederSettings
from ..files import FileLimits, FileStore
from .batch_lines import BatchLines
from .errors import GatewayError, Kind, Problem, invalid, problem_of
from .openai_api import openai_error

if TYPE_CHECKING:
    from .app import Gateway

__all__ = ["Batches"]

log = logging.getLogger(__name__)

_FORM_SLACK = 64 * 1024  # a multipart body's bytes beside its file's (boundaries, the purpose field)


class Batches:
    """The Files and Batch API routes of one gateway, and its feeder."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._files: FileStore | None = None
        self._batches: BatchStore | None = None
        self.feeder: BatchFeeder | None = None

    @property
    def files(self) -> FileStore:
        if self._files is None:  # the client opens with the app's lifespan
            cfg = self.gw.config
            limits = FileLimits(cfg.batch_max_file_bytes, cfg.batch_max_lines, cfg.file_retention_s)
            self._files = FileStore(self.gw.client.redis, self.gw.client.keys, limits)
        return self._files

    @property
    def batches(self) -> BatchStore:
        if self._batches is None:
            self._batches = BatchStore(self.gw.client.redis, self.gw.client.keys, self.files,
                                       self.gw.config.batch_completion_window_s)
        return self._batches

    def start(self) -> None:
        """Start this gateway's feeder (``MLXQ_BATCH_WINDOW`` 0: none; other gateways or ``mlxq batches feed``
        run the batches)."""
        cfg = self.gw.config
        if cfg.batch_window > 0:
            self.feeder = BatchFeeder(self.gw.client, self.batches, BatchLines(cfg),
                                      FeederSettings(window=cfg.batch_window, no_worker_grace_s=cfg.batch_no_worker_s))
            self.feeder.start()

    async def aclose(self) -> None:
        if self.feeder is not None:
            await self.feeder.aclose()

    def routes(self) -> list[Route]:
        return [Route("/v1/files", self.upload, methods=["POST"]),
                Route("/v1/files", self.list_files, methods=["GET"]),
                Route("/v1/files/{fid}", self.file, methods=["GET"]),
                Route("/v1/files/{fid}", self.delete_file, methods=["DELETE"]),
                Route("/v1/files/{fid}/content", self.content, methods=["GET"]),
                Route("/v1/batches", self.create, methods=["POST"]),
                Route("/v1/batches", self.list_batches, methods=["GET"]),
                Route("/v1/batches/{bid}", self.batch, methods=["GET"]),
                Route("/v1/batches/{bid}/cancel", self.cancel, methods=["POST"])]

    # --- files --------------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        try:
            tenant = self.gw.auth.check(request.headers)
            limit = self.files.limits.max_bytes
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit + _FORM_SLACK:
                raise _too_large(limit)
            async with request.form(max_files=1, max_fields=8) as form:
                upload, purpose = form.get("file"), form.get("purpose")
                if not isinstance(upload, UploadFile):
                    raise invalid("the form needs a file field (multipart/form-data)", "invalid_request")
                if not isinstance(purpose, str) or purpose != "batch":
                    raise invalid(f"purpose must be 'batch', not {purpose!r}", "invalid_request")
                data = await upload.read(limit + 1)
                if len(data) > limit:
                    raise _too_large(limit)
                obj = await self.files.create(data, upload.filename or "upload.jsonl", purpose, tenant)
        except Exception as exc:
            return self._failed(request, exc)
        log.debug("POST /v1/files -> %s (%d bytes)", obj["id"], obj["bytes"])
        return JSONResponse(obj)

    async def list_files(self, request: Request) -> Response:
        try:
            tenant = self.gw.auth.check(request.headers)
            q = request.query_params
            order = q.get("order", "desc")
            if order not in ("asc", "desc"):
                raise invalid("order must be asc or desc", "invalid_request")
            page = await self.files.listing(tenant, after=q.get("after"), limit=_limit(q.get("limit"), 10_000, 10_000),
                                            order=order, purpose=q.get("purpose"))
        except Exception as exc:
            return self._failed(request, exc)
        return JSONResponse(page)

    async def file(self, request: Request) -> Response:
        return await self._by_id(request, "fid", self.files.get)

    async def delete_file(self, request: Request) -> Response:
        return await self._by_id(request, "fid", self.files.delete)

    async def content(self, request: Request) -> Response:
        try:
            tenant = self.gw.auth.check(request.headers)
            fid = request.path_params["fid"]
            await self.files.get(fid, tenant)
        except Exception as exc:
            return self._failed(request, exc)

        async def body() -> AsyncIterator[bytes]:
            async for chunk in self.files.content(fid, tenant):
                yield chunk
        return StreamingResponse(body(), media_type="application/octet-stream")

    # --- batches ------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        try:
            tenant = self.gw.auth.check(request.headers)
            body = _json(await self.gw._body(request))
            for name in ("input_file_id", "endpoint", "completion_window"):
                if not isinstance(body.get(name), str):
                    raise invalid(f"{name} is required (a string)", "invalid_request")
            unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                   "output_expires_after"}
            if unknown:
                raise invalid(f"unknown fields: {', '.join(sorted(unknown))}", "invalid_request")
            obj = await self.batches.create(body["input_file_id"], body["endpoint"], tenant,
                                            completion_window=body["completion_window"],
                                            metadata=body.get("metadata"),
                                            output_expires_after=body.get("output_expires_after"))
        except Exception as exc:
            return self._failed(request, exc)
        log.info("POST /v1/batches -> %s (%s, file %s)", obj["id"], obj["endpoint"], obj["input_file_id"])
        return JSONResponse(obj)

    async def list_batches(self, request: Request) -> Response:
        try:
            tenant = self.gw.auth.check(request.headers)
            q = request.query_params
            page = await self.batches.listing(tenant, after=q.get("after"), limit=_limit(q.get("limit"), 100, 20))
        except Exception as exc:
            return self._failed(request, exc)
        return JSONResponse(page)

    async def batch(self, request: Request) -> Response:
        return await self._by_id(request, "bid", self.batches.get)

    async def cancel(self, request: Request) -> Response:
        async def cancel(bid: str, tenant: str) -> dict[str, Any]:
            obj = await self.batches.cancel(bid, tenant)
            log.info("POST /v1/batches/%s/cancel -> %s", obj["id"], obj["status"])
            return obj
        return await self._by_id(request, "bid", cancel)

    async def _by_id(self, request: Request, param: str,
                     op: Callable[[str, str], Awaitable[dict[str, Any]]]) -> Response:
        """``op`` on the file or batch the path names (``param``), as the caller's tenant: its answer, or the
        error's."""
        try:
            obj = await op(request.path_params[param], self.gw.auth.check(request.headers))
        except Exception as exc:
            return self._failed(request, exc)
        return JSONResponse(obj)

    def _failed(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, NotFound):
            problem = Problem(Kind.NOT_FOUND, str(exc), "not_found")
        elif isinstance(exc, BadRequest):
            problem = Problem(Kind.INVALID, str(exc), exc.code or "invalid_request")
        else:
            problem = problem_of(exc)
        level = logging.WARNING if problem.status >= 500 else logging.DEBUG
        log.log(level, "%s %s -> %d %s: %s", request.method, request.url.path, problem.status, problem.code,
                problem.message, exc_info=exc if problem.code == "internal" else None)
        body = openai_error(problem)
        body["error"]["param"] = exc.param if isinstance(exc, BadRequest) else None
        return JSONResponse(body, problem.status, headers=problem.headers())


def _json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        raise invalid("the body is not JSON", "invalid_request") from None
    if not isinstance(body, dict):
        raise invalid("the body is not a JSON object", "invalid_request")
    return body


def _limit(raw: str | None, most: int, default: int) -> int:
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid(f"limit must be an integer from 1 to {most}", "invalid_request")
    return int(raw)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(Problem(Kind.TOO_LARGE, f"the file is larger than {limit} bytes (MLXQ_BATCH_MAX_FILE_BYTES)",
                                "file_too_large"))
