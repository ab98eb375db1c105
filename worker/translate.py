"""The one place where wire types (api.schema) and engine types (engine.request) meet."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from api.schema import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    Event,
    FinishReason,
    GenerateRequest,
    StartEvent,
    Timings,
    Usage,
    token_event_json,
)
from engine.request import EngineRequest, RequestOutput, SamplingParams
from engine.request import FinishReason as EngineFinish

from .job import Job

__all__ = ["TokenLine", "Wire", "output_events", "to_engine_request"]

_ERROR_CODES = {c.value: c for c in ErrorCode}
_MAX_MESSAGE = 2000
_RETRYABLE = {ErrorCode.ENGINE_ERROR, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT}


def to_engine_request(req: GenerateRequest, tokens: list[int], deadline: float | None) -> EngineRequest:
    """A validated wire request and its prompt tokens, as the engine takes them."""
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        stop=tuple(req.stop),
    )
    return EngineRequest(req.id, tokens, params, arrival=time.monotonic(), deadline=deadline)


@dataclass(slots=True)
class TokenLine:
    """A token event as its wire fields: what the worker publishes once per job per step it sends, so it
    skips building a pydantic ``TokenEvent``; :meth:`model_dump_json` renders exactly that event's JSON."""

    id: str
    seq: int
    text: str
    token_ids: list[int]
    index: int
    type: Literal["token"] = "token"

    def model_dump_json(self) -> str:
        return token_event_json(self.id, self.seq, self.text, self.token_ids, self.index)


Wire = Event | TokenLine  # what the publisher writes


def output_events(out: RequestOutput, job: Job, worker: str) -> list[Wire]:
    """The events one engine output means for its job (start, token, terminal), numbered in order."""
    has_tokens = bool(out.token_ids or out.text)
    job.mark(out.started, has_tokens)
    events: list[Wire] = []
    if out.started:
        job.prompt_tokens = out.prompt_tokens
        events.append(
            StartEvent(
                id=job.rid, seq=job.next_seq(), model=job.model, worker=worker,
                prompt_tokens=out.prompt_tokens, attempt=job.attempt,
            )
        )
    if has_tokens:
        index = out.completion_tokens - len(out.token_ids)
        events.append(TokenLine(job.rid, job.next_seq(), out.text, out.token_ids, index))
    job.completion_tokens = max(job.completion_tokens, out.completion_tokens)
    if out.finish is not None:
        events.append(terminal_event(out, job))
    return events


def terminal_event(out: RequestOutput, job: Job) -> Event:
    if out.finish is EngineFinish.ERROR:
        code = _ERROR_CODES.get(out.error_code or "", ErrorCode.INTERNAL)
        return error_event(job, code, out.error_message or code.value)
    assert out.finish is not None
    return DoneEvent(
        id=job.rid,
        seq=job.next_seq(),
        finish_reason=FinishReason(out.finish.value),
        usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens),
        timings=timings(job),
    )


def error_event(job: Job, code: ErrorCode, message: str) -> ErrorEvent:
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "..."
    return ErrorEvent(id=job.rid, seq=job.next_seq(), code=code, message=message, retryable=code in _RETRYABLE)


def timings(job: Job) -> Timings:
    now = time.time()
    ms = lambda t: max(0.0, (t - job.enqueue_time) * 1000.0)  # noqa: E731
    decode_s = now - job.first_token_at if job.first_token_at else 0.0
    tps = (job.completion_tokens - 1) / decode_s if decode_s > 0 and job.completion_tokens > 1 else None
    return Timings(
        queue_ms=ms(job.admitted_at or now),
        ttft_ms=ms(job.first_token_at) if job.first_token_at else None,
        total_ms=ms(now),
        tokens_per_s=tps,
    )
