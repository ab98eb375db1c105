"""Per-request samplers and logits processors, built from mlx-lm's sample_utils.

Greedy requests get ``None`` so BatchGenerator samples them in one batched argmax. A seeded request
gets its own PRNG key, split every step, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from .request import SamplingParams

__all__ = ["make_request_logits_processors", "make_request_sampler"]

Sampler = Callable[[mx.array], mx.array]


def make_request_sampler(params: SamplingParams) -> Sampler | None:
    """``None`` for greedy (BatchGenerator's shared argmax), else a sampler for this request alone."""
    if params.greedy:
        return None
    if params.seed is None:
        return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    return _seeded_sampler(params)


def _seeded_sampler(params: SamplingParams) -> Sampler:
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    key = [mx.random.key(params.seed or 0)]
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


def make_request_logits_processors(params: SamplingParams) -> list[Any]:
    """Repetition, presence and frequency penalties (mlx-lm's processors); empty when none is asked for."""
    repetition = params.repetition_penalty if params.repetition_penalty not in (None, 1.0) else None
    presence = params.presence_penalty or None
    frequency = params.frequency_penalty or None
    if repetition is None and presence is None and frequency is None:
        return []
    return list(make_logits_processors(repetition_penalty=repetition, presence_penalty=presence,
                                       frequency_penalty=frequency))
