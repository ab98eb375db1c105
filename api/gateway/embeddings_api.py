"""OpenAI's ``POST /v1/embeddings`` over the queue: one embedding job per request, its vectors in the response.

``input``: a string, a list of strings, a list of token ids, or a list of token-id lists (ids are embedded as given,
texts as the model's tokenizer makes them); ``encoding_format``: ``float`` (the default) or ``base64`` (little-endian
float32, what the openai SDK asks for and decodes: the job's own encoding, passed through); ``dimensions``: each
vector cut to that many values and normalised again; ``user`` goes into the job's metadata, ``priority`` is mlxq's.
``usage`` counts the inputs' tokens. A bad request is a 400 in OpenAI's error format whose ``param`` names the
field: an empty input, an input past the model's token limit, ``dimensions`` below 1 or above the model's width,
a model that does not embed.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..embeddings import embedding_inputs
from ..errors import JobFailed
from ..schema import MAX_EMBED_INPUTS, DoneEvent, GenerateRequest, decode_vector
from .errors import GatewayError, Problem, invalid, validation_problem
from .job import JobStream
from .openai_api import openai_error

if TYPE_CHECKING:
    from .app import Gateway

__all__ = ["EmbeddingsAPI", "EmbeddingsRequest", "embedding_job", "embeddings_body", "parse_embeddings"]

log = logging.getLogger(__name__)

# A worker's refusal names its field first (worker/jobs/embed.py), or the model of the other kind (prepare.py).
_FIELD = re.compile(r"^(input|dimensions|model)\b")


class EmbeddingsRequest(BaseModel):
    """``POST /v1/embeddings`` (unknown fields are refused, as OpenAI does)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int | None = None  # mlxq's


class EmbeddingsAPI:
    """The endpoint's route, on the gateway's client and key check."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        """One embedding request: its job submitted and awaited; the vectors in OpenAI's response."""
        t0 = time.perf_counter()
        job: JobStream | None = None
        try:
            tenant = self.gw.auth.check(request.headers)
            body = parse_embeddings(await self.gw._body(request))
            job = JobStream(self.gw.client, embedding_job(body, tenant))
            await job.open()
            await job.whole()
            assert job.done is not None
            log.debug("POST /v1/embeddings job %s model %s -> 200: %d inputs, %.1f ms", job.rid, body.model,
                      len(job.done.embeddings or ()), (time.perf_counter() - t0) * 1000)
            return JSONResponse(embeddings_body(body, job.done), headers={"x-mlxq-job-id": job.rid})
        except Exception as exc:
            problem = await self.gw._problem(exc)
            rid = job.rid if job is not None and job.submitted else None
            log.warning("POST /v1/embeddings job %s -> %d %s: %s", rid or "-", problem.status, problem.code,
                        problem.message)
            error = openai_error(problem)
            error["error"]["param"] = _param(exc, problem)
            headers = {**problem.headers(), **({"x-mlxq-job-id": rid} if rid else {})}
            return JSONResponse(error, problem.status, headers=headers)
        finally:
            if job is not None:
                await job.close()


def parse_embeddings(raw: bytes) -> EmbeddingsRequest:
    """A request's body as the endpoint reads it (a batch line's too: api/gateway/batch_lines.py); a 400 naming
    the field for one it refuses."""
    try:
        body = EmbeddingsRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise _FieldError(validation_problem(exc), _first_field(exc)) from None
    given = body.input
    if given == "" or given == []:
        raise _field_error("input: it is empty (give a non-empty string, or a non-empty list)", "input")
    if isinstance(given, list):
        if len(given) > MAX_EMBED_INPUTS:
            raise _field_error(f"input: {len(given)} inputs; at most {MAX_EMBED_INPUTS} in a request", "input")
        empty = next((i for i, x in enumerate(given) if isinstance(x, str | list) and len(x) == 0), None)
        if empty is not None:
            raise _field_error(f"input[{empty}]: it is empty", "input")
    if body.dimensions is not None and body.dimensions < 1:
        raise _field_error(f"dimensions: {body.dimensions} is less than 1", "dimensions")
    return body


def embedding_job(body: EmbeddingsRequest, tenant: str) -> GenerateRequest:
    """The request's embedding job, the tenant's."""
    fields: dict[str, Any] = {"priority": body.priority} if body.priority is not None else {}
    try:
        return GenerateRequest(model=body.model, input=embedding_inputs(body.input), dimensions=body.dimensions,
                               tenant=tenant, metadata={"user": body.user} if body.user else {}, **fields)
    except ValidationError as exc:
        raise _FieldError(validation_problem(exc), _first_field(exc)) from None


def embeddings_body(body: EmbeddingsRequest, done: DoneEvent) -> dict[str, Any]:
    """OpenAI's embeddings response to the request, from its job's done event."""
    vectors: list[Any] = list(done.embeddings or ())
    if body.encoding_format == "float":
        vectors = [decode_vector(v) for v in vectors]
    tokens = done.usage.prompt_tokens
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class _FieldError(GatewayError):
    """A 400 about one field of the request (OpenAI's ``param``)."""

    def __init__(self, problem: Problem, param: str | None) -> None:
        super().__init__(problem)
        self.param = param


def _field_error(message: str, param: str) -> _FieldError:
    return _FieldError(invalid(message, "invalid_request").problem, param)


def _first_field(exc: ValidationError) -> str | None:
    errors = exc.errors()
    loc = errors[0]["loc"] if errors else ()
    return str(loc[0]) if loc else None


def _param(exc: Exception, problem: Problem) -> str | None:
    """The request's field a failure is about: a refusal here names it; a worker's names it first."""
    if isinstance(exc, _FieldError):
        return exc.param
    if isinstance(exc, JobFailed) and problem.status == 400:
        found = _FIELD.match(problem.message)
        return found.group(1) if found else None
    return None
