"""MLXBatch's cache surface on the real tiny model, through the scheduler: a preempted sequence resumed from
its own cache, or recomputed, generates exactly the greedy tokens of an uninterrupted mlx-lm run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.engine.core.memory import KVBudget
from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.memory import measure_layout
from tests.engine.fakes import Run
from tests.engine.real import drive, still
from tests.support import reference, reference_text

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


@pytest.fixture(scope="module")
def stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


def make(lm: Any, stream: mx.Stream, capacity: int, *, caches: bool = True, prefill_step: int = 512,
         headroom: int | None = None) -> Scheduler:
    model, tokenizer = lm
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=capacity, prefill_batch_size=8,
                     prefill_step_size=prefill_step, stream=stream, caches=caches)
    memory = KVBudget(headroom, measure_layout(model)) if headroom is not None else None
    return Scheduler(batch, capacity=capacity, new_detokenizer=lambda: tokenizer.detokenizer, memory=memory,
                     clock=still)



def words(tokenizer: Any, n: int, seed: int = 0) -> list[int]:
    vocab = ["queue", "model", "token", "server", "batch", "the", "of", "cache"]
    return list(tokenizer.encode(" ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))))


@pytest.mark.parametrize("caches", [True, False], ids=["resume-from-cache", "recompute"])
def test_a_preempted_sequence_generates_what_an_uninterrupted_one_does(lm: Any, stream: mx.Stream,
                                                                        caches: bool) -> None:
    tokenizer = lm[1]
    s = make(lm, stream, capacity=2, caches=caches)
    run = Run()
    low = [words(tokenizer, 12, seed) for seed in (1, 2)]
    for i, p in enumerate(low):
        s.add(EngineRequest(f"low{i}", p, SamplingParams(max_tokens=60)))
    drive(s, run, stream, until=lambda: len(run.tokens("low1")) >= 20)
    high = words(tokenizer, 9, 5)
    s.add(EngineRequest("high", high, SamplingParams(max_tokens=25), priority=1))
    drive(s, run, stream)
    assert s.stats.preemptions == 1
    assert (s.stats.resumes, s.stats.recomputes) == ((1, 0) if caches else (0, 1))
    for rid, p, n in (("low0", low[0], 60), ("low1", low[1], 60), ("high", high, 25)):
        expected = reference(lm, p, n)
        assert run.tokens(rid) == expected, rid
        assert run.text(rid) == reference_text(lm, expected), rid  # the detokenizer carried on
        assert run.final(rid).completion_tokens == len(expected)
    assert run.started_order.count("low1") == 1


def test_a_sequence_preempted_mid_prefill_resumes_from_its_partial_cache(lm: Any, stream: mx.Stream) -> None:
    tokenizer = lm[1]
    s = make(lm, stream, capacity=1, prefill_step=32)
    run = Run()
    long = words(tokenizer, 150, 3)
    assert len(long) > 4 * 32
    s.add(EngineRequest("long", long, SamplingParams(max_tokens=20)))
    drive(s, run, stream, until=lambda: s.stats.kv_bytes > 0)  # prefilling, no token yet
    assert run.tokens("long") == []
    s.add(EngineRequest("urgent", words(tokenizer, 5, 1), SamplingParams(max_tokens=5), priority=2))
    drive(s, run, stream)
    assert (s.stats.preemptions, s.stats.resumes, s.stats.recomputes) == (1, 1, 0)
    assert run.tokens("long") == reference(lm, long, 20)


def test_priority_with_memory_pressure_on_the_real_model(lm: Any, stream: mx.Stream) -> None:
    model, tokenizer = lm
    layout = measure_layout(model)
    prompts = {f"bg{i}": words(tokenizer, 20, i) for i in range(2)}
    prompts["vip"] = words(tokenizer, 30, 7)
    longest = max(len(p) for p in prompts.values()) + 120
    headroom = 2 * layout.row_bytes(longest) + 1000  # two rows; not two and a parked cache
    s = make(lm, stream, capacity=8, headroom=headroom)
    run = Run()
    for rid in ("bg0", "bg1"):
        s.add(EngineRequest(rid, prompts[rid], SamplingParams(max_tokens=120)))
    drive(s, run, stream, until=lambda: len(run.tokens("bg1")) >= 10)
    s.add(EngineRequest("vip", prompts["vip"], SamplingParams(max_tokens=120), priority=1))
    peak = 0
    with mx.stream(stream):
        while s.has_work:
            run.step(s)
            peak = max(peak, s.stats.kv_bytes)
            assert s.stats.kv_reserved_bytes <= headroom
    # Holding the victim's cache would not leave room for the vip: it was dropped, and recomputed later.
    assert s.stats.preemptions == 1 and s.stats.recomputes == 1
    assert peak <= headroom and s.stats.kv_bytes_peak <= headroom
    for rid, p in prompts.items():
        assert run.tokens(rid) == reference(lm, p, 120), rid
        assert run.final(rid).finish is FinishReason.LENGTH
    assert s.stats.kv_bytes == 0  # everything released


def _sampling_scheduler(lm: Any, stream: mx.Stream, prefix: Any = None) -> Scheduler:
    from mlxq.engine.mlx.sampling import make_request_logits_processors, make_request_sampler

    model, tokenizer = lm
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=4, prefill_batch_size=8, prefill_step_size=16,
                     stream=stream)
    return Scheduler(batch, capacity=4, new_detokenizer=lambda: tokenizer.detokenizer, prefix_cache=prefix,
                     make_sampler=make_request_sampler, make_processors=make_request_logits_processors, clock=still)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=30),
                                    SamplingParams(max_tokens=30, temperature=0.9, seed=11, repetition_penalty=1.3,
                                                   presence_penalty=0.5)], ids=["greedy", "seeded-penalized"])
def test_a_request_started_at_once_generates_what_it_would_have_in_the_batch(lm: Any, stream: mx.Stream,
                                                                            params: SamplingParams) -> None:
    # It outranks the running one, so it is prefilled alone (in chunks: its prompt spans several) and its first
    # token sampled there; its tokens are the ones it gets joining the batch the usual way, which for greedy
    # decoding are mlx-lm's single-request tokens.
    tokenizer = lm[1]
    prompt = words(tokenizer, 40, 4)
    usual, urgent = Run(), Run()
    for run, priority in ((usual, 0), (urgent, 1)):
        s = _sampling_scheduler(lm, stream)
        s.add(EngineRequest("bg", words(tokenizer, 10, 2), SamplingParams(max_tokens=80)))
        drive(s, run, stream, until=lambda run=run: len(run.tokens("bg")) >= 5)
        s.add(EngineRequest("r", prompt, params, priority=priority))
        drive(s, run, stream)
        assert s.stats.started_at_once == priority
        assert run.tokens("bg") == reference(lm, words(tokenizer, 10, 2), 80)
    assert urgent.tokens("r") == usual.tokens("r") and len(urgent.tokens("r")) == 30
    assert urgent.text("r") == usual.text("r")
    if params.greedy:
        assert urgent.tokens("r") == reference(lm, prompt, 30)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.9,
                                                                                   seed=7)], ids=["greedy", "seeded"])
def test_requests_started_at_once_in_one_step_are_prefilled_together_each_as_it_would_be_alone(
        lm: Any, stream: mx.Stream, params: SamplingParams) -> None:
    # Ragged prompts (one spans three prefill chunks, one is two tokens) in one prompt batch: each one's tokens are
    # those it makes started at once alone (for greedy decoding, mlx-lm's single-request tokens).
    tokenizer = lm[1]
    prompts = [words(tokenizer, n, seed) for n, seed in ((40, 2), (5, 1), (2, 4))]
    together: dict[str, list[int]] = {}
    alone: dict[str, list[int]] = {}
    for tokens, batch in ((together, list(enumerate(prompts))), *((alone, [ip]) for ip in enumerate(prompts))):
        s, run = _sampling_scheduler(lm, stream), Run()
        s.add(EngineRequest("bg", words(tokenizer, 10, 2), SamplingParams(max_tokens=60)))
        drive(s, run, stream, until=lambda run=run: len(run.tokens("bg")) >= 3)
        for i, p in batch:
            s.add(EngineRequest(f"r{i}", p, params, priority=1))
        with mx.stream(stream):
            run.step(s)
        assert all(run.tokens(f"r{i}") for i, _ in batch)  # every first token out in one step
        drive(s, run, stream)
        assert s.stats.started_at_once == len(batch)
        tokens.update((f"r{i}", run.tokens(f"r{i}")) for i, _ in batch)
    for i, p in enumerate(prompts):
        assert together[f"r{i}"] == alone[f"r{i}"] and len(together[f"r{i}"]) == 20
        if params.greedy:
            assert together[f"r{i}"] == reference(lm, p, 20)


def test_a_request_started_at_once_starts_from_a_cached_prefix(lm: Any, stream: mx.Stream) -> None:
    from mlxq.engine.mlx.prefix.cache import PrefixCache

    tokenizer = lm[1]
    shared = words(tokenizer, 80, 1)
    first, second = shared + words(tokenizer, 6, 3), shared + words(tokenizer, 7, 5)
    s = _sampling_scheduler(lm, stream, PrefixCache(64 << 20))
    run = Run()
    s.add(EngineRequest("first", first, SamplingParams(max_tokens=4)))
    drive(s, run, stream)  # its finished sequence is cached
    s.add(EngineRequest("bg", words(tokenizer, 10, 2), SamplingParams(max_tokens=60)))
    drive(s, run, stream, until=lambda: len(run.tokens("bg")) >= 3)
    s.add(EngineRequest("second", second, SamplingParams(max_tokens=20), priority=5))
    drive(s, run, stream)
    assert s.stats.started_at_once == 1 and s.stats.prefix_hits >= 1 and s.stats.prefix_tokens_saved >= len(shared)
    assert run.tokens("second") == reference(lm, second, 20)
    (started,) = [o for o in run.outputs["second"] if o.started]
    assert started.cached_tokens >= len(shared)  # its usage reports what its start took from the prefix cache


def test_a_burst_streams_each_prefill_group_s_first_tokens_in_the_step_after_its_prefill(
        lm: Any, stream: mx.Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    # A burst of 24 prefilled 8 at a time: no step both decodes and prefills; a group joins the decode batch in
    # the step that prefilled it, so its first tokens come with the very next step (a decode step of every row
    # in), before the next group's prompt chunk: the first group's long before the last group is prefilled. No
    # decode pass is added to mlx-lm's own loop over the same burst, and every row makes exactly its greedy tokens.
    import importlib

    from mlx_lm.generate import BatchGenerator

    generation = importlib.import_module("mlx_lm.generate").GenerationBatch
    passes = [0]
    real_step = generation._step

    def counted(self: Any) -> Any:
        passes[0] += 1
        return real_step(self)

    monkeypatch.setattr(generation, "_step", counted)
    model, tokenizer = lm
    prompts = [words(tokenizer, 6 + i % 5, i) for i in range(24)]
    with mx.stream(stream):  # mlx-lm's loop, as the engine's batch is made
        gen = BatchGenerator(model, completion_batch_size=24, prefill_batch_size=8, prefill_step_size=512,
                             stream=stream)
        live = set(gen.insert(prompts, max_tokens=[12] * 24))
        while live:
            live -= {r.uid for r in gen.next()[1] if r.finish_reason is not None}
        gen.close()
    plain, passes[0] = passes[0], 0

    s = make(lm, stream, capacity=24)
    backend: Any = s.backend
    calls: list[tuple[int, int]] = []  # per call of mlx-lm's step: rows whose prompt it advanced, tokens decoded
    real_next = backend._gen.next

    def next_() -> Any:
        prompts, generated = real_next()
        calls.append((len([p for p in prompts if not p.end_of_prompt]), len(generated)))
        return prompts, generated

    monkeypatch.setattr(backend._gen, "next", next_)
    for i, p in enumerate(prompts):
        s.add(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=12)))
    run = Run()
    firsts: list[int] = []  # the step at which each row's first token came
    steps: list[tuple[int, int]] = []  # per step: rows whose prompt it advanced, tokens it decoded
    with mx.stream(stream):
        for step in range(500):
            if not s.has_work:
                break
            before, called = {rid for rid in run.outputs if run.tokens(rid)}, len(calls)
            run.step(s)
            firsts += [step] * len({rid for rid in run.outputs if run.tokens(rid)} - before)
            steps.append((sum(c[0] for c in calls[called:]), sum(c[1] for c in calls[called:])))
    assert len(firsts) == 24
    assert not [w for w in steps if w[0] and w[1]], steps  # no step both prefilled and decoded
    prefills = [i for i, w in enumerate(steps) if w[0]]
    assert [steps[i][0] for i in prefills] == [8, 8, 8], steps  # one step per group (one chunk each)
    for group, prefilled in enumerate(prefills):
        (at,) = set(firsts[group * 8:(group + 1) * 8])
        assert at == prefilled + 1, (group, at, steps)  # the next step, which prefilled nothing
        assert steps[at] == (0, 8 * (group + 1)), (group, steps)  # a decode step of every row in
    assert firsts[0] < prefills[-1]
    assert passes[0] <= plain
    for i, p in enumerate(prompts):
        assert run.tokens(f"r{i}") == reference(lm, p, 12), i


def test_requests_arriving_together_at_a_batch_full_of_bulk_rows_take_their_places_and_all_resume_exactly(
        lm: Any, stream: mx.Stream) -> None:
    # Every slot a bulk row's: the interactive requests start in one step, prefilled together, each bulk row
    # preempted with its cache parked; every request, bulk ones resumed, makes mlx-lm's single-request tokens.
    tokenizer = lm[1]
    s, run = make(lm, stream, capacity=3), Run()
    bulk = [words(tokenizer, 9 + seed, seed) for seed in range(3)]
    for i, p in enumerate(bulk):
        s.add(EngineRequest(f"b{i}", p, SamplingParams(max_tokens=24), priority=-101, bulk=True))
    drive(s, run, stream, until=lambda: all(len(run.tokens(f"b{i}")) >= 4 for i in range(3)))
    chats = [words(tokenizer, n, seed) for n, seed in ((14, 5), (3, 6))]
    for i, p in enumerate(chats):
        s.add(EngineRequest(f"c{i}", p, SamplingParams(max_tokens=12)))
    with mx.stream(stream):
        run.step(s)
    assert all(run.tokens(f"c{i}") for i in range(2)) and s.stats.started_at_once == 2  # both first tokens out
    drive(s, run, stream)
    assert s.stats.preemptions == 2 and s.stats.recomputes == 0
    expected = [*((f"b{i}", p, 24) for i, p in enumerate(bulk)), *((f"c{i}", p, 12) for i, p in enumerate(chats))]
    for rid, p, n in expected:
        assert run.tokens(rid) == reference(lm, p, n), rid
