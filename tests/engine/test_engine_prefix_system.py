"""A system prompt shared by many prompts on the prefix cache's tier on disk (engine/mlx/prefix/): its checkpoint,
when its prompt names a key for it alone (``EngineRequest.system_key``), is written at once and kept, never
superseded by a turn's entry (that entry is one conversation's); after a restart (even a crash) it is still there,
carries its key (so the worker advertises it) and serves another prompt with that system prompt, with the greedy
tokens of a cold prefill. A checkpoint no key names is superseded as before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mlxq.engine.core.engine import Engine
from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.engine.core.request import EngineRequest, SamplingParams
from mlxq.engine.mlx.loader import start_engine
from mlxq.engine.mlx.prefix.disk import PrefixDisk
from tests.engine.test_engine_prefix_disk import MAX_TOKENS, Outputs, an_entry, disk_of, lm, options, outputs
from tests.support import reference

__all__ = ["lm", "outputs"]  # the fixtures, shared with the disk tier's tests

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "You are the model queue server. Answer in tokens, briefly. " * 6}


def single_turn(lm: Any, question: str) -> tuple[list[int], int]:
    """A single-turn chat prompt (the shared system prompt and one question) and its system prompt's boundary."""
    e = encode_prompt_with_boundary(lm[1], None, [SYSTEM, {"role": "user", "content": question}])
    assert 64 < e.cache_boundary < len(e.tokens)  # a checkpoint worth keeping (the prefix cache's min_tokens)
    return e.tokens, e.cache_boundary


async def answer(engine: Engine, outputs: Outputs, rid: str, prompt: list[int], boundary: int,
                 system_key: str) -> list[int]:
    engine.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS), cache_boundary=boundary,
                             affinity=f"conv-{rid}", system_key=system_key))
    async with asyncio.timeout(60):
        while rid not in outputs.final:
            outputs.changed.clear()
            await outputs.changed.wait()
    return outputs.tokens[rid]


async def test_a_shared_system_checkpoint_stays_on_disk_and_serves_another_prompt_after_a_crash(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs) -> None:
    first, boundary = single_turn(lm, "What is a queue?")
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    await answer(engine, outputs, "one", first, boundary, "sys-1")
    assert await asyncio.to_thread(disk_of(engine).flush)
    assert len(disk_of(engine)) == 2  # the turn's entry and its system prompt's checkpoint, kept beside it
    await asyncio.to_thread(disk_of(engine).close, 0.0)  # as a killed worker: nothing handed over at the stop
    await engine.thread.aclose()

    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        tagged = engine.prefix_tagged()  # before any request: from the index read at the start
        assert dict(tagged)["sys-1"][:boundary] == first[:boundary]  # advertised by a restarted worker
        assert disk_of(engine).has(first[:boundary])  # the checkpoint of the system prompt alone is still there
        other, same = single_turn(lm, "Why batch the tokens of many requests?")
        assert same == boundary and other[:boundary] == first[:boundary]
        assert (await engine.prefix_holds([other[:boundary]])) == [True]
        tokens = await answer(engine, outputs, "two", other, boundary, "sys-1")
        stats = engine.stats
        assert stats.prefix_disk_hits == 1 and stats.prefix_tokens_saved >= boundary - 1
        assert await asyncio.to_thread(disk_of(engine).flush)
        assert len(disk_of(engine)) == 3  # two turns' entries, and the checkpoint still there
    finally:
        await engine.aclose()
    assert tokens == reference(lm, other, MAX_TOKENS)


def test_a_shared_checkpoint_is_never_superseded_by_a_longer_entry_even_after_a_reopen(lm: Any,
                                                                                       tmp_path: Path) -> None:
    cache = an_entry(lm)
    system, turn, later = list(range(100, 180)), list(range(100, 200)), list(range(100, 220))
    disk = PrefixDisk(tmp_path, 1 << 30, defer_s=600.0)  # a deferred write would wait past the test
    try:
        assert disk.save(system, cache, "system", True, keys=("sys",), defer=True, shared=True)
        assert disk.save(turn, cache, "assistant", True, keys=("conv",))
        assert disk.flush() and disk.counts.writes == 2 and disk.has(system) and disk.has(turn)
    finally:
        disk.close()
    reopened = PrefixDisk(tmp_path, 1 << 30, defer_s=600.0)
    try:
        assert reopened.has(system) and reopened.has(turn)
        assert reopened.save(later, cache, "assistant", True)  # supersedes the turn, not the shared checkpoint
        assert reopened.flush() and reopened.has(system) and not reopened.has(turn) and len(reopened) == 2
        assert dict(reopened.tagged())["sys"] == system
        hit = reopened.lookup([*system, 1])  # a prompt sharing only the system prompt: the checkpoint serves it
        assert hit is not None and hit.tokens == len(system)
    finally:
        reopened.close()
