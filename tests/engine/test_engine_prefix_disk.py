"""The prefix cache's tier on disk (engine/mlx/prefix/) with real engines on the real tiny model: an engine
started over the directory another left (after a graceful stop, or none: a crash) starts a conversation's next
turn from its prefix on disk and generates exactly the greedy tokens of a cold prefill; a corrupt entry is
logged once and prefilled cold; a half-written file is never read; a disk that fails writes turns writing off
with one log line and every job ends well; the tier stays within its bounds; another model never reads the
entries."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import mlxq.engine.mlx.prefix.disk as prefix_disk
from mlxq.engine.core.engine import Engine
from mlxq.engine.core.prompt import encode_prompt_with_boundary
from mlxq.engine.core.request import EngineRequest, FinishReason, RequestOutput, SamplingParams
from mlxq.engine.mlx.loader import EngineOptions, start_engine
from mlxq.engine.mlx.prefix.cache import PrefixCache
from mlxq.engine.mlx.prefix.directory import model_key, namespace
from mlxq.engine.mlx.prefix.disk import PrefixDisk
from mlxq.engine.mlx.prefix.trie import below, reach
from tests.support import reference

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "You are the model queue server. Answer in tokens. " * 8}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(tiny_model))


class Outputs:
    """Every request's tokens and final output, gathered on the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.changed = asyncio.Event()

    def sink(self, outs: list[RequestOutput]) -> None:  # on the MLX thread
        self.loop.call_soon_threadsafe(self._add, outs)

    def _add(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            self.tokens.setdefault(o.rid, []).extend(o.token_ids)
            if o.finish is not None:
                self.final[o.rid] = o
        self.changed.set()

    async def run(self, engine: Engine, rid: str, prompt: list[int], key: str = "") -> list[int]:
        engine.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS), affinity=key))
        async with asyncio.timeout(60):
            while rid not in self.final:
                self.changed.clear()
                await self.changed.wait()
        assert self.final[rid].finish in (FinishReason.LENGTH, FinishReason.STOP), self.final[rid]
        return self.tokens[rid]


@pytest.fixture
async def outputs() -> AsyncIterator[Outputs]:
    yield Outputs()


def options(kv_dir: Path, disk_bytes: int = 256 << 20) -> EngineOptions:
    return EngineOptions(capacity=4, prefill_step_size=64, prefix_cache_bytes=64 << 20, kv_disk_bytes=disk_bytes,
                         kv_dir=str(kv_dir))


def disk_of(engine: Engine) -> PrefixDisk:
    prefix = engine.scheduler.prefix_cache
    assert isinstance(prefix, PrefixCache) and prefix.disk is not None
    return prefix.disk


def first_turn(lm: Any) -> list[int]:
    e = encode_prompt_with_boundary(lm[1], None, [SYSTEM, {"role": "user", "content": "What is a queue?"}])
    return e.tokens


def next_turn(lm: Any, prompt: list[int], answer: list[int]) -> list[int]:
    return prompt + answer + list(lm[1].encode(" And why batch the tokens of many requests together?"))


async def a_conversation_on_disk(lm: Any, tiny_model: Path, kv_dir: Path, outputs: Outputs,
                                 graceful: bool = True, key: str = "") -> tuple[list[int], list[int]]:
    """An engine answers a conversation's first turn (of affinity ``key``) and stops (``graceful``) or is
    stopped as a killed worker is (no prefix handed to the disk at the stop: only what was written meanwhile is
    there); the turn's prompt and answer."""
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(kv_dir))
    try:
        prompt = first_turn(lm)
        answer = list(await outputs.run(engine, "turn-1", prompt, key))
        assert await asyncio.to_thread(disk_of(engine).flush)
        assert len(disk_of(engine)) == 1  # the whole turn; its system-prompt checkpoint, a prefix of it, superseded
    finally:
        if graceful:
            await engine.aclose()
    if not graceful:
        await asyncio.to_thread(disk_of(engine).close, 0.0)
        await engine.thread.aclose()
    return prompt, answer


@pytest.mark.parametrize("graceful", [True, False], ids=["stopped", "crashed"])
async def test_a_restarted_engine_starts_the_next_turn_from_disk_with_the_same_tokens(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs, graceful: bool) -> None:
    prompt, answer = await a_conversation_on_disk(lm, tiny_model, tmp_path, outputs, graceful)
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        follow = next_turn(lm, prompt, answer)
        tokens = await outputs.run(engine, "turn-2", follow)
        stats = engine.stats
        assert stats.prefix_disk_hits == 1 and stats.prefix_hits == 1 and stats.prefix_disk_errors == 0
        assert stats.prefix_tokens_saved >= len(prompt)
    finally:
        await engine.aclose()
    assert tokens == reference(lm, follow, MAX_TOKENS)


@pytest.mark.parametrize("graceful", [True, False], ids=["stopped", "crashed"])
async def test_a_restarted_engine_lists_the_affinity_keys_its_entries_on_disk_carry(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs, graceful: bool) -> None:
    prompt, answer = await a_conversation_on_disk(lm, tiny_model, tmp_path, outputs, graceful, key="conv-1")
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        ((key, tokens),) = engine.prefix_tagged()  # before any request: from the index read at the start
        assert key == "conv-1" and tokens == prompt + answer[:len(tokens) - len(prompt)]
        await outputs.run(engine, "untagged", first_turn(lm)[::-1])  # a request without a key adds none
        assert await asyncio.to_thread(disk_of(engine).flush)
        assert [k for k, _ in engine.prefix_tagged()] == ["conv-1"] and len(disk_of(engine)) == 2
    finally:
        await engine.aclose()


async def test_a_corrupt_entry_is_logged_once_and_prefilled_cold(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs, caplog: pytest.LogCaptureFixture) -> None:
    prompt, answer = await a_conversation_on_disk(lm, tiny_model, tmp_path, outputs)
    (entry,) = [p for p in tmp_path.rglob("*.kv.safetensors")]
    data = bytearray(entry.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 32):  # flip bytes in the arrays' data (the trailer stays)
        data[i] ^= 0xFF
    entry.write_bytes(bytes(data))
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        follow = next_turn(lm, prompt, answer)
        with caplog.at_level(logging.WARNING, logger=prefix_disk.__name__):
            first = await outputs.run(engine, "turn-2", follow)
            again = await outputs.run(engine, "turn-2-again", follow)  # from memory now (turn-2's own entry)
        stats = engine.stats
        assert stats.prefix_disk_errors == 1 and stats.prefix_disk_hits == 0
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "unreadable" in caplog.records[0].message and len(caplog.records) == 1
        assert not entry.exists()
    finally:
        await engine.aclose()
    assert first == again == reference(lm, follow, MAX_TOKENS)


async def test_a_half_written_file_is_never_read(lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs) -> None:
    prompt, answer = await a_conversation_on_disk(lm, tiny_model, tmp_path, outputs)
    (entry,) = [p for p in tmp_path.rglob("*.kv.safetensors")]
    half = entry.with_name(entry.name.replace(".kv.", ".1.2.tmp."))  # a write killed before its rename
    half.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    entry.unlink()
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        assert not half.exists() and len(disk_of(engine)) == 0  # deleted at the start, never indexed
        follow = next_turn(lm, prompt, answer)
        tokens = await outputs.run(engine, "turn-2", follow)
        assert engine.stats.prefix_disk_hits == 0 and engine.stats.prefix_disk_errors == 0
    finally:
        await engine.aclose()
    assert tokens == reference(lm, follow, MAX_TOKENS)


async def test_a_full_disk_turns_writing_off_with_one_log_line_and_jobs_end_well(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path, *entry: Any) -> int:
        path.write_bytes(b"what fitted")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_disk, "write_file", full)
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, logger=prefix_disk.__name__):
            prompt = first_turn(lm)
            for i in range(3):
                assert await outputs.run(engine, f"r{i}", prompt) == reference(lm, prompt, MAX_TOKENS)
            await asyncio.to_thread(disk_of(engine).flush)
        assert [r.message for r in caplog.records if "writing off" in r.message] == [caplog.records[0].message]
        assert len(caplog.records) == 1 and "the disk is full" in caplog.records[0].message
        assert not disk_of(engine).writable and len(disk_of(engine)) == 0
        assert not list(tmp_path.rglob("*.tmp*")) and not list(tmp_path.rglob("*.kv.safetensors"))
    finally:
        await engine.aclose()


async def test_a_directory_that_cannot_be_made_turns_the_tier_off_and_jobs_end_well(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory would go")
    with caplog.at_level(logging.WARNING, logger=prefix_disk.__name__):
        engine, _ = await start_engine(str(tiny_model), outputs.sink, options(blocker))
    try:
        assert len([r for r in caplog.records if "off" in r.message]) == 1
        prompt = first_turn(lm)
        assert await outputs.run(engine, "r", prompt) == reference(lm, prompt, MAX_TOKENS)
        assert not disk_of(engine).writable and not disk_of(engine).readable
    finally:
        await engine.aclose()


async def test_the_tier_stays_within_its_byte_bound_least_recently_used_out_first(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs) -> None:
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path, 1 << 30))
    try:
        await outputs.run(engine, "sizer", list(lm[1].encode("request number zero " * 12)))
        assert await asyncio.to_thread(disk_of(engine).flush)
        one = disk_of(engine).nbytes
    finally:
        await engine.aclose()
    bound = int(one * 2.5)
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path, bound))
    try:
        disk = disk_of(engine)
        for i in range(1, 6):
            await outputs.run(engine, f"r{i}", list(lm[1].encode(f"request number {i} " * 12)))
            assert await asyncio.to_thread(disk.flush)
            on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv.safetensors"))
            assert 0 < disk.nbytes == on_disk <= bound
        assert 2 <= len(disk) < 5
        latest, oldest = (list(lm[1].encode(f"request number {i} " * 12)) for i in (5, 1))
        hit = disk.lookup([*latest, 1])
        assert hit is not None and hit.tokens >= len(latest)
        hit = disk.lookup([*oldest, 1])
        assert hit is None or hit.tokens < len(oldest) // 2  # at most the words all of them share
    finally:
        await engine.aclose()


def test_another_model_never_reads_the_entries(tiny_model: Path, tmp_path: Path) -> None:
    key = model_key(str(tiny_model))
    assert key is not None and model_key(str(tiny_model)) == key
    same = tmp_path / "same"
    shutil.copytree(tiny_model, same)  # copy2: the same names, sizes and mtimes
    assert model_key(str(same)) == key
    config = tmp_path / "config"
    shutil.copytree(tiny_model, config)
    (config / "config.json").write_text((config / "config.json").read_text().replace("{", '{"changed": 1, ', 1))
    weights = tmp_path / "weights"
    shutil.copytree(tiny_model, weights)
    (weights / "model.safetensors").touch()  # re-written weights
    keys = {key, model_key(str(config)), model_key(str(weights))}
    assert len(keys) == 3 and None not in keys
    dirs = {namespace(tmp_path, str(k), "layout") for k in keys} | {namespace(tmp_path, key, "other-layout")}
    assert len(dirs) == 4
    assert model_key(str(tmp_path / "nowhere")) is None


async def test_a_request_aborted_while_its_prefix_loads_ends_once(
        lm: Any, tiny_model: Path, tmp_path: Path, outputs: Outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, answer = await a_conversation_on_disk(lm, tiny_model, tmp_path, outputs)
    gate = asyncio.Event()
    read = PrefixDisk._read

    def slow(self: PrefixDisk, key: str) -> None:  # the reader thread waits until the abort is in
        asyncio.run_coroutine_threadsafe(gate.wait(), outputs.loop).result(30)
        read(self, key)

    monkeypatch.setattr(PrefixDisk, "_read", slow)
    engine, _ = await start_engine(str(tiny_model), outputs.sink, options(tmp_path))
    try:
        follow = next_turn(lm, prompt, answer)
        engine.add(EngineRequest("gone", follow, SamplingParams(max_tokens=MAX_TOKENS)))
        await asyncio.sleep(0.2)
        engine.abort("gone")
        async with asyncio.timeout(30):
            while "gone" not in outputs.final:
                outputs.changed.clear()
                await outputs.changed.wait()
        gate.set()
        assert outputs.final["gone"].finish is FinishReason.CANCELLED and outputs.tokens["gone"] == []
        assert await outputs.run(engine, "next", follow) == reference(lm, follow, MAX_TOKENS)
        assert engine.claim_capacity() == engine.scheduler.room.admissible
    finally:
        gate.set()
        await engine.aclose()


@pytest.mark.parametrize("collector", [True, False], ids=["collector-on", "collector-off"])
def test_the_index_is_read_at_the_start_and_the_collector_left_as_it_was(lm: Any, tmp_path: Path,
                                                                         collector: bool) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm[0])
    lm[0](mx.array([list(range(80))]), cache=cache)
    mx.eval([c.state for c in cache])
    prompts = [[i, *range(100, 180)] for i in range(3)]  # the scan reads trailers: their tokens are what it indexes
    disk = PrefixDisk(tmp_path, 1 << 30)
    assert all(disk.save(p, cache, "assistant", True) for p in prompts)
    disk.close()
    was = gc.isenabled()
    (gc.enable if collector else gc.disable)()
    try:
        reopened = PrefixDisk(tmp_path, 1 << 30)  # the collector is paused while it builds the index
        assert gc.isenabled() is collector
    finally:
        (gc.enable if was else gc.disable)()
    try:
        assert len(reopened) == 3
        for p in prompts:
            hit = reopened.lookup(p)
            assert hit is not None and hit.tokens == len(p)
    finally:
        reopened.close()


def an_entry(lm: Any) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm[0])
    lm[0](mx.array([list(range(80))]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_a_deferred_checkpoint_superseded_by_its_turn_is_never_written(lm: Any, tmp_path: Path) -> None:
    cache = an_entry(lm)
    system, turn, other = list(range(100, 180)), list(range(100, 200)), [7, *range(100, 180)]
    disk = PrefixDisk(tmp_path, 1 << 30, defer_s=600.0)  # only the turn's entry or the flush ends the wait
    try:
        assert disk.save(system, cache, "system", True, defer=True) and disk.has(system)  # on its way
        assert disk.save(other, cache, "system", True, defer=True)  # no turn supersedes it: written at the flush
        assert disk.save(turn, cache, "assistant", True)
        assert disk.flush()
        assert disk.counts.writes == 2 and len(disk) == 2 and not disk.has(system)
        assert sorted(len(p.name) for p in tmp_path.iterdir()) == [len(f"{'0' * 40}.kv.safetensors")] * 2
        hit = disk.lookup([*system, 1])  # the turn's entry holds the checkpoint's tokens
        assert hit is not None and hit.tokens == len(system)
        hit = disk.lookup([*other, 1])
        assert hit is not None and hit.tokens == len(other)
    finally:
        disk.close()


async def test_a_deferred_checkpoint_no_turn_supersedes_is_written_after_its_wait(lm: Any, tmp_path: Path) -> None:
    cache = an_entry(lm)
    disk = PrefixDisk(tmp_path, 1 << 30, defer_s=0.05)
    try:
        assert disk.save(list(range(100, 180)), cache, "system", True, defer=True)
        async with asyncio.timeout(30):  # its timer hands it to the writer: no flush, no other save
            while disk.counts.writes == 0:
                await asyncio.sleep(0.02)
        assert len(disk) == 1 and len(list(tmp_path.glob("*.kv.safetensors"))) == 1
    finally:
        disk.close()


def test_one_walk_down_the_trie_holds_what_mlx_lm_s_search_finds() -> None:
    """reach() (the heartbeat's and the lookups' walk) answers as mlx-lm's PromptTrie.search on random tries:
    the tokens held (an exact entry, a shorter one, or a longer one trimmed to the common part), and the entry
    below it begins with that common part and is longer."""
    import random

    from mlx_lm.models.cache import PromptTrie

    rng = random.Random(1)
    checked = 0
    for _ in range(200):
        trie, entries = PromptTrie(), []
        for _ in range(rng.randrange(1, 12)):  # entries branching off each other, as prompts' prefixes do
            base = rng.choice(entries) if entries and rng.random() < 0.5 else []
            e = base[:rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            entries.append(e)
            trie.add("m", e, tuple(e))
        for _ in range(20):
            q = rng.choice(entries)[:rng.randrange(1, 10)] + [rng.randrange(4) for _ in range(rng.randrange(4))]
            f, r = trie.search("m", q), reach(trie, "m", q)
            old = len(q) if f.exact is not None else max(len(f.shorter or []),
                                                         f.common_prefix if f.longer is not None else 0)
            assert (len(q) if r.exact is not None else max(r.shorter_len, r.walked)) == old
            if r.exact is None and r.walked > r.shorter_len:
                longer = below(r.node)
                assert list(longer[:r.walked]) == q[:r.walked] and len(longer) > r.walked
                checked += 1
    assert checked > 100
