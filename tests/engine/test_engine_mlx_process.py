"""MLX's process-global state (engine/mlx/process.py): the wired limit is set once per process, whatever order
the engines' batches are made and closed in; a failed batch is closed before its replacement; nothing of
mlxq's clears MLX's cache per engine; a backend without caches reserves no prefix-cache memory.

The machine here has no Metal: the device is made to report a recommended working set and
``mx.set_wired_limit`` records its calls (on the CPU it is a no-op)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import mlxq.engine.mlx.process
from mlxq.engine.core.engine import Engine
from mlxq.engine.core.memory import default_headroom, default_prefix_cache_bytes
from mlxq.engine.core.request import EngineRequest, RequestOutput, SamplingParams
from mlxq.engine.mlx.loader import start_engine
from mlxq.engine.mlx.memory import measure_layout, model_bytes, usable_memory_bytes
from mlxq.engine.mlx.process import MLXLimits, mlx_process

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RECOMMENDED = 3 << 30


@dataclass
class Wired:
    """MLX's wired limit as a fake Metal device keeps it: every set, and the limit now."""

    limit: int = 0
    sets: list[int] = field(default_factory=list)

    def set(self, limit: int) -> int:
        old, self.limit = self.limit, limit
        self.sets.append(limit)
        return old


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wired]:
    """A device reporting a recommended working set, a recording wired limit, and a process whose MLX owner
    is not made yet."""
    state = Wired()
    info = mx.device_info()
    monkeypatch.setattr(mx, "device_info", lambda: {**info, "max_recommended_working_set_size": RECOMMENDED})
    monkeypatch.setattr(mx, "set_wired_limit", state.set)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)  # mlx-vlm wires only on Metal
    monkeypatch.setattr(mlxq.engine.mlx.process, "_owner", None)
    yield state


class Ends:
    """The engines' finished requests, gathered on the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.done: dict[str, RequestOutput] = {}
        self.changed = asyncio.Event()

    def sink(self, outs: list[RequestOutput]) -> None:  # on an MLX thread
        self.loop.call_soon_threadsafe(self._add, outs)

    def _add(self, outs: list[RequestOutput]) -> None:
        self.done.update((o.rid, o) for o in outs if o.finish is not None)
        self.changed.set()

    async def wait(self, rid: str) -> RequestOutput:
        async with asyncio.timeout(60):
            while rid not in self.done:
                self.changed.clear()
                await self.changed.wait()
        return self.done[rid]


def closes(engine: Engine) -> list[str]:
    """Record when the engine's current batch is closed (it still closes)."""
    calls: list[str] = []
    batch = engine.scheduler.backend
    close = batch.close

    def recording() -> None:
        calls.append(type(batch).__name__)
        close()

    batch.close = recording  # type: ignore[method-assign]
    return calls


async def fail_a_step(engine: Engine, ends: Ends, rid: str) -> None:
    """Make the engine's next step fail (with a request in it) and wait for that request to fail."""
    def broken() -> Any:
        raise RuntimeError("[metal] command buffer failed")

    engine.scheduler.backend.step = broken  # type: ignore[method-assign]
    engine.add(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=3)))
    assert (await ends.wait(rid)).error_code == "engine_error"
    await engine.thread.call(lambda: None)  # the failed tick has left the thread: the batch is rebuilt


async def test_two_engines_set_the_wired_limit_once_whatever_order_their_batches_come_and_go(
        wired: Wired, tiny_model: Path, tiny_vlm: Path) -> None:
    ends = Ends()
    text, _ = await start_engine(str(tiny_model), ends.sink)
    vision, _ = await start_engine(str(tiny_vlm), ends.sink)
    try:
        assert wired.sets == [RECOMMENDED]  # by the first engine's build; the second found it set
        text_closes, vision_closes = closes(text), closes(vision)
        # The first batches made go first, out of LIFO order (text, then vision), each replaced after a failure.
        await fail_a_step(text, ends, "t-fail")
        await fail_a_step(vision, ends, "v-fail")
        assert text_closes == ["MLXBatch"] and vision_closes == ["VLMBatch"]  # closed, not left to the GC
        for rid, eng in (("t-ok", text), ("v-ok", vision)):  # the rebuilt batches serve
            eng.add(EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4)))
            assert (await ends.wait(rid)).completion_tokens == 4
        await text.thread.call(text.scheduler.backend.close)  # the text engine's second batch, then vision's
        await vision.thread.call(vision.scheduler.backend.close)
        assert wired.sets == [RECOMMENDED] and wired.limit == RECOMMENDED
        assert mlx_process().wired_bytes == RECOMMENDED
    finally:
        await text.aclose()
        await vision.aclose()


def test_the_process_owner_is_made_once_and_keeps_its_first_limits(
        wired: Wired, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    memory: list[int] = []
    cache: list[int] = []
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: memory.append(n) or 0)
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: cache.append(n) or 0)
    first = mlx_process(MLXLimits(memory_bytes=8 << 30, cache_bytes=1 << 30))
    assert mlx_process() is first and mlx_process(MLXLimits(memory_bytes=8 << 30, cache_bytes=1 << 30)) is first
    assert mlx_process(MLXLimits(cache_bytes=0)) is first
    assert "ignored" in caplog.text
    assert (wired.sets, memory, cache) == ([RECOMMENDED], [8 << 30], [1 << 30])


def test_without_a_recommended_working_set_no_wired_limit_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    sets: list[int] = []
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "cpu"})  # as on Linux
    monkeypatch.setattr(mx, "set_wired_limit", sets.append)
    monkeypatch.setattr(mlxq.engine.mlx.process, "_owner", None)
    assert mlx_process().wired_bytes is None and sets == []


def test_only_the_process_owner_sets_mlx_process_state_and_nothing_clears_its_cache() -> None:
    """The libraries' own ``mx.clear_cache`` calls stay (engine/mlx/process.py says why); mlxq adds one, after a
    model loaded on demand is unloaded (engine/mlx/residency.py: its weights go back to the system)."""
    setters = ("set_wired_limit(", "set_memory_limit(", "set_cache_limit(")
    for package in ("engine", "worker", "api"):
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            if path != ROOT / "engine" / "mlx" / "residency.py":
                assert "clear_cache(" not in source, path
            if path != ROOT / "engine" / "mlx" / "process.py":
                assert not any(s in source for s in setters), path


async def test_a_backend_without_caches_reserves_no_prefix_cache_memory(tiny_model: Path, tiny_vlm: Path) -> None:
    ends = Ends()
    vision, loaded = await start_engine(str(tiny_vlm), ends.sink)
    text, _ = await start_engine(str(tiny_model), ends.sink)
    try:
        assert not vision.scheduler.backend.supports_caches  # type: ignore[attr-defined]
        layout = await vision.thread.call(measure_layout, loaded.model)
        usable, weights = usable_memory_bytes(), model_bytes(loaded.model)
        assert vision.scheduler.prefix_cache is None
        assert vision.stats.kv_headroom_bytes == default_headroom(usable, weights, 0, layout, loaded.context_length)
        assert text.scheduler.prefix_cache is not None  # a text model's engine keeps its prefix cache
        assert text.scheduler.prefix_cache.max_bytes == default_prefix_cache_bytes(usable)
    finally:
        await vision.aclose()
        await text.aclose()
