"""The one place where wire types (api.schema) and engine types (engine.request) meet."""

from __future__ import annotations

import time

from api.schema import ErrorCode, FinishReason, GenerateRequest
from engine.request import EngineRequest, ImageInputs, RequestOutput, SamplingParams
from engine.request import FinishReason as EngineFinish

from .lifecycle import Run, Wire

__all__ = ["output_events", "to_engine_request"]

_ERROR_CODES = {c.value: c for c in ErrorCode}


def to_engine_request(
    req: GenerateRequest, tokens: list[int], deadline: float | None, *, cache_boundary: int = 0,
    images: ImageInputs | None = None, enqueue_ms: int = 0,
) -> EngineRequest:
    """A validated wire request and its prompt tokens (the first ``cache_boundary`` of them its system prompt:
    see engine/prompt.py; its images prepared: see worker/media.py), as the engine takes them. It arrived when
    it was enqueued (``enqueue_ms``, epoch ms; now if 0), so its priority ages in the engine from then, as it
    did in the queue."""
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=tuple(req.stop),
    )
    now = time.monotonic()
    arrival = now - max(0.0, time.time() - enqueue_ms / 1000) if enqueue_ms else now
    return EngineRequest(req.id, tokens, params, arrival=arrival, deadline=deadline, priority=req.priority,
                         cache_boundary=cache_boundary, images=images)


def output_events(out: RequestOutput, run: Run, worker: str) -> list[Wire]:
    """The events one engine output means for its run (start, token, terminal), in order."""
    events: list[Wire] = []
    if out.started:
        events.append(run.start(out.prompt_tokens, worker))
    if out.token_ids or out.text:
        events.append(run.tokens(out.text, out.token_ids, out.completion_tokens))
    run.completion_tokens = max(run.completion_tokens, out.completion_tokens)
    if out.finish is EngineFinish.ERROR:
        code = _ERROR_CODES.get(out.error_code or "", ErrorCode.INTERNAL)
        events.append(run.error(code, out.error_message or code.value))
    elif out.finish is not None:
        done = run.done(FinishReason(out.finish.value))
        if out.stop_sequence is not None:
            done = done.model_copy(update={"stop_sequence": out.stop_sequence})
        events.append(done)
    return events
