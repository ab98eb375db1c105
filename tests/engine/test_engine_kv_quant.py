"""KV cache quantization inside the continuous batch (engine/mlx/quantized_cache.py): at 8 and 4 bits, in groups of
64, the engine's greedy tokens are exactly mlx-lm's own single-request decoding through a quantized cache, in a
ragged batch, from the prefix cache, after a restart from its disk tier, across a preemption and while speculating;
a hybrid model's attention layers are quantized and its recurrent state kept; admission counts the quantized bytes.

The oracle is mlx-lm's ``generate_step`` with ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start=0`` over
mlx-lm's own cache quantized before the prompt (``KVCache.to_quantized``): the engine quantizes keys and values as
they are written, so a prompt attends through the quantized cache however it is chunked or resumed. (Without a
cache given, mlx-lm's ``generate_step`` runs its first prefill chunk in float and quantizes after it: that is
another computation, not a numerical difference; :func:`test_mlx_lm_quantizes_after_its_first_chunk` shows it.)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq.engine.core.memory import KVBudget
from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.core.stats import EngineStats
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.loader import EngineOptions, ModelLoadError, load_model, start_engine
from mlxq.engine.mlx.memory import measure_layout
from mlxq.engine.mlx.prefix.cache import PrefixCache
from mlxq.engine.mlx.prefix.directory import layout_key
from mlxq.engine.mlx.quantized_cache import KVQuant, QuantizedRowCache, check_model
from mlxq.worker.tools.tinymodel import FAMILIES, SIZES, ensure_model
from tests.engine.fakes import Run
from tests.engine.real import Outputs, from_disk, on_disk, preempt_for_high, still, words
from tests.support import reference

pytestmark = pytest.mark.unit

MAX_TOKENS = 12
PREFILL_STEP = 64  # every prompt of the ragged batch within one chunk


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model("tiny-kvq", root=tmp_path_factory.mktemp("kvq"))  # heads of 64: groups of 64


@pytest.fixture(scope="module")
def stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


@pytest.fixture(scope="module")
def lm(path: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(path))


@pytest.fixture(scope="module")
def ours(path: Path, stream: mx.Stream) -> Any:
    with mx.stream(stream):
        loaded = load_model(str(path))
    return loaded.model, loaded.tokenizer


@pytest.fixture(params=[8, 4], ids=["8bit", "4bit"])
def quant(request: pytest.FixtureRequest) -> KVQuant:
    return KVQuant(int(request.param), 64)


def oracle(lm: Any, prompt: list[int], quant: KVQuant, n: int = MAX_TOKENS, *, from_start: bool = True) -> list[int]:
    """mlx-lm's single-request greedy tokens with its KV cache quantized (``from_start``: before the prompt)."""
    model, tokenizer = lm
    cache = [c.to_quantized(quant.group_size, quant.bits) if type(c) is KVCache else c  # recurrent state stays
             for c in make_prompt_cache(model)] if from_start else None
    out: list[int] = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, kv_bits=quant.bits,
                                kv_group_size=quant.group_size, quantized_kv_start=0):
        if int(tok) in tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


def scheduler(ours: Any, stream: mx.Stream, quant: KVQuant, capacity: int = 4,
              prefix: PrefixCache | None = None) -> Scheduler:
    model, tokenizer = ours
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=capacity, prefill_batch_size=8,
                     prefill_step_size=PREFILL_STEP, stream=stream, kv_quant=quant)
    return Scheduler(batch, capacity=capacity, new_detokenizer=lambda: tokenizer.detokenizer, prefix_cache=prefix,
                     clock=still)


def drive(s: Scheduler, run: Run, stream: mx.Stream, until: Any = None) -> None:
    with mx.stream(stream):
        for _ in range(2000):
            if not s.has_work or (until is not None and until()):
                return
            run.step(s)
    raise AssertionError("did not finish")


def expect_exact(run: Run, lm: Any, quant: KVQuant, rid: str, prompt: list[int], n: int = MAX_TOKENS) -> None:
    expected = oracle(lm, prompt, quant, n)
    assert len(set(expected)) > 3, expected  # the greedy output varies: a comparison that means something
    assert run.tokens(rid) == expected, rid
    assert run.final(rid).finish is FinishReason.LENGTH


def test_a_ragged_batch_decodes_as_mlx_lm_does_one_quantized_request(lm: Any, ours: Any, stream: mx.Stream,
                                                                      quant: KVQuant) -> None:
    s, run = scheduler(ours, stream, quant), Run()
    prompts = [words(ours[1], n, seed) for n, seed in ((3, 1), (11, 2), (30, 3), (60, 4))]
    assert max(map(len, prompts)) <= PREFILL_STEP
    for i, p in enumerate(prompts):  # all before the first step: prefilled together, right-padded
        s.add(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS)))
    drive(s, run, stream)
    for i, p in enumerate(prompts):
        expect_exact(run, lm, quant, f"r{i}", p)
    if quant.bits == 4:  # the cache was quantized: the float model decodes otherwise
        assert any(run.tokens(f"r{i}") != reference(lm, p, MAX_TOKENS) for i, p in enumerate(prompts))


def test_mlx_lm_quantizes_after_its_first_chunk(lm: Any) -> None:
    # mlx-lm's generate_step with kv_bits and no cache: its first chunk attends in float, then the cache is
    # quantized; at 4 bits that changes this prompt's tokens (the engine matches the cache quantized from the start).
    quant = KVQuant(4, 64)
    prompt = words(lm[1], 60, 4)
    assert oracle(lm, prompt, quant, from_start=False) != oracle(lm, prompt, quant)


def test_a_prefix_cache_keeps_quantized_entries_and_resumes_exactly(lm: Any, ours: Any, stream: mx.Stream,
                                                                    quant: KVQuant) -> None:
    tokenizer = ours[1]
    prefix = PrefixCache(64 << 20, min_tokens=16)
    s, run = scheduler(ours, stream, quant, prefix=prefix), Run()
    first = words(tokenizer, 40, 5)
    s.add(EngineRequest("first", first, SamplingParams(max_tokens=MAX_TOKENS)))
    drive(s, run, stream)
    second = first + run.tokens("first") + words(tokenizer, 9, 6)  # the next turn: the whole first one, and more
    s.add(EngineRequest("second", second, SamplingParams(max_tokens=MAX_TOKENS)))
    drive(s, run, stream)
    assert s.stats.prefix_hits == 1 and s.stats.prefix_tokens_saved == len(first) + MAX_TOKENS
    expect_exact(run, lm, quant, "first", first)
    expect_exact(run, lm, quant, "second", second)
    hit = prefix.fetch(second)
    assert hit is not None and {type(c) for c in hit.cache} == {QuantizedRowCache}
    assert {c.bits for c in hit.cache} == {quant.bits}


def test_a_preempted_quantized_row_resumes_exactly(lm: Any, ours: Any, stream: mx.Stream, quant: KVQuant) -> None:
    tokenizer = ours[1]
    s, run = scheduler(ours, stream, quant, capacity=2), Run()
    low = [words(tokenizer, 9, 1), words(tokenizer, 40, 2)]
    high = words(tokenizer, 20, 6)
    preempt_for_high(s, run, stream, low, high, MAX_TOKENS)
    assert (s.stats.preemptions, s.stats.resumes, s.stats.recomputes) == (1, 1, 0)  # its parked cache, no recompute
    for i, p in enumerate(low):
        expect_exact(run, lm, quant, f"low{i}", p, 3 * MAX_TOKENS)
    expect_exact(run, lm, quant, "high", high)


async def test_the_disk_tier_keeps_quantized_entries_across_a_restart(lm: Any, path: Path, tmp_path: Path,
                                                                      quant: KVQuant) -> None:
    options = EngineOptions(capacity=4, prefill_step_size=PREFILL_STEP, prefix_cache_bytes=64 << 20,
                            kv_disk_bytes=64 << 20, kv_dir=str(tmp_path), kv_quant=quant)
    outputs = Outputs()
    first = EngineRequest("turn-1", words(lm[1], 80, 7), SamplingParams(max_tokens=MAX_TOKENS))  # worth caching
    await on_disk(path, options, outputs, first)
    tokens = first.prompt_tokens + outputs.run.tokens(first.rid) + words(lm[1], 9, 8)
    turn = EngineRequest("turn-2", tokens, SamplingParams(max_tokens=MAX_TOKENS))
    stats = await from_disk(path, options, outputs, turn)
    assert stats.prefix_disk_hits == 1 and stats.prefix_disk_errors == 0
    assert stats.prefix_tokens_saved == len(first.prompt_tokens) + MAX_TOKENS
    for r in (first, turn):
        expect_exact(outputs.run, lm, quant, r.rid, r.prompt_tokens)


def test_quantized_entries_on_disk_live_apart_from_float_ones(ours: Any, stream: mx.Stream) -> None:
    # The disk tier's directory is named by the KV layout: a float engine never reads a quantized entry.
    with mx.stream(stream):
        keys = {layout_key(ours[0]), layout_key(ours[0], KVQuant(8, 64)), layout_key(ours[0], KVQuant(4, 64))}
    assert len(keys) == 3


def test_admission_counts_the_quantized_bytes(ours: Any, stream: mx.Stream, quant: KVQuant) -> None:
    model = ours[0]
    with mx.stream(stream):
        plain, quantized = measure_layout(model, PREFILL_STEP), measure_layout(model, PREFILL_STEP, quant)
    cache = make_prompt_cache(model)
    with mx.stream(stream):
        model(mx.array([[0]]), cache=cache)
    kv = [c for c in cache if isinstance(c, KVCache)]
    dtype_bytes = kv[0].keys.dtype.size
    values = sum(2 * c.keys.shape[1] * c.keys.shape[3] for c in kv)  # keys and values of one token, every layer
    assert plain.bytes_per_token == values * dtype_bytes
    assert quantized.bytes_per_token == values * quant.value_bytes(dtype_bytes)  # the formula, exactly
    # The same headroom admits as many more rows as the bytes shrink (up to the rounding of whole rows).
    headroom = 64 * plain.row_bytes(500)
    more = KVBudget(headroom, quantized).rows_that_fit(500, 0) / KVBudget(headroom, plain).rows_that_fit(500, 0)
    assert more >= 0.95 * plain.bytes_per_token / quantized.bytes_per_token


def test_a_group_size_that_does_not_divide_the_heads_is_refused(ours: Any, stream: mx.Stream) -> None:
    with mx.stream(stream):
        assert check_model(ours[0], KVQuant(8, 128)) == "group size 128 does not divide the head dimension 64"
        assert check_model(ours[0], KVQuant(3, 64)) == "3 bits (expected one of 4, 8)"
        assert check_model(ours[0], KVQuant(4, 32)) is None


async def test_an_engine_that_cannot_quantize_its_model_does_not_start(tiny_model: Path) -> None:
    outputs = Outputs()
    message = (f"cannot quantize the KV cache of {tiny_model} to 8 bits in groups of 64: group size 64 does not "
               "divide the head dimension 16 (MLXQ_KV_BITS, MLXQ_KV_GROUP_SIZE)")
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        await start_engine(str(tiny_model), outputs.sink, EngineOptions(capacity=2, kv_quant=KVQuant(8, 64)))


@pytest.mark.parametrize("kind,fixed", [("draft", False), ("ngram", False), ("draft", True)])
def test_speculative_rows_over_a_quantized_cache_decode_exactly(lm: Any, ours: Any, stream: mx.Stream, quant: KVQuant,
                                                                kind: str, fixed: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Verification writes k + 1 positions of each row into the quantized cache and takes the rejected ones back
    # off its end (RaggedQuantizedKVCache); the draft (here the model itself, its cache in float) proposes.
    # ``fixed``: shapes kept repeating, as on CUDA (rows held in buckets, passes over the whole buffer).
    from mlxq.engine.core.speculation.tuner import Tuner
    from mlxq.engine.mlx.speculation.proposers import DraftModel, PromptLookup

    cycle = itertools.cycle([4, 0, 2, 3, 0, 1, 4])  # each step's k (the tuner would choose by speed)
    monkeypatch.setattr(Tuner, "choose", lambda self, rows: next(cycle))
    model, tokenizer = ours
    stats = EngineStats()
    proposer = DraftModel(model, PREFILL_STEP) if kind == "draft" else PromptLookup()
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=8, prefill_batch_size=8, prefill_step_size=PREFILL_STEP,
                     stream=stream, kv_quant=quant, proposer=proposer, max_k=4, stats=stats, fixed_shapes=fixed)
    s, run = Scheduler(batch, capacity=8, new_detokenizer=lambda: tokenizer.detokenizer, stats=stats), Run()
    prompts = [words(tokenizer, n, seed) for n, seed in ((5, 1), (17, 2), (31, 3))]
    prompts = [p + p for p in prompts]  # text that quotes itself: prompt lookup finds proposals
    for i, p in enumerate(prompts):
        s.add(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=3 * MAX_TOKENS)))
    drive(s, run, stream)
    assert stats.spec_steps > 0 and 0 < stats.spec_accepted <= stats.spec_drafted
    for i, p in enumerate(prompts):
        assert run.tokens(f"r{i}") == oracle(lm, p, quant, 3 * MAX_TOKENS), f"r{i}"


def wide(family: str, root: Path) -> Path:
    """The family's tiny model with heads of 64 (its attention layers' caches quantize in groups of 64)."""
    name = f"tiny-kvq-{family}"
    SIZES[name] = dataclasses.replace(FAMILIES[family], name=name, hidden_size=128, num_attention_heads=2,
                                      num_key_value_heads=1)
    return ensure_model(name, root=root)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
async def test_a_hybrid_models_attention_layers_are_quantized_and_its_state_is_not(
        family: str, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture) -> None:
    import mlx_lm

    path = wide(family, tmp_path_factory.mktemp("families"))
    lm = mlx_lm.load(str(path))
    quant, outputs = KVQuant(8, 64), Outputs()
    options = EngineOptions(capacity=4, prefill_step_size=PREFILL_STEP, prefix_cache_bytes=0, kv_quant=quant)
    with caplog.at_level(logging.INFO, logger="mlxq.engine.mlx.loader"):
        engine, _ = await start_engine(str(path), outputs.sink, options)
    prompts = [words(lm[1], n, seed) for n, seed in ((4, 1), (19, 2), (45, 3))]
    try:
        for i, p in enumerate(prompts):
            engine.add(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS)))
        for i in range(len(prompts)):
            await outputs.finished(f"r{i}")
    finally:
        await engine.aclose()
    logged = f"KV cache of {path} quantized to 8 bits in groups of 64; not quantized: its ArraysCache layers"
    assert logged in caplog.text
    for i, p in enumerate(prompts):
        expect_exact(outputs.run, lm, quant, f"r{i}", p)


async def test_a_model_with_attention_sinks_cannot_be_quantized(tmp_path_factory: pytest.TempPathFactory) -> None:
    # gpt-oss: mlx-lm's quantized attention rejects attention sinks (its sliding windows would stay float anyway).
    path = wide("gpt_oss", tmp_path_factory.mktemp("families"))
    message = ("its attention cannot read a quantized cache (ValueError: Quantized SDPA does not support attention "
               "sinks.)")
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        await start_engine(str(path), Outputs().sink, EngineOptions(capacity=2, kv_quant=KVQuant(8, 64)))
