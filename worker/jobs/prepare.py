"""A claimed job made ready for its model's engine, in one pipeline (:func:`prepare`): its request validated
against the worker's and the model's limits, its images read, checked and processed (worker/jobs/media.py), its
prompt tokenized (worker/jobs/prompt.py), its tools' markers and parser and its output's format
(worker/jobs/toolcalls.py), that format compiled for the model, and the whole translated into the engine's request
(worker/jobs/translate.py); an embedding job (``input``) only has its inputs tokenized and checked
(worker/jobs/embed.py). Each stage takes what the last one made; what they need of the model comes in a
:class:`~.model.ModelView`, so nothing here calls back into the model's service. A job that can never run as sent
raises :class:`BadRequest`, whichever stage refused it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mlxq.api.errors import describe
from mlxq.api.protocol.jobrecord import Envelope
from mlxq.api.schema import GenerateRequest
from mlxq.engine.core.request import EngineRequest
from mlxq.engine.mlx.constrain import GrammarError

from . import media
from .embed import EmbedError, embedding_inputs
from .media import ImageError
from .model import ModelView
from .prompt import PromptError, tokenize
from .toolcalls import CallGrammarError, ToolCalls, tools_of
from .translate import to_embedding_request, to_engine_request

__all__ = ["BadRequest", "Prepared", "prepare", "validate"]


class BadRequest(Exception):
    """The job can never succeed as sent; becomes an ``error(bad_request)`` event."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claimed job ready for its model's engine: the engine's request, the parser of its tool calls (None: the
    request gives no tools, or the model has no tool-call format), and each token's text for its log-probabilities
    (None: it asked for none)."""

    request: EngineRequest
    tools: ToolCalls | None = None
    token_text: Callable[[int], str] | None = None


async def prepare(envelope: Envelope, job_id: str, model: ModelView, weights: Mapping[str, float]) -> Prepared:
    """A claimed job made ready for ``model``'s engine, the long parts off the event loop, which keeps serving
    events; its tenant's weight from ``weights`` (1 if it has none); :class:`BadRequest` if it can never run as
    sent."""
    if envelope.problem:
        raise BadRequest(envelope.problem)
    req = validate(envelope.payload, job_id, model)
    if req.embeds:
        return await _prepare_embedding(req, model, envelope.enqueue_ms, weights)
    chars = _check_prompt(req, model)
    try:
        images = await media.prepare(req, model)
        prompt = await tokenize(req, chars, model, images)
        tools = tools_of(req, prompt, model.tokenizer)
        grammar = await model.formats.compile(tools.format) if tools.format is not None else None
    except CallGrammarError as exc:
        raise BadRequest(f"model {model.name!r}: {exc}") from None
    except (ImageError, PromptError, GrammarError) as exc:
        raise BadRequest(str(exc)) from None
    deadline = time.monotonic() + model.config.job_timeout_s
    request = to_engine_request(req, prompt, deadline, format=grammar, tool_markers=tools.markers,
                                enqueue_ms=envelope.enqueue_ms, weight=weights.get(req.tenant, 1.0))
    return Prepared(request, tools.calls, model.token_text if req.logprobs is not None else None)


async def _prepare_embedding(req: GenerateRequest, model: ModelView, enqueue_ms: int,
                             weights: Mapping[str, float]) -> Prepared:
    """An embedding job: its inputs tokenized and checked (worker/jobs/embed.py)."""
    chars = sum(len(x) for x in req.input or () if isinstance(x, str))
    if chars > model.config.max_payload_bytes:
        raise BadRequest(f"input: {chars} characters; the limit is {model.config.max_payload_bytes}")
    try:
        inputs = await embedding_inputs(req, model)
    except EmbedError as exc:
        raise BadRequest(str(exc)) from None
    deadline = time.monotonic() + model.config.job_timeout_s
    return Prepared(to_embedding_request(req, inputs, deadline, enqueue_ms=enqueue_ms,
                                         weight=weights.get(req.tenant, 1.0)))


def validate(payload: Any, job_id: str, model: ModelView) -> GenerateRequest:
    """The request a job carries, if ``model`` can ever serve it; else :class:`BadRequest`."""
    try:
        req = GenerateRequest.model_validate(payload)
    except ValidationError as exc:
        raise BadRequest("invalid request: " + describe(exc)) from None
    cfg = model.config
    if len(req.stop) > cfg.max_stop_strings or any(len(s) > cfg.max_stop_chars for s in req.stop):
        raise BadRequest(f"at most {cfg.max_stop_strings} stop strings of at most {cfg.max_stop_chars} chars")
    if req.id != job_id:
        raise BadRequest(f"request id {req.id!r} does not match job id {job_id!r}")
    if req.model not in (model.name, model.path):
        raise BadRequest(f"unknown model {req.model!r}: this queue serves {model.name!r}")
    if req.embeds != model.embeds:
        raise BadRequest(_kind_mismatch(req, model))
    if req.max_tokens > cfg.max_tokens_limit and not req.fit_max_tokens:
        raise BadRequest(f"max_tokens {req.max_tokens} exceeds this worker's limit {cfg.max_tokens_limit}")
    return req


def _kind_mismatch(req: GenerateRequest, model: ModelView) -> str:
    if model.embeds:
        return (f"model {model.name!r} is an embedding model: it takes embedding jobs (input, "
                "/v1/embeddings), not prompts or messages")
    return f"model {model.name!r} generates text: it does not make embeddings (input); use an embedding model"


def _check_prompt(req: GenerateRequest, model: ModelView) -> int:
    """The prompt's characters (within the limit, before anything tokenizes them); a vision-language model
    refuses what its batch cannot do."""
    chars = len(req.prompt or "") + sum(len(m.text) for m in req.messages or [])
    limit = model.config.max_payload_bytes
    if chars > limit:
        raise BadRequest(f"the prompt has {chars} characters; the limit is {limit}")
    if model.accepts_images:  # mlx-vlm's batch takes none of these
        formatted = req.response_format is not None and req.response_format.type != "text"
        for asked, what in ((req.logprobs is not None, "logprobs are"), (req.calls_tools, "tools are"),
                            (formatted, "response_format is")):
            if asked:
                raise BadRequest(f"{what} not supported by the vision-language model {model.name!r}")
    return chars
