"""The prefix cache on the real tiny model: a prompt that starts from a cached prefix generates exactly the
greedy tokens of one prefilled from scratch (mlx-lm's generate_step), for text and chat prompts; the system
prompt is cached at its boundary; an exact hit works; the byte bound holds; memory is given back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.engine.core.backend import SequenceCache
from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.engine.core.request import EngineRequest, FinishReason, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.mlx.batch import MLXBatch
from mlxq.engine.mlx.memory import measure_layout
from mlxq.engine.mlx.prefix.cache import PrefixCache
from tests.engine.fakes import Run, ToyCache
from tests.engine.real import drive, still
from tests.support import reference

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "You are the model queue server. Answer in tokens. " * 8}


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


@pytest.fixture(scope="module")
def stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


def make(lm: Any, stream: mx.Stream, prefix: PrefixCache | None, capacity: int = 4) -> Scheduler:
    model, tokenizer = lm
    batch = MLXBatch(model, tokenizer.eos_token_ids, capacity=capacity, prefill_batch_size=8, prefill_step_size=64,
                     stream=stream)
    return Scheduler(batch, capacity=capacity, new_detokenizer=lambda: tokenizer.detokenizer, prefix_cache=prefix,
                     clock=still)



def chat(lm: Any, question: str) -> EngineRequest:
    e = encode_prompt_with_boundary(lm[1], None, [SYSTEM, {"role": "user", "content": question}])
    assert 0 < e.cache_boundary < len(e.tokens)
    return EngineRequest(question, e.tokens, SamplingParams(max_tokens=24), cache_boundary=e.cache_boundary)


def test_text_prompts_sharing_a_prefix_match_uncached_generation(lm: Any, stream: mx.Stream) -> None:
    tokenizer = lm[1]
    base = "the queue server batches the model tokens and " * 12
    prompts = {f"t{i}": list(tokenizer.encode(base + tail)) for i, tail in enumerate(
        ["streams them back", "cancels the late ones", "keeps the cache warm"])}
    s = make(lm, stream, PrefixCache(64 << 20))
    run = Run()
    for rid, p in prompts.items():  # one after another: each later one starts from the earlier ones' caches
        s.add(EngineRequest(rid, p, SamplingParams(max_tokens=30)))
        drive(s, run, stream)
    shared = len(tokenizer.encode(base)) - 1
    assert s.stats.prefix_misses == 1 and s.stats.prefix_hits == 2
    assert s.stats.prefix_tokens_saved >= 2 * shared
    for rid, p in prompts.items():
        assert run.tokens(rid) == reference(lm, p, 30), rid


def test_the_system_prompt_is_cached_at_its_boundary_and_reused_by_other_chats(lm: Any, stream: mx.Stream) -> None:
    layout = measure_layout(lm[0])
    s = make(lm, stream, PrefixCache(64 << 20))
    run = Run()
    first = chat(lm, "What is a queue?")
    s.add(first)
    drive(s, run, stream, until=lambda: len(run.tokens(first.rid)) >= 2)
    # Prefilled past the system prompt: its cache is stored, exactly that long.
    assert s.stats.prefix_cache_entries == 1
    assert s.stats.prefix_cache_bytes == first.cache_boundary * layout.bytes_per_token
    second = chat(lm, "Why batch tokens?")
    s.add(second)
    drive(s, run, stream)
    assert s.stats.prefix_hits == 1 and s.stats.prefix_tokens_saved == second.cache_boundary
    third = chat(lm, "And the cache?")  # now from a finished conversation's cache, trimmed to what it shares
    s.add(third)
    drive(s, run, stream)
    assert s.stats.prefix_hits == 2 and s.stats.prefix_tokens_saved >= 2 * second.cache_boundary
    for r in (first, second, third):
        assert run.tokens(r.rid) == reference(lm, r.prompt_tokens, 24), r.rid


def test_a_requests_start_reports_the_prompt_tokens_its_prefix_hit_took(lm: Any, stream: mx.Stream) -> None:
    tokenizer = lm[1]
    base = "the queue server batches the model tokens and " * 12
    s = make(lm, stream, PrefixCache(64 << 20))
    run = Run()
    for rid, tail in (("a", "streams them back"), ("b", "keeps the cache warm")):
        s.add(EngineRequest(rid, list(tokenizer.encode(base + tail)), SamplingParams(max_tokens=8)))
        drive(s, run, stream)
    started = {rid: [o for o in run.outputs[rid] if o.started] for rid in "ab"}
    assert [o.cached_tokens for o in started["a"]] == [0]  # nothing cached yet: all of it prefilled
    (b,) = started["b"]
    assert b.cached_tokens == s.stats.prefix_tokens_saved >= len(tokenizer.encode(base)) - 1


def test_an_exact_hit_feeds_the_last_token_again(lm: Any, stream: mx.Stream) -> None:
    tokenizer = lm[1]
    s = make(lm, stream, PrefixCache(64 << 20))
    run = Run()
    prompt = list(tokenizer.encode("continue the story of the queue and the model " * 8))
    s.add(EngineRequest("a", prompt, SamplingParams(max_tokens=16)))
    drive(s, run, stream)
    follow = prompt + run.tokens("a")  # exactly the key the finished sequence was stored under
    s.add(EngineRequest("b", follow, SamplingParams(max_tokens=16)))
    drive(s, run, stream)
    assert run.final("b").finish is FinishReason.LENGTH
    assert s.stats.prefix_hits == 1 and s.stats.prefix_tokens_saved == len(follow) - 1
    assert run.tokens("b") == reference(lm, follow, 16)


def test_the_cache_stays_within_its_byte_bound(lm: Any, stream: mx.Stream) -> None:
    tokenizer = lm[1]
    layout = measure_layout(lm[0])
    bound = 400 * layout.bytes_per_token  # room for about three of these sequences
    cache = PrefixCache(bound)
    s = make(lm, stream, cache)
    run = Run()
    for i in range(8):
        s.add(EngineRequest(f"r{i}", list(tokenizer.encode(f"request number {i} " * 9)),
                            SamplingParams(max_tokens=30)))
        drive(s, run, stream)
        assert 0 < cache.nbytes <= bound and s.stats.prefix_cache_bytes == cache.nbytes
    assert 1 < len(cache) < 8
    entries = len(cache)
    big = SequenceCache([ToyCache(30_000)], list(range(30_000)))  # larger than the bound: not stored at all
    assert big.nbytes > bound
    cache.store([big], "assistant")
    assert len(cache) == entries and cache.fetch(list(range(30_000))) is None


def test_cancelled_and_failed_requests_give_their_memory_back(lm: Any, stream: mx.Stream) -> None:
    tokenizer = lm[1]
    s = make(lm, stream, PrefixCache(64 << 20))
    run = Run()
    for i in range(3):
        s.add(EngineRequest(f"r{i}", list(tokenizer.encode(f"a long running request {i}")),
                            SamplingParams(max_tokens=200)))
    drive(s, run, stream, until=lambda: len(run.tokens("r2")) >= 5)
    assert s.stats.kv_bytes > 0
    s.abort("r0")
    s.abort("r1")
    assert 0 < s.stats.kv_bytes == s.backend.kv_bytes()  # type: ignore[attr-defined]
    s.abort("r2")
    assert s.stats.kv_bytes == 0 == s.backend.kv_bytes()  # type: ignore[attr-defined]
    s.add(EngineRequest("r3", list(tokenizer.encode("one more")), SamplingParams(max_tokens=200)))
    drive(s, run, stream, until=lambda: len(run.tokens("r3")) >= 5)
    outs = s.fail_all("engine_error", "boom")
    assert [o.rid for o in outs] == ["r3"]
    assert s.stats.kv_bytes == 0 and s.stats.prefix_cache_bytes == 0 and s.stats.prefix_cache_entries == 0


def test_fetch_never_returns_an_empty_remainder() -> None:
    cache = PrefixCache(1 << 20, min_tokens=2)
    cache.store([SequenceCache([ToyCache(5)], [1, 2, 3, 4, 5])], "assistant")
    hit = cache.fetch([1, 2, 3, 4, 5])
    assert hit is not None and hit.tokens == 4 and hit.cache[0].offset == 4  # trimmed: one token left to feed
    cache.store([SequenceCache([ToyCache(3, trimmable=False)], [7, 8, 9])], "assistant")
    assert cache.fetch([7, 8, 9]) is None  # an untrimmable exact hit: prefill it all
    hit = cache.fetch([7, 8, 9, 10])
    assert hit is not None and hit.tokens == 3
    assert (cache.hits, cache.misses, cache.tokens_saved) == (2, 1, 7)


def test_short_prompts_are_neither_looked_up_nor_stored() -> None:
    cache = PrefixCache(1 << 20, min_tokens=8)
    cache.store([SequenceCache([ToyCache(7)], list(range(7)))], "assistant")
    assert len(cache) == 0
    cache.store([SequenceCache([ToyCache(8)], list(range(8)))], "assistant")
    assert len(cache) == 1
    assert cache.fetch(list(range(8))) is None  # not longer than min_tokens: not even looked up
    assert cache.fetch([0, 1, 2, 3, 99, 98, 97, 96, 95]) is None  # a 4-token hit: not worth its copy
    hit = cache.fetch([*range(8), 42])
    assert hit is not None and hit.tokens == 8
    assert (cache.hits, cache.misses) == (1, 1)
