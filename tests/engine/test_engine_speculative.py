"""Speculative decoding in the batch (engine/mlx/speculation/batch.py): every row's tokens equal plain greedy decoding's
whatever the proposals, with a draft model and with prompt lookup, at N = 1, 8 and 32, through stop strings,
max_tokens, cancels, preemption, the prefix cache and rows that never take proposals."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.core.speculation.tuner import Tuner
from mlxq.engine.core.stats import EngineStats
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.prefix.cache import PrefixCache
from mlxq.engine.mlx.ragged_cache import ragged, rollback
from mlxq.engine.mlx.sampling import make_request_logits_processors, make_request_sampler
from mlxq.engine.mlx.speculation.batch import Proposer
from mlxq.engine.mlx.speculation.proposers import DraftModel, PromptLookup, _Lookup
from tests.engine.fakes import Run
from tests.engine.real import still
from tests.support import reference

# Tiers: unit, but for the long runs (slow): 32 rows at once, 80 tokens twice over, 1,200 samples, the fully loaded
# run; tests/conftest.py marks each.

WORDS = ("the", "sea", "ship", "story", "numbers", "words", "fox", "quick", "brown", "red", "blue", "river", "stone",
         "light")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(target, draft) as mlx-lm loads them: a generated target grown from its draft (they mostly agree)."""
    import mlx_lm

    from mlxq.worker.tools.tinymodel import ensure_model

    root = tmp_path_factory.mktemp("pair")
    return mlx_lm.load(str(ensure_model("tiny-target", root=root))), mlx_lm.load(str(ensure_model("tiny-draft",
                                                                                                    root=root)))


@pytest.fixture(scope="module")
def stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


@pytest.fixture
def ks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each step's k from a fixed cycle with plain steps between (the tuner would choose by speed)."""
    cycle = itertools.cycle([4, 0, 2, 3, 0, 0, 1, 4, 4])
    monkeypatch.setattr(Tuner, "choose", lambda self, rows: next(cycle))
    yield


def make(target: Any, proposer: Proposer | None, stream: mx.Stream, *, capacity: int = 32,
         prefix: PrefixCache | None = None, prefill_batch: int = 8) -> tuple[Scheduler, EngineStats]:
    model, tokenizer = target
    stats = EngineStats()
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=capacity, prefill_batch_size=prefill_batch,
                     prefill_step_size=64,
                     stream=stream, proposer=proposer, stats=stats)
    return Scheduler(batch, capacity=capacity, new_detokenizer=lambda: tokenizer.detokenizer,
                     make_sampler=make_request_sampler, make_processors=make_request_logits_processors,
                     prefix_cache=prefix, stats=stats, clock=still), stats


def drain(s: Scheduler, run: Run, stream: mx.Stream) -> None:
    with mx.stream(stream):
        run.drain(s, limit=3000)


def requests(tokenizer: Any, n: int, seed: int, *, repeat: bool = False, max_tokens: int = 0) -> list[EngineRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        if repeat:  # text that quotes itself: prompt lookup finds proposals
            text = f"{text} {text}"
        params = SamplingParams(max_tokens=max_tokens or rng.randint(1, 48))
        out.append(EngineRequest(f"r{i}", tokenizer.encode(text), params))
    return out


def proposer_of(kind: str, pair: tuple[Any, Any]) -> Proposer:
    return DraftModel(pair[1][0], 64) if kind == "draft" else PromptLookup()


@pytest.mark.parametrize("kind", ["draft", "ngram"])
@pytest.mark.parametrize("n", [1, 8, pytest.param(32, marks=pytest.mark.slow)])
def test_greedy_tokens_equal_plain_decoding(pair: tuple[Any, Any], stream: mx.Stream, ks: None, kind: str,
                                            n: int) -> None:
    target = pair[0]
    s, stats = make(target, proposer_of(kind, pair), stream)
    reqs = requests(target[1], n, seed=n, repeat=kind == "ngram")
    for r in reqs:
        s.add(r)
    run = Run()
    drain(s, run, stream)
    for r in reqs:
        assert run.tokens(r.rid) == reference(target, r.prompt_tokens, r.params.max_tokens), r.rid
        assert run.final(r.rid).finish is FinishReason.LENGTH
    # Prompt lookup verifies only where a row's last tokens were seen before: a random model's output rarely
    # goes on as its prompt did, so among 1 row no step had any (the test below), among 8 or 32 some did.
    assert stats.spec_steps > 0 or (kind, n) == ("ngram", 1)
    if kind == "draft":  # rows kept runs of different lengths (a random model's text rarely repeats for lookup)
        assert 0 < stats.spec_accepted < stats.spec_drafted


def test_prompt_lookup_with_nothing_seen_decodes_plainly(pair: tuple[Any, Any], stream: mx.Stream,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Every token of the prompt differs, so no suffix of it and its first token was seen before: the step the
    # tuner gives k = 4 has nothing to verify and decodes plainly (a verification of fillers is all cost).
    target = pair[0]
    monkeypatch.setattr(Tuner, "choose", lambda self, rows: 4)
    prompt = list(range(10, 30))
    s, stats = make(target, PromptLookup(), stream)
    s.add(EngineRequest("r", prompt, SamplingParams(max_tokens=2)))
    run = Run()
    drain(s, run, stream)
    assert run.tokens("r") == reference(target, prompt, 2)
    assert (stats.spec_steps, stats.spec_drafted, stats.spec_k) == (0, 0, 0)


def test_a_stop_string_inside_an_accepted_run_ends_the_text_where_plain_decoding_does(
        pair: tuple[Any, Any], stream: mx.Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    target = pair[0]
    monkeypatch.setattr(Tuner, "choose", lambda self, rows: 4)
    req = requests(target[1], 1, seed=5, max_tokens=40)[0]
    plain, _ = make(target, None, stream)
    plain.add(req)
    run = Run()
    drain(plain, run, stream)
    text = run.text(req.rid)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0
    s, stats = make(target, DraftModel(target[0], 64), stream)  # the target as its own draft: it accepts all
    s.add(EngineRequest("stop", req.prompt_tokens, SamplingParams(max_tokens=40, stop=(stop,))))
    spec = Run()
    drain(s, spec, stream)
    assert spec.text("stop") == text[:text.index(stop)]
    assert spec.final("stop").finish is FinishReason.STOP and spec.final("stop").stop_sequence == stop
    assert stats.spec_accepted == stats.spec_drafted > 0


def test_a_cancelled_row_leaves_and_the_others_go_on_exactly(pair: tuple[Any, Any], stream: mx.Stream,
                                                             ks: None) -> None:
    target = pair[0]
    s, _ = make(target, proposer_of("draft", pair), stream)
    reqs = requests(target[1], 6, seed=11, max_tokens=40)
    for r in reqs:
        s.add(r)
    run = Run()
    with mx.stream(stream):
        run.step(s, 6)
        out = s.abort("r2")
    assert out is not None and out.finish is FinishReason.CANCELLED
    drain(s, run, stream)
    for r in reqs:
        if r.rid != "r2":
            assert run.tokens(r.rid) == reference(target, r.prompt_tokens, 40), r.rid


def test_preempted_rows_resume_exactly(pair: tuple[Any, Any], stream: mx.Stream, ks: None) -> None:
    target = pair[0]
    s, stats = make(target, proposer_of("draft", pair), stream, capacity=2)
    low = requests(target[1], 2, seed=21, max_tokens=40)
    for r in low:
        s.add(r)
    run = Run()
    with mx.stream(stream):
        run.step(s, 8)
    high = EngineRequest("high", target[1].encode("the river and the stone"), SamplingParams(max_tokens=20),
                         priority=5)
    s.add(high)
    drain(s, run, stream)
    assert stats.preemptions >= 1
    for r in [*low, high]:
        assert run.tokens(r.rid) == reference(target, r.prompt_tokens, r.params.max_tokens), r.rid


def test_a_cached_prefix_serves_a_speculating_row(pair: tuple[Any, Any], stream: mx.Stream, ks: None) -> None:
    target = pair[0]
    system = {"role": "system", "content": "You answer in tokens. " * 8}
    s, stats = make(target, proposer_of("draft", pair), stream, prefix=PrefixCache(1 << 26))
    reqs = []
    for i, question in enumerate(["blue river", "red stone", "the quick fox"]):
        e = encode_prompt_with_boundary(target[1], None, [system, {"role": "user", "content": question}])
        reqs.append(EngineRequest(f"c{i}", e.tokens, SamplingParams(max_tokens=24), cache_boundary=e.cache_boundary))
    run = Run()
    for r in reqs:  # one after another: the later ones find the first one's system prompt cached
        s.add(r)
        drain(s, run, stream)
    assert stats.prefix_hits >= 2
    for r in reqs:
        assert run.tokens(r.rid) == reference(target, r.prompt_tokens, 24), r.rid


def test_rows_with_their_own_sampler_or_penalties_decode_as_without_speculation(
        pair: tuple[Any, Any], stream: mx.Stream, ks: None) -> None:
    target = pair[0]
    prompt = target[1].encode("the quick brown fox and the sea")
    own = [EngineRequest("seeded", prompt, SamplingParams(max_tokens=30, temperature=0.8, seed=7)),
           EngineRequest("greedy", prompt, SamplingParams(max_tokens=30))]
    penalised = [EngineRequest("penalty", prompt, SamplingParams(max_tokens=30, repetition_penalty=1.3))]
    for reqs in (own, penalised):
        outputs = []
        for proposer in (None, proposer_of("draft", pair)):
            s, stats = make(target, proposer, stream)
            for r in reqs:
                s.add(r)
            run = Run()
            drain(s, run, stream)
            outputs.append({r.rid: run.tokens(r.rid) for r in reqs})
        assert outputs[0] == outputs[1]
    assert outputs[1]["penalty"] and stats.spec_steps == 0  # a penalised row keeps its batch's steps plain


def test_rollback_takes_each_rows_own_tail_off_and_the_next_tokens_go_there() -> None:
    rows = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    singles = []
    for r in rows:
        c = KVCache()
        c.update_and_fetch(*(mx.array(r, dtype=mx.float32).reshape(1, 1, 5, 1),) * 2)
        singles.append(c)
    batch = ragged([BatchKVCache.merge(singles)])[0]
    rollback([batch], [1, 3, 1])
    assert [c.keys[0, 0, :, 0].tolist() for c in (batch.extract(i) for i in range(3))] == [[1, 2, 3, 4], [6, 7],
                                                                                           [11, 12, 13, 14]]
    assert batch.offset.tolist() == [4, 2, 4]
    mask = batch.make_mask(2)  # each row's two new positions see its own tokens only
    assert mask.shape == (3, 1, 2, 6) and mask[1, 0].tolist() == [[True, True, True, False, False, False]] * 1 + [
        [True, True, True, True, False, False]]
    batch.update_and_fetch(*(mx.array([[20, 21], [22, 23], [24, 25]], dtype=mx.float32).reshape(3, 1, 2, 1),) * 2)
    assert [c.keys[0, 0, :, 0].tolist() for c in (batch.extract(i) for i in range(3))] == [
        [1, 2, 3, 4, 20, 21], [6, 7, 22, 23], [11, 12, 13, 14, 24, 25]]
    assert batch.offset.tolist() == [6, 4, 6]


def test_prompt_lookup_copies_what_followed_the_latest_earlier_occurrence() -> None:
    row = _Lookup((3, 2))
    history = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5]
    row.add(history, 6)  # the pending token, not in the row's tokens yet
    assert row.follow(history, 6, 3) == [7, 1, 2]  # "2 5 6" is new; "5 6" came twice, last before "7 1 2"
    history.append(6)
    row.add(history, 7)
    assert row.follow(history, 7, 2) == [1, 2]  # "5 6 7" came twice: the latest wins
    history += [7, 1]
    row.add(history, 2)
    assert row.follow(history, 2, 5) == [5, 6, 7, 1, 2]  # "7 1 2" went on "5 6 7 1", then the pending 2
    assert _Lookup((2,)).follow([1, 2], 3, 2) is None  # nothing seen


def second_token_distribution(target: Any, prompt: list[int], temperature: float) -> mx.array:
    """The exact distribution of a sampled request's second token: sum over first tokens t of p(t) p(. | t)."""
    model = target[0]
    first = mx.softmax(model(mx.array(prompt)[None])[0, -1] / temperature)
    vocab = first.shape[0]
    rows = mx.concatenate([mx.broadcast_to(mx.array(prompt)[None], (vocab, len(prompt))),
                           mx.arange(vocab)[:, None]], axis=1)
    second = mx.softmax(model(rows)[:, -1] / temperature, axis=-1)
    return first @ second


def chi_square_ok(counts: dict[int, int], expected: mx.array, n: int) -> tuple[float, float]:
    """Pearson's statistic over tokens expected 5+ times (the rest pooled) and its 0.1 % critical value."""
    p = expected.tolist()
    bins = [t for t, q in enumerate(p) if q * n >= 5]  # type: ignore[union-attr]
    observed = [counts.get(t, 0) for t in bins] + [n - sum(counts.get(t, 0) for t in bins)]
    wanted = [p[t] * n for t in bins] + [n * (1 - sum(p[t] for t in bins))]  # type: ignore[index]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    df = len([e for e in wanted if e > 0]) - 1
    z = 3.09  # the normal's 99.9th percentile (Wilson-Hilferty's approximation of the chi-square's)
    return stat, df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.slow
def test_sampled_tokens_keep_the_targets_distribution(pair: tuple[Any, Any], stream: mx.Stream,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    target, temperature, n = pair[0], 0.7, 1200
    monkeypatch.setattr(Tuner, "choose", lambda self, rows: 3)
    prompt = target[1].encode("the river and the stone")
    mx.random.seed(3)
    # Every row prefills the same prompt: a whole batch of them per prefill step (8 at a time: 150 steps).
    s, stats = make(target, proposer_of("draft", pair), stream, capacity=64, prefill_batch=64)
    for i in range(n):  # unseeded: each row keeps proposals by the speculative-sampling rule
        s.add(EngineRequest(f"s{i}", prompt, SamplingParams(max_tokens=2, temperature=temperature)))
    run = Run()
    drain(s, run, stream)
    seconds = [run.tokens(f"s{i}")[1] for i in range(n)]
    assert stats.spec_accepted > 0 and stats.spec_accepted < stats.spec_drafted
    counts: dict[int, int] = {}
    for t in seconds:
        counts[t] = counts.get(t, 0) + 1
    stat, critical = chi_square_ok(counts, second_token_distribution(target, prompt, temperature), n)
    assert stat < critical, (stat, critical)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_verification_shapes_repeat_where_asked_and_tokens_stay_exact(
        pair: tuple[Any, Any], stream: mx.Stream, ks: None, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA each distinct shape of an attention over several positions builds a cuDNN graph: with
    # fixed_shapes a pass over several positions attends over the cache's whole buffer, so its shapes repeat.
    from mlxq.engine.mlx.ragged_cache import RaggedKVCache

    seen: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
    original = RaggedKVCache.make_mask

    def recording(self: RaggedKVCache, N: int, **kwargs: Any) -> Any:
        mask = original(self, N, **kwargs)
        if N > 1:
            seen[self.fixed].append(tuple(mask.shape))
        return mask

    monkeypatch.setattr(RaggedKVCache, "make_mask", recording)
    target = pair[0]
    model, tokenizer = target
    for fixed in (False, True):
        stats = EngineStats()
        batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=8, prefill_batch_size=8, prefill_step_size=64,
                         stream=stream, proposer=proposer_of(kind, pair), stats=stats, fixed_shapes=fixed)
        s = Scheduler(batch, capacity=8, new_detokenizer=lambda: tokenizer.detokenizer,
                      make_sampler=make_request_sampler, make_processors=make_request_logits_processors, stats=stats)
        # 80 tokens: enough passes over several positions that prompt lookup's shapes are counted over tens of
        # passes, not a few, whatever steps the rows join the batch in.
        reqs = requests(tokenizer, 8, seed=5, repeat=kind == "ngram", max_tokens=80)
        for r in reqs:
            s.add(r)
        run = Run()
        drain(s, run, stream)
        for r in reqs:
            assert run.tokens(r.rid) == reference(target, r.prompt_tokens, r.params.max_tokens), (fixed, r.rid)
    assert len(seen[False]) > 5 and len(seen[True]) > 5
    # Without it nearly every pass had a shape of its own; with it the key length is the buffer's (whole steps of
    # 256), so a pass's shape is fixed by its rows, positions and the buffer's steps alone, and repeats.
    assert len(set(seen[False])) > len(seen[False]) // 2
    assert {shape[-1] % 256 for shape in seen[True]} == {0}
    assert len(set(seen[True])) < len(set(seen[False])) - 1, (sorted(set(seen[True])), sorted(set(seen[False])))


def attention_shapes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The shapes (q, k, v, mask) of every attention over several query positions that the speculative batch runs
    (its verifications and the draft's passes, the draft's prefill of joining rows; the target's own prefill is
    mlx-lm's prompt batch, outside it), recorded as MLX is called."""
    from mlxq.engine.mlx.speculation.batch import SpecBatch

    seen: list[tuple[Any, ...]] = []
    inside = [0]
    attention = mx.fast.scaled_dot_product_attention

    def recording(q: mx.array, k: mx.array, v: mx.array, **kwargs: Any) -> mx.array:
        mask = kwargs.get("mask")
        if inside[0] and q.shape[2] > 1:
            seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), getattr(mask, "shape", mask)))
        return attention(q, k, v, **kwargs)

    def within(method: Any) -> Any:
        def run(self: SpecBatch, *args: Any) -> Any:
            inside[0] += 1
            try:
                return method(self, *args)
            finally:
                inside[0] -= 1
        return run

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(SpecBatch, "next", within(SpecBatch.next))
    monkeypatch.setattr(SpecBatch, "extend", within(SpecBatch.extend))
    return seen


def loaded_run(target: Any, proposer: Proposer, stream: mx.Stream, fixed: bool, n: int,
               seed: int) -> tuple[list[EngineRequest], Run, EngineStats, MLXBatch]:
    """``n`` requests of random prompt lengths and max_tokens through a batch of 8: 8 in flight, rows joining as
    others end."""
    model, tokenizer = target
    stats = EngineStats()
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=8, prefill_batch_size=8, prefill_step_size=64,
                     stream=stream, proposer=proposer, stats=stats, fixed_shapes=fixed)
    s = Scheduler(batch, capacity=8, new_detokenizer=lambda: tokenizer.detokenizer,
                  make_sampler=make_request_sampler, make_processors=make_request_logits_processors, stats=stats)
    reqs = requests(tokenizer, n, seed=seed)
    for r in reqs:
        s.add(r)
    run = Run()
    drain(s, run, stream)
    return reqs, run, stats, batch


@pytest.mark.slow
def test_a_fully_loaded_run_meets_few_attention_shapes_where_shapes_repeat(
        pair: tuple[Any, Any], stream: mx.Stream, ks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA every new shape of an attention over several positions builds a cuDNN graph (~50 ms). Where shapes
    # repeat, the batch holds its rows in buckets (1, 2, 4, 8), verifies over whole buffers of 256 keys, and the
    # draft prefills and catches up in passes of a few widths: over a run with rows joining and leaving, the
    # shapes met are a few, however long the run; without it they grow with the run.
    seen = attention_shapes(monkeypatch)
    target = pair[0]
    counts = {}
    for fixed, n in ((True, 12), (True, 48), (False, 12), (False, 48)):
        seen.clear()
        reqs, run, stats, batch = loaded_run(target, proposer_of("draft", pair), stream, fixed, n, seed=n)
        for r in reqs:
            assert run.tokens(r.rid) == reference(target, r.prompt_tokens, r.params.max_tokens), (fixed, r.rid)
        assert stats.spec_steps > 20 and len(seen) > 100
        counts[fixed, n] = len(set(seen))
        if fixed:
            assert {q[0] for q, *_ in seen} <= {1, 2, 4, 8}  # rows held in buckets
            assert {k[2] % 256 for _, k, *_ in seen} == {0}  # keys: whole buffers
            widths = {q[2] for q, *_ in seen}
            assert widths <= {2, 3, 4, 5, 8, 16, 32, 64}, widths  # k + 1, the draft's catch-up widths, its chunk
            spec = batch._spec
            assert spec is not None and {s[0] for s in spec.shapes} == {"verify", "draft", "draft-prefill"}
    # tiny-target's context is 512: two buffers; so at most 4 row buckets x 8 widths x 2 buffers, and far fewer
    assert counts[True, 48] <= 24 and counts[True, 48] - counts[True, 12] <= 6, counts
    assert counts[False, 48] > 3 * counts[True, 48] and counts[False, 48] > counts[False, 12] + 20, counts
