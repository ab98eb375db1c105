"""Log-probabilities through the scheduler and mlx-lm's batch: each generated token's, and the top alternatives,
equal what mlx-lm's own single-request generator samples from."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlxq.engine.core.request import EngineRequest, SamplingParams
from tests.engine.fakes import Run
from tests.engine.test_engine_batch import drive, lm, make, stream, words  # noqa: F401  (fixtures)

pytestmark = pytest.mark.unit


def reference(model: Any, prompt: list[int], n: int) -> list[tuple[int, list[float]]]:
    """mlx-lm's greedy tokens and the log-probabilities each was sampled from."""
    return [(int(tok), lp.reshape(-1).tolist()) for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_logprobs_are_mlx_lms_for_the_greedy_tokens(lm: Any, stream: mx.Stream) -> None:  # noqa: F811
    model, tokenizer = lm
    s, run = make(lm, stream, capacity=4), Run()
    prompts = {f"r{i}": words(tokenizer, 5 + 3 * i, seed=i) for i in range(3)}
    for rid, prompt in prompts.items():
        s.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=10, logprobs=5)))
    s.add(EngineRequest("none", words(tokenizer, 7), SamplingParams(max_tokens=10)))  # asks for none
    drive(s, run, stream)
    assert all(not o.logprobs for o in run.outputs["none"])
    for rid, prompt in prompts.items():
        got = [lp for o in run.outputs[rid] for lp in o.logprobs]
        want = reference(model, prompt, 10)
        assert [g.token for g in got] == run.tokens(rid) == [t for t, _ in want]
        for g, (token, vector) in zip(got, want):
            assert abs(g.logprob - vector[token]) < 1e-3
            best = sorted(range(len(vector)), key=lambda i: -vector[i])[:5]
            assert len(g.top) == 5 and g.top[0][0] == token  # greedy: the most likely
            assert [round(v, 3) for _, v in g.top] == [round(vector[i], 3) for i in best]


def test_a_request_started_at_once_has_its_first_tokens_logprob_too(lm: Any, stream: mx.Stream) -> None:  # noqa: F811
    model, tokenizer = lm
    s, run = make(lm, stream, capacity=1), Run()
    s.add(EngineRequest("low", words(tokenizer, 6), SamplingParams(max_tokens=40)))
    drive(s, run, stream, until=lambda: len(run.tokens("low")) >= 3)
    prompt = words(tokenizer, 9, seed=2)
    s.add(EngineRequest("vip", prompt, SamplingParams(max_tokens=6, logprobs=0), priority=5))
    drive(s, run, stream)
    assert s.stats.started_at_once == 1
    got = [lp for o in run.outputs["vip"] for lp in o.logprobs]
    want = reference(model, prompt, 6)
    assert [g.token for g in got] == [t for t, _ in want] and all(g.top == () for g in got)
    assert all(abs(g.logprob - vector[t]) < 1e-3 for g, (t, vector) in zip(got, want))
