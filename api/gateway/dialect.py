"""What the app needs of each API it speaks (OpenAI chat and completions, Anthropic messages): a dialect.

The app reads, authenticates and submits alike for every API; a dialect turns a request body into the job
to run (:class:`Ask`) and the job's text and end into that API's response, stream frames and error bodies.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..schema import GenerateRequest, new_request_id
from .config import GatewayConfig
from .errors import Problem
from .job import Choices

__all__ = ["Ask", "Dialect", "sse"]


@dataclass(frozen=True, slots=True)
class Ask:
    """One parsed API request: the job to run and how to answer."""

    request: GenerateRequest
    stream: bool
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    n: int = 1  # choices: one job each

    def requests(self) -> list[GenerateRequest]:
        """The job of each choice: the request, then copies under new ids (a seed, if given, one up for each)."""
        out = [self.request]
        for i in range(1, self.n):
            seed = None if self.request.seed is None else (self.request.seed + i) % 2**63
            out.append(self.request.model_copy(update={"id": new_request_id(), "seed": seed}))
        return out


class Dialect(Protocol):
    """One API's request and response formats."""

    name: str  # in log lines

    def parse(self, body: bytes, config: GatewayConfig) -> Ask:
        """The job a request body asks for; raises a 400 ``GatewayError`` for what the gateway refuses."""
        ...

    def response(self, ask: Ask, jobs: Choices, texts: list[str]) -> dict[str, Any]:
        """The whole (non-streamed) response to jobs that ended with ``texts`` (one per choice)."""
        ...

    def frames(self, ask: Ask, jobs: Choices) -> AsyncIterator[bytes]:
        """The SSE frames of a streamed response, from the jobs' start to their end (the end a ``sse.Last``)."""
        ...

    def error_body(self, problem: Problem) -> dict[str, Any]:
        """The API's error object."""
        ...

    def error_frame(self, problem: Problem) -> bytes:
        """The API's error event, ending a stream that failed after it started (a ``sse.Last``)."""
        ...


def sse(data: str, event: str | None = None) -> bytes:
    """One server-sent event. ``data`` is one line of JSON (json never writes a raw newline)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # json.dumps makes one per call given options


def dumps(obj: Any) -> str:
    """Compact JSON, as the APIs send it."""
    return _JSON.encode(obj)
