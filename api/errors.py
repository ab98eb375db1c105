"""The exceptions the producer API raises.

    MlxqError
     ├── BadRequest      the client refused a request before enqueueing it
     ├── DuplicateJob    a job with this id already exists (ids are never reused)
     ├── JobFailed       the job ended with an ``error`` event (carries code, message, retryable)
     ├── JobNotFound     no such job, or its events expired
     ├── WaitTimeout     no terminal event arrived within the caller's timeout
     ├── QueueUnavailable  Redis could not be reached within the client's retry deadline
     └── AccessDenied    Redis refused the credentials or a command (never retried)
"""

from __future__ import annotations

from .schema import ErrorCode, ErrorEvent

__all__ = [
    "AccessDenied", "BadRequest", "DuplicateJob", "JobFailed", "JobNotFound", "MlxqError", "QueueUnavailable",
    "WaitTimeout",
]


class MlxqError(Exception):
    """Base of every mlxq exception."""


class BadRequest(MlxqError):
    """The request is invalid; nothing was enqueued."""


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


class WaitTimeout(MlxqError):
    """Waiting for a job's events took longer than the caller allowed."""


class QueueUnavailable(MlxqError):
    """Redis could not be reached within the client's retry deadline (``MLXQ_RETRY_DEADLINE``)."""


class AccessDenied(MlxqError):
    """Redis refused the client's credentials (wrong or missing password) or a command (ACL)."""
