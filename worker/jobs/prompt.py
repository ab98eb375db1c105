"""A job's prompt as its model's tokens: its messages (and tools) through the model's chat template, tokenized
and checked against the worker's and the model's limits; where its output starts (inside reasoning or not); and
the tokens its answer may take after it. A prompt with images comes tokenized by the model's processor
(worker/jobs/media.py) and passes through.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxq.api.schema import GenerateRequest
from mlxq.engine.core.prompt import EncodedPrompt, encode_prompt_with_boundary

if TYPE_CHECKING:
    from mlxq.engine.core.request import ImageInputs

    from .media import ImagePrompt
    from .model import ModelView

__all__ = ["Prompt", "PromptError", "encode", "template_messages", "template_tools", "tokenize"]

_INLINE_TOKENIZE_CHARS = 16_384  # longer prompts are tokenized off the event loop
_THINK_TAIL = 32  # prompt tokens looked at for an opened think block


class PromptError(Exception):
    """The prompt cannot run on the model as sent (its template or tokenizer fails, or it is too long)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A job's prompt ready for the engine: its tokens (the first ``cache_boundary`` of them its system prompt), its
    images' inputs, the tools its chat template was shown, the model's think markers when its reasoning is to be
    split from its answer (``inside``: the prompt leaves the output inside reasoning), and ``max_tokens``, the
    request's own or what fits after the prompt where it asks for that (``fit_max_tokens``)."""

    tokens: list[int]
    max_tokens: int
    cache_boundary: int = 0
    images: ImageInputs | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    think: tuple[str, str] | None = None
    inside: bool = False


async def tokenize(req: GenerateRequest, chars: int, model: ModelView, images: ImagePrompt | None) -> Prompt:
    """The prompt of a request of ``chars`` characters (its images' prompt, if it has one): a long one tokenized
    off the event loop, which keeps serving events; :class:`PromptError` if it cannot run."""
    if images is not None:
        return Prompt(images.tokens, _fitted(req, len(images.tokens), model), images=images.images)
    if chars < _INLINE_TOKENIZE_CHARS:
        encoded = encode(req, model, inline=True)
    else:
        encoded = await asyncio.to_thread(encode, req, model, False)
    tokens = encoded.tokens
    think, inside = _think(req, model.tokenizer, tokens)
    return Prompt(tokens, _fitted(req, len(tokens), model), encoded.cache_boundary,
                  tools=template_tools(req) if req.calls_tools else [], think=think, inside=inside)


def encode(req: GenerateRequest, model: ModelView, inline: bool) -> EncodedPrompt:
    """The prompt's tokens and its system-prompt boundary (where the engine caches a prefix). Inline: without
    releasing the GIL (see ``PromptEncoder``); else through transformers, which releases it while a long prompt
    encodes."""
    messages = template_messages(req) if req.messages is not None else None
    template: dict[str, Any] = {} if req.enable_thinking is None else {"enable_thinking": req.enable_thinking}
    if req.calls_tools:
        template["tools"] = template_tools(req)
    try:
        if inline:
            encoded = model.prompts.encode_with_boundary(req.prompt, messages, **template)
        else:
            encoded = encode_prompt_with_boundary(model.tokenizer, req.prompt, messages, **template)
    except Exception as exc:  # a template or tokenizer error is the request's fault
        raise PromptError(f"could not tokenize the prompt: {exc}") from None
    tokens = encoded.tokens
    ctx, most = model.context_length, model.config.max_prompt_tokens
    limit = min(most, ctx or most)
    if not tokens:
        raise PromptError("the prompt is empty after tokenization")
    if len(tokens) > limit:
        raise PromptError(f"prompt has {len(tokens)} tokens; the limit is {limit} (by {len(tokens) - limit})")
    wanted = 1 if req.fit_max_tokens else req.max_tokens  # fitted: at least one token (see _fitted)
    if ctx is not None and len(tokens) + wanted > ctx:
        over = len(tokens) + wanted - ctx
        raise PromptError(f"prompt ({len(tokens)} tokens) + max_tokens ({wanted}) exceeds the context "
                          f"({ctx}) by {over} tokens")
    return encoded


def _think(req: GenerateRequest, tokenizer: Any, tokens: list[int]) -> tuple[tuple[str, str] | None, bool]:
    """The model's think markers when the request wants reasoning apart (None: one text), and whether its prompt
    leaves the output inside reasoning (a template that opens it)."""
    if req.reasoning != "split" or not getattr(tokenizer, "has_thinking", False):
        return None, False
    tail = len(tokens) - _THINK_TAIL  # a template that opens reasoning does so in its generation prompt
    opened = tokenizer.rfind_think_start(tokens, start=tail)
    inside = opened >= 0 and opened > tokenizer.rfind_think_end(tokens, start=tail)
    return (tokenizer.think_start, tokenizer.think_end), inside


def _fitted(req: GenerateRequest, prompt_tokens: int, model: ModelView) -> int:
    """The request's max_tokens, lowered to what fits where it asks for that (``fit_max_tokens``): this worker's
    MLXQ_MAX_TOKENS and the model's context after the prompt's ``prompt_tokens``."""
    if not req.fit_max_tokens:
        return req.max_tokens
    most = min(req.max_tokens, model.config.max_tokens_limit)
    if model.context_length is not None:
        most = min(most, model.context_length - prompt_tokens)
    return most


def template_tools(req: GenerateRequest) -> list[dict[str, Any]]:
    """The request's tools as chat templates take them (OpenAI's shape)."""
    return [t.model_dump(exclude_none=True) for t in req.tools or []]


def template_messages(req: GenerateRequest) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them: text content, and an assistant turn's calls with
    their arguments as objects (what templates render with ``tojson``), as mlx-lm's server passes them."""
    out: list[dict[str, Any]] = []
    for m in req.messages or []:
        message: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                      "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
