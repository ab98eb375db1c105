"""An embedding job's answer: its vectors (:class:`Embeddings`), and its inputs as the wire takes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .schema import DoneEvent, FinishReason, Timings, Usage, decode_vector
from .tenants import DEFAULT_TENANT

__all__ = ["Embeddings", "embedding_inputs", "embeddings_of"]


@dataclass(frozen=True, slots=True)
class Embeddings:
    """A finished embedding job: one vector per input, in the inputs' order (each L2-normalised, cut to the
    request's ``dimensions`` if it gave them); ``usage.prompt_tokens``: its inputs' tokens. A job cancelled before
    its end (``finish_reason`` cancelled) has no vectors."""

    id: str
    vectors: list[list[float]]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    tenant: str = DEFAULT_TENANT


def embedding_inputs(given: Any) -> Any:
    """An embedding job's ``input`` as the wire takes it: a list of texts or of token-id lists."""
    if isinstance(given, str):
        return [given]
    if isinstance(given, list) and given and all(isinstance(x, int) for x in given):
        return [given]
    return given


def embeddings_of(rid: str, done: DoneEvent) -> Embeddings:
    """A finished job's :class:`Embeddings`, from its done event."""
    vectors = [decode_vector(v) for v in done.embeddings or ()]
    return Embeddings(rid, vectors, done.finish_reason, done.usage, done.timings, done.tenant or DEFAULT_TENANT)
