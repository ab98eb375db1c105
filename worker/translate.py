"""The one place where wire types (api.schema) and engine types (engine.request) meet."""

from __future__ import annotations

import time
from collections.abc import Callable

from mlxq.api.schema import (
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GrammarFormat,
    JSONObjectFormat,
    JSONSchemaFormat,
    RegexFormat,
    TokenLogprob,
    TopLogprob,
)
from mlxq.engine.core.parts import PartMarkers
from mlxq.engine.core.request import EngineRequest, Format, ImageInputs, RequestOutput, SamplingParams
from mlxq.engine.core.request import ErrorCode as EngineError
from mlxq.engine.core.request import FinishReason as EngineFinish
from mlxq.engine.mlx.constrain import FormatKind, ResponseFormat

from .jobs.run import Run, Wire

__all__ = ["output_events", "to_engine_format", "to_engine_request"]

_ERROR_CODES = {
    EngineError.BAD_REQUEST: ErrorCode.BAD_REQUEST,
    EngineError.TIMEOUT: ErrorCode.TIMEOUT,
    EngineError.ENGINE_ERROR: ErrorCode.ENGINE_ERROR,
}


def to_engine_request(
    req: GenerateRequest, tokens: list[int], deadline: float | None, *, cache_boundary: int = 0,
    images: ImageInputs | None = None, format: Format | None = None, parts: PartMarkers | None = None,
    enqueue_ms: int = 0, weight: float = 1.0,
) -> EngineRequest:
    """A validated wire request and its prompt tokens (the first ``cache_boundary`` of them its system prompt:
    see engine/prompt.py; its images prepared: see worker/media.py), as the engine takes them. It arrived when
    it was enqueued (``enqueue_ms``, epoch ms; now if 0), so its priority ages in the engine from then, as it
    did in the queue. Its tenant is its engine group, of ``weight`` (the tenant's): tenants share the batch by
    weight (engine/shares.py)."""
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
        logprobs=req.logprobs,
    )
    now = time.monotonic()
    arrival = now - max(0.0, time.time() - enqueue_ms / 1000) if enqueue_ms else now
    return EngineRequest(req.id, tokens, params, arrival=arrival, deadline=deadline, priority=req.priority,
                         cache_boundary=cache_boundary, images=images, format=format, parts=parts, group=req.tenant,
                         weight=weight)


def to_engine_format(req: GenerateRequest) -> ResponseFormat | None:
    """What the request's output must match, as the engine compiles it; None for free text."""
    fmt = req.response_format
    if isinstance(fmt, JSONSchemaFormat):
        return ResponseFormat(FormatKind.JSON_SCHEMA, fmt.schema_text)
    if isinstance(fmt, JSONObjectFormat):
        return ResponseFormat(FormatKind.JSON_OBJECT)
    if isinstance(fmt, RegexFormat):
        return ResponseFormat(FormatKind.REGEX, fmt.regex)
    if isinstance(fmt, GrammarFormat):
        return ResponseFormat(FormatKind.LARK, fmt.grammar)
    return None


def output_events(out: RequestOutput, run: Run, worker: str) -> list[Wire]:
    """The events one engine output means for its run (start, token, terminal), in order, as its run builds
    them; only the run table calls this, for a run it holds."""
    if (out.finish is None and not out.started and not out.reasoning and not out.calls and not out.logprobs
            and run.token_text is None and (out.token_ids or out.text)):  # a plain step's tokens: N per step
        return [run.tokens(out.text, out.token_ids, out.completion_tokens)]
    events: list[Wire] = []
    if out.started:
        events.append(run.start(out.prompt_tokens, worker, out.started_at))
    if out.token_ids or out.text or out.reasoning or out.calls:
        logprobs = _logprobs(out, run.token_text) if run.token_text is not None else None
        text, calls = out.text, None
        if out.calls and run.tools is not None:
            calls, unparsed = run.tools.take(out.calls)
            text += unparsed
        events.append(run.tokens(text, out.token_ids, out.completion_tokens, out.reasoning, logprobs, calls or None))
    if out.finish is EngineFinish.ERROR:
        code = _ERROR_CODES[out.error_code] if out.error_code is not None else ErrorCode.INTERNAL
        events.append(run.error(code, out.error_message or code.value))
    elif out.finish is not None:
        events.append(run.done(FinishReason(out.finish.value), generated=out.completion_tokens,
                               stop_sequence=out.stop_sequence))
    return events


def _logprobs(out: RequestOutput, text: Callable[[int], str]) -> list[TokenLogprob]:
    return [TokenLogprob(token=lp.token, logprob=lp.logprob, text=text(lp.token),
                         top=[TopLogprob(token=t, logprob=v, text=text(t)) for t, v in lp.top]) for lp in out.logprobs]
