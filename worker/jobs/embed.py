"""An embedding job's inputs as its model's token lists, checked against the model's and the worker's limits.

A text is tokenized as the model's tokenizer does with its special tokens: a Qwen3-Embedding tokenizer appends
``<|endoftext|>``, the token whose state is pooled (its intended pooling token). Token-id lists are embedded as
given. A refusal names the field it is about (``input[2]: ...``, ``dimensions: ...``): the gateway answers it with
OpenAI's ``param``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from mlxq.api.schema import GenerateRequest

if TYPE_CHECKING:
    from .model import ModelView

__all__ = ["EmbedError", "embedding_inputs"]

_INLINE_TOKENIZE_CHARS = 16_384  # longer inputs are tokenized off the event loop


class EmbedError(Exception):
    """The job's inputs cannot be embedded by the model as sent."""


async def embedding_inputs(req: GenerateRequest, model: ModelView) -> list[list[int]]:
    """Each of ``req.input`` as the model's tokens, every one within the model's limits; :class:`EmbedError`
    naming the field if one is not."""
    assert req.input is not None and model.embedding_width is not None
    if req.dimensions is not None and req.dimensions > model.embedding_width:
        raise EmbedError(f"dimensions: {req.dimensions} is more than model {model.name!r}'s "
                         f"{model.embedding_width}")
    texts = [x for x in req.input if isinstance(x, str)]
    if not texts:
        rows = [list(x) for x in req.input if not isinstance(x, str)]
        _check_ids(rows, model)
    elif sum(len(t) for t in texts) < _INLINE_TOKENIZE_CHARS:
        rows = _encode(texts, model)
    else:
        rows = await asyncio.to_thread(_encode, texts, model)
    _check_lengths(rows, model)
    return rows


def _encode(texts: list[str], model: ModelView) -> list[list[int]]:
    try:
        ids = model.tokenizer._tokenizer(texts, add_special_tokens=True)["input_ids"]
    except Exception as exc:  # a tokenizer error is the input's fault
        raise EmbedError(f"input: could not tokenize it: {exc}") from None
    return [list(row) for row in ids]


def _check_ids(rows: list[list[int]], model: ModelView) -> None:
    vocab = len(model.tokenizer._tokenizer)
    for i, row in enumerate(rows):
        bad = next((t for t in row if t >= vocab), None)
        if bad is not None:
            raise EmbedError(f"input[{i}]: token id {bad} is not in model {model.name!r}'s vocabulary of {vocab}")


def _check_lengths(rows: list[list[int]], model: ModelView) -> None:
    limits = [n for n in (model.context_length, model.config.max_prompt_tokens) if n]
    most = min(limits)
    for i, row in enumerate(rows):
        if not row:
            raise EmbedError(f"input[{i}]: it is empty")
        if len(row) > most:
            raise EmbedError(f"input[{i}]: {len(row)} tokens; model {model.name!r} takes at most {most} per input")
