"""The exceptions the producer API raises.

    MlxqError
     ├── BadRequest      the client refused a request before enqueueing it
     ├── DuplicateJob    a job with this id already exists (ids are never reused)
     ├── JobFailed       the job ended with an ``error`` event (carries code, message, retryable)
     ├── JobNotFound     no such job, or its events expired
     ├── NotFound        no such file or batch (or another tenant's: the same answer)
     ├── WaitTimeout     no terminal event arrived within the caller's timeout
     ├── NoWorker        no live worker serves the model (raised only when the caller asked to refuse)
     ├── QueueFull       the model's queue holds the producer's cap of waiting jobs (retry later)
     │    └── QueueOutOfMemory  Redis is at its maxmemory and refuses new work (noeviction)
     ├── QueueUnavailable  Redis could not be reached within the client's retry deadline
     ├── AccessDenied    Redis refused the credentials or a command (never retried)
     └── ConfigError     an MLXQ_* variable holds a value that cannot be used
          └── UnexpectedPassword  the Redis URL gives a password to a Redis that has none (also AccessDenied)
"""

from __future__ import annotations

from pydantic import ValidationError

from .schema import ErrorCode, ErrorEvent

__all__ = [
    "AccessDenied", "BadRequest", "ConfigError", "DuplicateJob", "JobFailed", "JobNotFound", "MlxqError", "NoWorker",
    "NotFound", "QueueFull", "QueueOutOfMemory", "QueueUnavailable", "UnexpectedPassword", "WaitTimeout", "describe",
    "elsewhere_hint", "install_hint",
]


class MlxqError(Exception):
    """Base of every mlxq exception."""


class BadRequest(MlxqError):
    """The request is invalid; nothing was enqueued. ``param``: the field it is about, and ``code``: what is
    wrong with it, where the check names them (a gateway answers them as OpenAI's error's ``param`` and ``code``)."""

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class DuplicateJob(MlxqError):
    """A job with this id was already enqueued."""


class JobFailed(MlxqError):
    """The job ended with an error event."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(f"{event.code.value}: {event.message}")
        self.event = event

    @property
    def code(self) -> ErrorCode:
        return self.event.code

    @property
    def retryable(self) -> bool:
        return self.event.retryable


class JobNotFound(MlxqError):
    """No job with this id is queued, running or logged (never submitted, or its events expired)."""


class NotFound(MlxqError):
    """No such file or batch, or it belongs to another tenant (told apart by no one)."""


class WaitTimeout(MlxqError):
    """Waiting for a job's events took longer than the caller allowed."""


class NoWorker(MlxqError):
    """No live worker serves the model; nothing was enqueued. ``served`` names the models live workers serve;
    ``elsewhere``, when none serves any, the models served under other prefixes of the same Redis."""

    def __init__(self, model: str, served: list[str], elsewhere: dict[str, list[str]] | None = None) -> None:
        listed = ", ".join(repr(m) for m in served) if served else "none"
        super().__init__(f"no live worker serves model {model!r} (models served now: {listed})"
                         f"{elsewhere_hint(elsewhere or {}, model)}")
        self.model = model
        self.served = served
        self.elsewhere = elsewhere or {}


class QueueFull(MlxqError):
    """The model's queue holds as many waiting jobs as producers may queue (``MLXQ_MAX_QUEUED``), or ``tenant``'s
    jobs reached its ``max_queued`` (``mlxq tenants``); nothing was enqueued. Retry after ``retry_after`` seconds."""

    def __init__(self, model: str, limit: int, retry_after: float = 1.0, tenant: str | None = None) -> None:
        if tenant is None:
            super().__init__(f"the queue of model {model!r} is full ({limit} jobs waiting); retry later")
        else:
            super().__init__(f"tenant {tenant!r} has as many jobs queued as its max-queued allows; retry later")
        self.model = model
        self.limit = limit
        self.retry_after = retry_after
        self.tenant = tenant


class QueueOutOfMemory(QueueFull):
    """Redis holds its ``maxmemory`` and refuses writes (policy ``noeviction``): nothing was enqueued. Jobs end
    and kept results expire over time; an operator raises ``maxmemory`` or shortens ``MLXQ_KEEP_RESULT``."""

    def __init__(self, model: str, detail: str, retry_after: float = 5.0) -> None:
        MlxqError.__init__(self, f"Redis is out of memory and refuses new jobs (model {model!r}): {detail}; "
                           "retry later, or raise its maxmemory / shorten MLXQ_KEEP_RESULT")
        self.model, self.limit, self.retry_after, self.tenant = model, 0, retry_after, None


class QueueUnavailable(MlxqError):
    """Redis could not be reached within the client's retry deadline (``MLXQ_RETRY_DEADLINE``)."""


class AccessDenied(MlxqError):
    """Redis refused the client's credentials (wrong or missing password) or a command (ACL)."""


class ConfigError(MlxqError):
    """An ``MLXQ_*`` environment variable (or option) holds a value that cannot be used."""


class UnexpectedPassword(ConfigError, AccessDenied):
    """The Redis URL gives a password to a Redis that has none: a configuration to fix (never retried), and a
    refusal of the credentials for whoever handles those (:class:`AccessDenied`)."""


def elsewhere_hint(elsewhere: dict[str, list[str]], model: str | None = None) -> str:
    """``; live workers under other prefixes: MLXQ_PREFIX=p ('m', ...), ...`` (those serving ``model`` first),
    or "" when there are none: the workers' MLXQ_PREFIX is perhaps not the caller's."""
    if not elsewhere:
        return ""
    others = sorted(elsewhere.items(), key=lambda item: (model not in item[1], item[0]))
    return "; live workers under other prefixes: " + ", ".join(
        f"MLXQ_PREFIX={prefix} ({', '.join(repr(m) for m in models)})" for prefix, models in others)


def install_hint(extra: str) -> str:
    """How to install one of mlxq's extras, from a package index and from a checkout (one wording everywhere)."""
    return f"python3 -m pip install 'mlxq[{extra}]' (from a checkout: python3 -m pip install -e '.[{extra}]')"


def describe(exc: ValidationError, most: int = 5) -> str:
    """A request's validation errors as ``field: problem`` parts on one line, bounded in length."""
    parts = []
    for err in exc.errors()[:most]:
        where = ".".join(_clip(str(p), 64) for p in err["loc"]) or "request"
        parts.append(f"{where}: {_clip(err['msg'], 300)}")
    more = f" (+{exc.error_count() - most} more)" if exc.error_count() > most else ""
    return "; ".join(parts) + more


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "..."
