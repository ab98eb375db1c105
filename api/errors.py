"""The exceptions the producer API raises.

    MlxqError
     ├── BadRequest      the client refused a request before enqueueing it
     ├── DuplicateJob    a job with this id already exists (ids are never reused)
     ├── JobFailed       the job ended with an ``error`` event (carries code, message, retryable)
     └── WaitTimeout     no terminal event arrived within the caller's timeout
"""

from __future__ import annotations

from .schema import ErrorCode, ErrorEvent

__all__ = ["BadRequest", "DuplicateJob", "JobFailed", "MlxqError", "WaitTimeout"]


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


class WaitTimeout(MlxqError):
    """Waiting for a job's events took longer than the caller allowed."""
