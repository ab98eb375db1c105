"""Per-request samplers and logits processors, built from mlx-lm's sample_utils.

Greedy requests get ``None`` so BatchGenerator samples them in one batched argmax. A seeded request
gets its own PRNG key, split every step, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ..core.request import SamplingParams

__all__ = ["RowSampler", "make_request_logits_processors", "make_request_sampler"]

Sampler = Callable[[mx.array], mx.array]


def make_request_sampler(params: SamplingParams) -> Sampler | None:
    """``None`` for greedy (BatchGenerator's shared argmax), else a sampler for this request alone."""
    if params.greedy:
        return None
    return RowSampler(params)


class RowSampler:
    """A request's sampler: mlx-lm's filters (top-p, min-p, top-k, in mlx-lm's order) and temperature, drawing
    from its own PRNG key when seeded (else from MLX's global one, as mlx-lm's sampler does). Speculative
    decoding reads the distribution it draws from and draws from it with the same key."""

    def __init__(self, params: SamplingParams) -> None:
        self.filters: list[Callable[[mx.array], mx.array]] = []
        if 0.0 < params.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        if params.top_k > 0:  # as many as the vocabulary or more keeps them all (mlx-lm's filter raises there)
            self.filters.append(lambda x: apply_top_k(x, params.top_k) if params.top_k < x.shape[-1] else x)
        self.inv_temp = 1.0 / params.temperature
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.logits(logprobs), key=self.key())

    def logits(self, logprobs: mx.array) -> mx.array:
        """The unnormalised log-probabilities it draws from, in float32: scaled by 1/T in float16 (a model's
        logits often are), a temperature of 1e-5 overflowed every token to -inf and the draw was uniform; and
        top-p's running sum over the vocabulary keeps its precision."""
        logprobs = logprobs.astype(mx.float32)
        for f in self.filters:
            logprobs = f(logprobs)
        return logprobs * self.inv_temp

    @property
    def seeded(self) -> bool:
        return self._key is not None

    def key(self) -> mx.array | None:
        """The next PRNG key of a seeded request (None: MLX's global one)."""
        if self._key is None:
            return None
        self._key, sub = mx.random.split(self._key)
        return sub


def make_request_logits_processors(params: SamplingParams) -> list[Any]:
    """Repetition, presence and frequency penalties (mlx-lm's processors); empty when none is asked for."""
    repetition = params.repetition_penalty if params.repetition_penalty not in (None, 1.0) else None
    presence = params.presence_penalty or None
    frequency = params.frequency_penalty or None
    if repetition is None and presence is None and frequency is None:
        return []
    return list(make_logits_processors(repetition_penalty=repetition, presence_penalty=presence,
                                       frequency_penalty=frequency))
