"""How an engine speculates (the worker's setting): by a draft model or by prompt lookup, up to ``max_k`` tokens a
step. What speculates is ``engine/mlx/speculation/batch.py``; it imports no MLX itself."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["SpecKind", "Speculation"]


class SpecKind(enum.Enum):
    DRAFT = "draft"  # a smaller model with the target's vocabulary proposes
    NGRAM = "ngram"  # the row's own prompt and output propose (prompt lookup)


@dataclass(frozen=True, slots=True)
class Speculation:
    """How an engine speculates. ``draft``: the draft model's path (with :attr:`SpecKind.DRAFT`)."""

    kind: SpecKind
    draft: str | None = None
    max_k: int = 4  # the most tokens proposed per row and step
