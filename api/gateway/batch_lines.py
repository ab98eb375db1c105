"""A batch line's body, read as the gateway reads the same request sent alone, and its job's end written as the
gateway would have answered it: the feeder's :class:`~api.batchline.LineCodec`.

``/v1/chat/completions`` and ``/v1/completions`` take the endpoints' own parsers and response bodies;
``/v1/responses`` the Responses API's (a line may not chain: ``previous_response_id`` is that line's error; it
is not stored); ``/v1/embeddings`` the embeddings endpoint's (api/gateway/embeddings_api.py: the same job and
response body as the request sent alone). ``stream`` is ignored (a batch answers whole), and ``n`` above 1 is
refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..batchline import LineError, Prepared
from ..client import Client
from ..deltas import Whole
from ..schema import DEFAULT_TENANT, DoneEvent, ErrorCode, ErrorEvent, Event, GenerateRequest
from .config import GatewayConfig
from .dialect import Ask
from .embeddings_api import EmbeddingsRequest, embedding_job, embeddings_body, parse_embeddings
from .errors import GatewayError
from .job import Choices
from .openai_api import CHAT, COMPLETIONS, ChatDialect, CompletionDialect
from .response_events import JobSteps, ResponseEvents
from .response_input import input_items, parse_request, to_ask
from .responses_api import _created

__all__ = ["BatchLines"]


class BatchLines:
    """Reads and answers batch lines as this gateway's endpoints do (its configuration's defaults)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config

    def prepare(self, endpoint: str, body: Any) -> Prepared:
        raw = json.dumps({**body, "stream": False} if "stream" in body else body).encode()
        try:
            if endpoint in ("/v1/chat/completions", "/v1/completions"):
                dialect = CHAT if endpoint == "/v1/chat/completions" else COMPLETIONS
                ask = dialect.parse(raw, self.config)
                if ask.n > 1:
                    raise LineError("invalid_request", "n above 1 is not supported in a batch (one line, one "
                                    "choice)")
                return _Completion(dialect, ask)
            if endpoint == "/v1/responses":
                return self._response(raw)
            if endpoint == "/v1/embeddings":
                asked = parse_embeddings(raw)
                return _Embedding(embedding_job(asked, DEFAULT_TENANT), asked)  # its tenant: the feeder's to set
        except GatewayError as exc:
            raise LineError(exc.problem.code or "invalid_request", exc.problem.message) from None
        except (ValueError, TypeError) as exc:  # a body of the wrong shape the parsers did not name
            raise LineError("invalid_request", f"the body cannot be read: {exc}") from None
        raise LineError("unsupported_endpoint", f"{endpoint} is not served here: such lines cannot run")

    def _response(self, raw: bytes) -> Prepared:
        req = parse_request(raw)
        if req.previous_response_id:
            raise LineError("invalid_request", "previous_response_id cannot be used in a batch")
        rid = "resp_batch"  # its input items' ids are made from it; the job's id is set by the feeder
        items = input_items(req, rid)
        ask = to_ask(req, [], items, self.config, None)
        return _Response(ask.request, _created(rid, req, ask.request))


@dataclass(slots=True)
class _Completion:
    dialect: ChatDialect | CompletionDialect
    ask: Ask

    @property
    def request(self) -> GenerateRequest:
        return self.ask.request

    def render(self, events: Sequence[Event]) -> dict[str, Any]:
        whole = Whole()
        done: DoneEvent | None = None
        for ev in events:
            _failed(ev)
            whole.feed(ev)
            if isinstance(ev, DoneEvent):
                done = ev
        assert done is not None, "rendered only after the job's end"
        request = self.ask.request.model_copy(update={"id": events[0].id}) if events else self.ask.request
        jobs = Choices(cast(Client, None), [request])  # filled in, never opened: nothing to submit
        job = jobs.first
        job.done, job.reasoning, job.tool_calls = done, whole.reasoning, whole.tool_calls
        job.logprobs = list(whole.logprobs or ())
        return self.dialect.response(self.ask, jobs, [whole.text])


@dataclass(slots=True)
class _Response:
    request: GenerateRequest
    created: dict[str, Any]

    def render(self, events: Sequence[Event]) -> dict[str, Any]:
        steps = JobSteps(events[0].id if events else self.request.id)
        out = ResponseEvents({**self.created, "id": f"resp_{_steps_id(events)}"}, self.request.calls_tools)
        out.opening()
        for ev in events:
            _failed(ev)
            for step in steps.feed(ev):
                out.feed(step)
        return out.response


@dataclass(slots=True)
class _Embedding:
    request: GenerateRequest
    body: EmbeddingsRequest

    def render(self, events: Sequence[Event]) -> dict[str, Any]:
        for ev in events:
            _failed(ev, "invalid_request")
        done = events[-1] if events else None
        assert isinstance(done, DoneEvent), "rendered only after the job's end"
        return embeddings_body(self.body, done)


def _steps_id(events: Sequence[Event]) -> str:
    return events[0].id.replace(".", "_") if events else "batch"


def _failed(ev: Event, bad_request: str = "invalid_prompt") -> None:
    """A job's error event as the line's error (``bad_request``: the code of the job's refusal)."""
    if isinstance(ev, ErrorEvent):
        code = bad_request if ev.code is ErrorCode.BAD_REQUEST else ev.code.value
        raise LineError(code, ev.message)
