"""The one file that touches mlx-lm's ``BatchGenerator`` (its API moves between minors; mlx-lm is pinned).

``MLXBatch`` exposes the small surface the scheduler needs: insert a prompt, remove sequences, run one
step. Every method must be called on the model's MLX thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

__all__ = ["BatchBackend", "BatchToken", "MLXBatch"]


@dataclass(slots=True)  # not frozen: a frozen init costs ~3x, and one is made per token
class BatchToken:
    """One generated token. ``finish`` is "stop" (an EOS token: not part of the text) or "length"."""

    uid: int
    token: int
    finish: str | None


class BatchBackend(Protocol):
    """What the scheduler needs from a continuous batch (real: :class:`MLXBatch`; tests: a fake)."""

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
    ) -> int: ...

    def remove(self, uids: Iterable[int]) -> None: ...

    def step(self) -> list[BatchToken]: ...

    def close(self) -> None: ...


class MLXBatch:
    """mlx-lm's BatchGenerator behind :class:`BatchBackend`.

    A step runs one decode step for the generating sequences plus one chunk (``prefill_step_size``
    tokens) of prefill for the sequences being prompted, so a long prompt spans several steps and can be
    cancelled between them.
    """

    def __init__(
        self,
        model: Any,
        eos_token_ids: Iterable[int],
        *,
        capacity: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        stream: mx.Stream,
    ) -> None:
        self._stops = StopSequences([(t,) for t in sorted(eos_token_ids)])
        self._gen = BatchGenerator(
            model,
            completion_batch_size=capacity,
            prefill_batch_size=min(prefill_batch_size, capacity),
            prefill_step_size=prefill_step_size,
            stream=stream,
        )

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
    ) -> int:
        (uid,) = self._gen.insert(
            [prompt],
            max_tokens=[max_tokens],
            samplers=[sampler],  # type: ignore[list-item]  # None means the shared greedy sampler
            logits_processors=[logits_processors],
            stop_sequences=[self._stops],
        )
        return int(uid)

    def remove(self, uids: Iterable[int]) -> None:
        self._gen.remove(list(uids))

    def step(self) -> list[BatchToken]:
        _, generated = self._gen.next()
        return [BatchToken(r.uid, r.token, r.finish_reason) for r in generated]

    def close(self) -> None:
        self._gen.close()
