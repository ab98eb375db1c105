"""The architecture matrix: a generated tiny model of each family people serve (worker/tools/tinymodel.py
``FAMILIES``: a hybrid SSM, hybrid linear attention, sliding windows with sinks, latent attention, experts) makes
exactly mlx-lm's single-request greedy tokens through mlxq on every path: alone, in a ragged batch, from the
prefix cache, after a restart from the disk tier, across a preemption. What mlx-lm alone gets wrong is shown with
mlx-lm alone (a strict xfail): when it passes, drop mlxq's correction (engine/mlx/fixes.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.loader import EngineOptions, load_model
from mlxq.engine.mlx.prefix.cache import PrefixCache
from mlxq.worker.tools.tinymodel import FAMILIES, ensure_model
from tests.engine.fakes import Run
from tests.engine.real import Outputs, drive, from_disk, on_disk, preempt_for_high, still, words
from tests.support import reference, reference_text

pytestmark = pytest.mark.unit

MAX_TOKENS = 12
PREFILL_STEP = 32  # the longest prompts span several chunks; gpt_oss's window (16) is passed in a prompt
SYSTEM = {"role": "system", "content": "You are the model queue server. Answer in tokens. " * 4}

# What mlx-lm 0.32.2 alone gets wrong, by family: mlxq corrects it (engine/mlx/fixes.py).
UPSTREAM_BUGS = {
    "nemotron_h": "mlx-lm 0.32.2's NemotronHMamba2Mixer passes no row lengths to ssm_update: a shorter row of a "
                  "ragged prefill keeps the state past its end (ml-explore/mlx-lm#1908); when this passes, drop "
                  "NemotronHMixerWithLengths from engine/mlx/fixes.py",
}

# Families whose decoding row's cache cannot be taken back to its last token (recurrent state; a sliding window
# that has wrapped), so a preempted one is recomputed rather than resumed.
UNTRIMMABLE = frozenset({"nemotron_h", "qwen3_next", "gpt_oss"})


@pytest.fixture(scope="session")
def families_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def path(family: str, families_root: Path) -> Path:
    return ensure_model(f"tiny-{family}", root=families_root)


@pytest.fixture(scope="module")
def lm(path: Path) -> Any:
    """mlx-lm alone: the oracle's model, as ``mlx_lm.load`` makes it."""
    import mlx_lm

    return mlx_lm.load(str(path))


@pytest.fixture(scope="module")
def stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


@pytest.fixture(scope="module")
def ours(path: Path, stream: mx.Stream) -> Any:
    """The model as mlxq loads it (with its corrections), and mlx-lm's tokenizer."""
    with mx.stream(stream):
        loaded = load_model(str(path))
    return loaded.model, loaded.tokenizer


def scheduler(ours: Any, stream: mx.Stream, capacity: int = 4, prefix: PrefixCache | None = None) -> Scheduler:
    model, tokenizer = ours
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=capacity, prefill_batch_size=8,
                     prefill_step_size=PREFILL_STEP, stream=stream)
    return Scheduler(batch, capacity=capacity, new_detokenizer=lambda: tokenizer.detokenizer, prefix_cache=prefix,
                     clock=still)



def ragged(tokenizer: Any) -> list[list[int]]:
    """Prompts of very different lengths: a few tokens to several prefill chunks."""
    return [words(tokenizer, n, seed) for n, seed in ((3, 1), (11, 2), (30, 3), (70, 4))]


def expect_exact(run: Run, lm: Any, rid: str, prompt: list[int], n: int = MAX_TOKENS) -> None:
    expected = reference(lm, prompt, n)
    assert len(set(expected)) > 3, expected  # the model's greedy output varies: a comparison that means something
    assert run.tokens(rid) == expected, rid
    assert run.text(rid) == reference_text(lm, expected), rid
    assert run.final(rid).finish is FinishReason.LENGTH


def test_mlx_lm_alone_batches_rows_of_different_lengths_as_it_decodes_each(
        family: str, lm: Any, request: pytest.FixtureRequest) -> None:
    from mlx_lm import batch_generate

    if family in UPSTREAM_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=UPSTREAM_BUGS[family]))
    model, tokenizer = lm
    prompts = ragged(tokenizer)
    out = batch_generate(model, tokenizer, prompts, max_tokens=MAX_TOKENS, return_token_ids=True)
    assert out.token_ids is not None
    assert [list(t) for t in out.token_ids] == [reference(lm, p, MAX_TOKENS) for p in prompts]


def test_the_correction_is_made_on_mlxqs_model_alone_and_logged(families_root: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import mlx_lm
    from mlx_lm.models.nemotron_h import NemotronHMamba2Mixer

    from mlxq.engine.mlx.fixes import NemotronHMixerWithLengths

    path = ensure_model("tiny-nemotron_h", root=families_root)
    with caplog.at_level(logging.INFO, logger="mlxq.engine.mlx.fixes"):
        ours = load_model(str(path)).model
    theirs = mlx_lm.load(str(path))[0]
    assert [type(layer.mixer) for layer in ours.layers if layer.block_type == "M"] == [NemotronHMixerWithLengths] * 2
    assert [type(layer.mixer) for layer in theirs.layers if layer.block_type == "M"] == [NemotronHMamba2Mixer] * 2
    assert "corrected 2 layer(s) of mlx-lm's code" in caplog.text


def test_a_request_alone(lm: Any, ours: Any, stream: mx.Stream) -> None:
    s, run = scheduler(ours, stream), Run()
    prompt = words(ours[1], 25, 5)
    s.add(EngineRequest("alone", prompt, SamplingParams(max_tokens=MAX_TOKENS)))
    drive(s, run, stream)
    expect_exact(run, lm, "alone", prompt)


def test_a_ragged_batch(lm: Any, ours: Any, stream: mx.Stream) -> None:
    s, run = scheduler(ours, stream), Run()
    prompts = ragged(ours[1])
    for i, p in enumerate(prompts):  # all before the first step: prefilled together, right-padded
        s.add(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS)))
    drive(s, run, stream)
    for i, p in enumerate(prompts):
        expect_exact(run, lm, f"r{i}", p)


def chat(tokenizer: Any, rid: str, question: str) -> EngineRequest:
    e = encode_prompt_with_boundary(tokenizer, None, [SYSTEM, {"role": "user", "content": question}])
    return EngineRequest(rid, e.tokens, SamplingParams(max_tokens=MAX_TOKENS), cache_boundary=e.cache_boundary)


def next_turn(tokenizer: Any, rid: str, turn: EngineRequest, answer: list[int]) -> EngineRequest:
    """The conversation's next turn: its tokens so far (as the cache holds them: text decoded and encoded again
    may split otherwise) and more."""
    tokens = turn.prompt_tokens + answer + list(tokenizer.encode(" Go on: and why batch the tokens?"))
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=MAX_TOKENS), cache_boundary=turn.cache_boundary)


def test_from_the_prefix_cache(lm: Any, ours: Any, stream: mx.Stream) -> None:
    # The first chat's system prompt is checkpointed; two more chats start from it together (a ragged batch over
    # caches with history; where a cache trims, from the first's conversation cut to what they share); the first
    # conversation's next turn starts from all of it.
    tokenizer = ours[1]
    s, run = scheduler(ours, stream, prefix=PrefixCache(64 << 20)), Run()
    first = chat(tokenizer, "first", "What is a queue?")
    s.add(first)
    drive(s, run, stream)
    others = [chat(tokenizer, "second", "Why batch?"), chat(tokenizer, "third", "And the cache of the model?")]
    for r in others:
        s.add(r)
    drive(s, run, stream)
    saved = s.stats.prefix_tokens_saved
    assert s.stats.prefix_hits == 2 and saved >= 2 * first.cache_boundary
    turn = next_turn(tokenizer, "turn-2", first, run.tokens("first"))
    s.add(turn)
    drive(s, run, stream)
    assert s.stats.prefix_hits == 3
    assert s.stats.prefix_tokens_saved - saved == len(first.prompt_tokens) + MAX_TOKENS  # the whole first turn
    for r in (first, *others, turn):
        expect_exact(run, lm, r.rid, r.prompt_tokens)


def test_across_a_preemption(family: str, lm: Any, ours: Any, stream: mx.Stream) -> None:
    tokenizer = ours[1]
    s, run = scheduler(ours, stream, capacity=2), Run()
    low = [words(tokenizer, 9, 1), words(tokenizer, 40, 2)]
    high = words(tokenizer, 20, 6)
    preempt_for_high(s, run, stream, low, high, MAX_TOKENS)
    resumed = family not in UNTRIMMABLE  # else its cache cannot be taken back to its last token: recomputed
    assert (s.stats.preemptions, s.stats.resumes, s.stats.recomputes) == (1, int(resumed), int(not resumed))
    for i, p in enumerate(low):
        expect_exact(run, lm, f"low{i}", p, 3 * MAX_TOKENS)
    expect_exact(run, lm, "high", high)


def test_across_a_preemption_mid_prefill(lm: Any, ours: Any, stream: mx.Stream) -> None:
    # Preempted between two chunks of its prompt, a row resumes from its partial cache, whatever its kind, and
    # prefills the rest once the urgent one is done.
    tokenizer = ours[1]
    s, run = scheduler(ours, stream, capacity=1), Run()
    long = words(tokenizer, 150, 3)
    assert len(long) > 4 * PREFILL_STEP
    s.add(EngineRequest("long", long, SamplingParams(max_tokens=MAX_TOKENS)))
    drive(s, run, stream, until=lambda: s.stats.kv_bytes > 0)  # prefilling, no token yet
    assert run.tokens("long") == []
    urgent = words(tokenizer, 5, 1)
    s.add(EngineRequest("urgent", urgent, SamplingParams(max_tokens=MAX_TOKENS), priority=2))
    drive(s, run, stream)
    assert (s.stats.preemptions, s.stats.resumes, s.stats.recomputes) == (1, 1, 0)
    expect_exact(run, lm, "long", long)
    expect_exact(run, lm, "urgent", urgent)


async def test_after_a_restart_from_the_disk_tier(lm: Any, path: Path, tmp_path: Path) -> None:
    options = EngineOptions(capacity=4, prefill_step_size=PREFILL_STEP, prefix_cache_bytes=64 << 20,
                            kv_disk_bytes=64 << 20, kv_dir=str(tmp_path))
    outputs = Outputs()
    tokenizer = lm[1]
    first = chat(tokenizer, "turn-1", "What is a queue?")
    await on_disk(path, options, outputs, first)
    turn = next_turn(tokenizer, "turn-2", first, outputs.run.tokens(first.rid))
    stats = await from_disk(path, options, outputs, turn)
    assert stats.prefix_disk_hits == 1 and stats.prefix_disk_errors == 0
    assert stats.prefix_tokens_saved == len(first.prompt_tokens) + MAX_TOKENS  # the whole first conversation
    for r in (first, turn):
        expect_exact(outputs.run, lm, r.rid, r.prompt_tokens)
