"""What went wrong with an HTTP request, as one record each API renders in its own error format.

    GatewayError        carries a Problem: the request is answered with its status and the API's error body
    Problem             kind (-> HTTP status), message, code (machine-readable), retry_after (429)

:func:`problem_of` maps the producer API's exceptions (``api.errors``) to problems; nothing else reaches a
client, never a traceback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from pydantic import ValidationError

from ..errors import (
    AccessDenied,
    BadRequest,
    JobFailed,
    JobNotFound,
    NoWorker,
    QueueFull,
    QueueOutOfMemory,
    QueueUnavailable,
    WaitTimeout,
)
from ..schema import ErrorCode

__all__ = ["GatewayError", "Kind", "Problem", "invalid", "problem_of", "validation_problem"]


class Kind(str, Enum):
    """A class of failure; each maps to one HTTP status and one error type per API."""

    INVALID = "invalid"  # 400
    UNAUTHORIZED = "unauthorized"  # 401
    NOT_FOUND = "not_found"  # 404
    TOO_LARGE = "too_large"  # 413
    RATE_LIMITED = "rate_limited"  # 429
    UPSTREAM = "upstream"  # 500
    UNAVAILABLE = "unavailable"  # 503


STATUS = {Kind.INVALID: 400, Kind.UNAUTHORIZED: 401, Kind.NOT_FOUND: 404, Kind.TOO_LARGE: 413,
          Kind.RATE_LIMITED: 429, Kind.UPSTREAM: 500, Kind.UNAVAILABLE: 503}


@dataclass(frozen=True, slots=True)
class Problem:
    """One failed request: ``code`` is machine-readable (a job's error code, ``model_not_found``, ...)."""

    kind: Kind
    message: str
    code: str | None = None
    retry_after: float | None = None  # seconds, with RATE_LIMITED

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, rounded up) when the client should come back later."""
        return {} if self.retry_after is None else {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class GatewayError(Exception):
    """Raised inside the gateway to answer a request with ``problem``."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def invalid(message: str, code: str | None = None) -> GatewayError:
    """A 400 for a request the gateway refuses as sent."""
    return GatewayError(Problem(Kind.INVALID, message, code))


def validation_problem(exc: ValidationError) -> Problem:
    """A request body that does not fit the API's schema: its first few errors, each with where it is."""
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return Problem(Kind.INVALID, "; ".join(parts) + more, "invalid_request")


def problem_of(exc: BaseException, *, model_known: bool = False) -> Problem:
    """The problem an exception of the producer API means to an HTTP client (``model_known``: with
    :class:`NoWorker`, whether some worker has that model, dead or draining, so it is no typo)."""
    if isinstance(exc, GatewayError):
        return exc.problem
    if isinstance(exc, JobFailed):
        return _job_problem(exc)
    if isinstance(exc, NoWorker):
        if model_known:
            return Problem(Kind.UNAVAILABLE, str(exc), "no_live_worker")
        return Problem(Kind.NOT_FOUND, str(exc), "model_not_found")
    if isinstance(exc, QueueOutOfMemory):  # the deployment's fault, not the caller's rate: a 503
        return Problem(Kind.UNAVAILABLE, str(exc), "queue_out_of_memory", exc.retry_after)
    if isinstance(exc, QueueFull):
        return Problem(Kind.RATE_LIMITED, str(exc), "queue_full", exc.retry_after)
    if isinstance(exc, BadRequest):
        return Problem(Kind.INVALID, str(exc), "invalid_request")
    if isinstance(exc, QueueUnavailable | WaitTimeout):
        return Problem(Kind.UNAVAILABLE, str(exc), "queue_unavailable")
    if isinstance(exc, JobNotFound):  # its events vanished while it ran: Redis lost them
        return Problem(Kind.UNAVAILABLE, str(exc), "job_lost")
    if isinstance(exc, AccessDenied):
        return Problem(Kind.UPSTREAM, "the gateway's queue refused its credentials (see its log)", "access_denied")
    return Problem(Kind.UPSTREAM, "internal error in the gateway (see its log)", "internal")


_NOT_RUN = frozenset({ErrorCode.WORKER_LOST, ErrorCode.EXPIRED, ErrorCode.DATA_LOST, ErrorCode.MODEL_UNAVAILABLE})


def _job_problem(exc: JobFailed) -> Problem:
    # The worker judged the request (prompt past the context, ...): the caller's fault, a 400. The queue could
    # not run it to its end (its worker lost, nobody took it in time, Redis lost it): a 503, try again. The run
    # itself failed (engine error, past its deadline, a bug): a 500.
    code = exc.code.value
    if exc.code is ErrorCode.BAD_REQUEST:
        return Problem(Kind.INVALID, exc.event.message, code)
    kind = Kind.UNAVAILABLE if exc.code in _NOT_RUN else Kind.UPSTREAM
    return Problem(kind, f"the job failed ({code}): {exc.event.message}", code)
