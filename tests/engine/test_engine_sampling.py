"""Per-request logits processors: the penalties a request asks for, and none when it asks for none."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.engine.core.request import SamplingParams
from mlxq.engine.mlx.sampling import RowSampler, make_request_logits_processors

pytestmark = pytest.mark.unit


def test_no_penalty_means_no_processor() -> None:
    assert make_request_logits_processors(SamplingParams()) == []
    assert make_request_logits_processors(SamplingParams(repetition_penalty=1.0)) == []


def test_each_penalty_asked_for_gets_mlx_lms_processor() -> None:
    both = make_request_logits_processors(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert len(both) == 2
    all_three = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    assert len(make_request_logits_processors(all_three)) == 3


def test_presence_and_frequency_penalties_lower_the_tokens_already_seen() -> None:
    context = mx.array([[3, 3, 5]])
    logits = mx.zeros((1, 8))
    (presence,) = make_request_logits_processors(SamplingParams(presence_penalty=0.5))
    (frequency,) = make_request_logits_processors(SamplingParams(frequency_penalty=0.25))
    for processor in (presence, frequency):
        out = processor(context, logits)[0].tolist()
        assert [i for i, v in enumerate(out) if v < 0] == [3, 5] and all(v <= 0 for v in out)
    by_frequency = frequency(context, logits)[0].tolist()
    assert by_frequency[3] < by_frequency[5]  # seen twice: penalized more


def test_a_top_k_as_large_as_the_vocabulary_keeps_every_token() -> None:
    logprobs = mx.log(mx.array([[0.1, 0.2, 0.3, 0.4]]))
    for top_k in (4, 50):  # mlx-lm's filter raises for these; the request means "no limit"
        sampler = RowSampler(SamplingParams(temperature=1.0, top_k=top_k, seed=1))
        assert mx.allclose(sampler.logits(logprobs), logprobs).item()
        assert 0 <= sampler(logprobs).item() < 4
    kept = RowSampler(SamplingParams(temperature=1.0, top_k=2, seed=1)).logits(logprobs)[0].tolist()
    assert [v > -float("inf") for v in kept] == [False, False, True, True]


def test_a_near_zero_temperature_draws_the_most_likely_token_in_half_precision_logits() -> None:
    """A model's logits are often float16: scaled by 1/T there, T = 1e-5 overflowed every token to -inf and
    the draws were uniform noise. Sampling scales in float32; below 1e-30 (where float32 would overflow too)
    the request samples greedily."""
    from mlxq.engine.mlx.sampling import make_request_sampler

    probs = [0.02] * 30 + [0.4]  # the last token is the most likely, log-probability -0.92
    logprobs = mx.log(mx.array([probs])).astype(mx.float16)
    for temperature in (1e-2, 1e-5, 1e-12, 1e-29):
        sampler = RowSampler(SamplingParams(temperature=temperature, seed=3))
        assert [sampler(logprobs).item() for _ in range(20)] == [30] * 20, temperature
    assert make_request_sampler(SamplingParams(temperature=1e-31)) is None  # greedy: the batch's argmax
    assert make_request_sampler(SamplingParams(temperature=5e-324)) is None
    assert make_request_sampler(SamplingParams(temperature=1e-29)) is not None
