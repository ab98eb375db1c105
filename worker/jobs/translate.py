"""Where wire types (api.schema) and engine types (engine.request) meet: a prepared job's request as the engine
takes it, and an engine output as its run's events. (What a job's output must match is translated with its tools:
worker/jobs/toolcalls.py.)
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxq.api.schema import PRIORITY_MIN, ErrorCode, FinishReason, GenerateRequest, TokenLogprob, TopLogprob
from mlxq.engine.core.embedding import EmbeddingRequest
from mlxq.engine.core.parts import PartMarkers
from mlxq.engine.core.request import EngineRequest, Format, RequestOutput, SamplingParams
from mlxq.engine.core.request import ErrorCode as EngineError
from mlxq.engine.core.request import FinishReason as EngineFinish

from .run import Run, Wire

BULK_PRIORITY = PRIORITY_MIN - 1  # a bulk job's engine priority: below every interactive one, so any preempts it

if TYPE_CHECKING:
    from .prompt import Prompt

__all__ = ["output_events", "to_embedding_request", "to_engine_request"]

_ERROR_CODES = {
    EngineError.BAD_REQUEST: ErrorCode.BAD_REQUEST,
    EngineError.TIMEOUT: ErrorCode.TIMEOUT,
    EngineError.ENGINE_ERROR: ErrorCode.ENGINE_ERROR,
}


def to_engine_request(
    req: GenerateRequest, prompt: Prompt, deadline: float | None, *, format: Format | None = None,
    tool_markers: tuple[str, str] | None = None, enqueue_ms: int = 0, weight: float = 1.0,
) -> EngineRequest:
    """A validated wire request and its prompt (worker/jobs/prompt.py: its tokens, the first ``cache_boundary`` of
    them its system prompt, its images, its think markers and the max_tokens that fits after it), as the engine
    takes them; its text split by its think markers and the model's ``tool_markers``, if any. It arrived when it
    was enqueued (``enqueue_ms``, epoch ms; now if 0), so its priority ages in the engine from then, as it did in
    the queue. Its tenant is its engine group, of ``weight`` (the tenant's): tenants share the batch by weight
    (engine/core/shares.py). A bulk job (``req.bulk``) is of :data:`BULK_PRIORITY` in the engine, in its bulk band
    (aging never lifts it above an interactive one)."""
    params = SamplingParams(
        max_tokens=prompt.max_tokens,
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
    arrival = _arrival(enqueue_ms)
    split = prompt.think is not None or tool_markers is not None
    cut = tool_markers is not None and req.tool_choice != "auto"  # constrained to calls: a cut one's markup is no text
    parts = PartMarkers(prompt.think, tool_markers, prompt.inside, cut) if split else None
    priority = BULK_PRIORITY if req.bulk else req.priority
    return EngineRequest(req.id, prompt.tokens, params, arrival=arrival, deadline=deadline, priority=priority,
                         cache_boundary=prompt.cache_boundary, images=prompt.images, format=format, parts=parts,
                         group=req.tenant, weight=weight, bulk=req.bulk)


def to_embedding_request(req: GenerateRequest, inputs: list[list[int]], deadline: float | None, *,
                         enqueue_ms: int = 0, weight: float = 1.0) -> EmbeddingRequest:
    """A validated embedding job and its inputs' tokens (worker/jobs/embed.py), as the engine takes them."""
    return EmbeddingRequest(req.id, [], arrival=_arrival(enqueue_ms), deadline=deadline,
                            priority=BULK_PRIORITY if req.bulk else req.priority,
                            group=req.tenant, weight=weight, inputs=inputs, dimensions=req.dimensions, bulk=req.bulk)


def _arrival(enqueue_ms: int) -> float:
    """When a job was enqueued (epoch ms; 0: now), on the engine's clock (``time.monotonic()``)."""
    now = time.monotonic()
    return now - max(0.0, time.time() - enqueue_ms / 1000) if enqueue_ms else now


def output_events(out: RequestOutput, run: Run, worker: str) -> list[Wire]:
    """The events one engine output means for its run (start, token, terminal), in order, as its run builds
    them; only the run table calls this, for a run it holds."""
    if (out.finish is None and not out.started and not out.reasoning and not out.calls and not out.logprobs
            and run.token_text is None and (out.token_ids or out.text)):  # a plain step's tokens: N per step
        return [run.tokens(out.text, out.token_ids, out.completion_tokens)]
    events: list[Wire] = []
    if out.started:
        events.append(run.start(out.prompt_tokens, worker, out.started_at, out.cached_tokens))
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
        vectors = [base64.b64encode(v).decode() for v in out.embeddings] if out.embeddings is not None else None
        events.append(run.done(FinishReason(out.finish.value), generated=out.completion_tokens,
                               stop_sequence=out.stop_sequence, embeddings=vectors))
    return events


def _logprobs(out: RequestOutput, text: Callable[[int], str]) -> list[TokenLogprob]:
    return [TokenLogprob(token=lp.token, logprob=lp.logprob, text=text(lp.token),
                         top=[TopLogprob(token=t, logprob=v, text=text(t)) for t, v in lp.top]) for lp in out.logprobs]
