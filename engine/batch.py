"""The one file that touches mlx-lm's ``BatchGenerator`` (its API moves between minors; mlx-lm is pinned).

``MLXBatch`` exposes the small surface the scheduler needs: insert a prompt, remove sequences, run one
step. Every method must be called on the model's MLX thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from .request import ImageInputs

__all__ = ["BatchBackend", "BatchToken", "GeneratedToken", "MLXBatch"]


class GeneratedToken(Protocol):
    """One generated token as a step reports it: mlx-lm's own response object, read as it is (copying it
    cost a record per token on the engine thread). ``finish_reason`` is "stop" (an EOS token: not part of
    the text), "length", or None."""

    @property
    def uid(self) -> int: ...
    @property
    def token(self) -> int: ...
    @property
    def finish_reason(self) -> str | None: ...


@dataclass(slots=True)
class BatchToken:
    """A :class:`GeneratedToken` of a backend's own making (fakes in tests)."""

    uid: int
    token: int
    finish_reason: str | None


class BatchBackend(Protocol):
    """What the scheduler needs from a continuous batch (real: :class:`MLXBatch`, ``engine.vlm.VLMBatch``;
    tests: a fake). ``images`` is passed only with an image request: a backend without images may omit it."""

    def insert(
        self,
        prompt: list[int],
        max_tokens: int,
        sampler: Callable[[Any], Any] | None,
        logits_processors: list[Any],
        *,
        images: ImageInputs | None = None,
    ) -> int: ...

    def remove(self, uids: Iterable[int]) -> None: ...

    def step(self) -> Sequence[GeneratedToken]: ...

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
        *,
        images: ImageInputs | None = None,
    ) -> int:
        if images is not None:  # the worker rejects these first; a ValueError fails only this request
            raise ValueError("this model does not accept images")
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

    def step(self) -> Sequence[GeneratedToken]:
        _, generated = self._gen.next()
        return generated  # type: ignore[no-any-return]

    def close(self) -> None:
        self._gen.close()
