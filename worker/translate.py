"""The one place where wire types (api.schema) and engine types (engine.request) meet."""

from __future__ import annotations

import time

from api.schema import ErrorCode, FinishReason, GenerateRequest
from engine.request import EngineRequest, RequestOutput, SamplingParams
from engine.request import FinishReason as EngineFinish

from .lifecycle import Run, Wire

__all__ = ["output_events", "to_engine_request"]

_ERROR_CODES = {c.value: c for c in ErrorCode}


def to_engine_request(
    req: GenerateRequest, tokens: list[int], deadline: float | None, *, cache_boundary: int = 0
) -> EngineRequest:
    """A validated wire request and its prompt tokens (the first ``cache_boundary`` of them its system
    prompt: see engine/prompt.py), as the engine takes them."""
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
    return EngineRequest(req.id, tokens, params, arrival=time.monotonic(), deadline=deadline,
                         cache_boundary=cache_boundary)


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
        events.append(run.done(FinishReason(out.finish.value)))
    return events
