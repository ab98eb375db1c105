"""Helpers for the engine tests that run a real tiny MLX model (the fakes' tests import none of this)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxq.engine.core.request import EngineRequest, RequestOutput, SamplingParams
from mlxq.engine.core.scheduler import Scheduler
from mlxq.engine.core.stats import EngineStats
from mlxq.engine.mlx.loader import EngineOptions, start_engine
from mlxq.worker.tools.tinymodel import corpus
from tests.engine.fakes import Clock, Run

# A scheduler's clock for tests that preempt on a real model: arrival order only. On the wall clock a prefill slowed
# by a loaded machine ages a running request past a priority level (``aging_s``, a second), and the preemption the
# test expects does not happen.
still = Clock(0.0)


def drive(s: Scheduler, run: Run, stream: mx.Stream, until: Any = None, steps: int = 2000) -> None:
    """Step ``s`` on ``stream`` (the MLX thread's part, here in the test's thread) until it has no work left, or
    ``until()`` holds; fails after ``steps`` steps."""
    with mx.stream(stream):
        for _ in range(steps):
            if not s.has_work or (until is not None and until()):
                return
            run.step(s)
    raise AssertionError("did not finish")


class Outputs:
    """Every request's outputs, gathered on the event loop from the engine's MLX thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.run = Run()
        self.changed = asyncio.Event()

    def sink(self, outs: list[RequestOutput]) -> None:  # on the MLX thread
        self.loop.call_soon_threadsafe(self._add, outs)

    def _add(self, outs: list[RequestOutput]) -> None:
        self.run.feed(outs)
        self.changed.set()

    async def finished(self, rid: str) -> None:
        async with asyncio.timeout(60):
            while not any(o.finish is not None for o in self.run.outputs.get(rid, [])):
                self.changed.clear()
                await self.changed.wait()


async def on_disk(path: Path, options: EngineOptions, outputs: Outputs, first: EngineRequest) -> None:
    """Run ``first`` on a fresh engine with the disk tier ``options`` name, until its entries are on disk (the
    writer flushed), and close that engine: the next engine on the same directory starts warm from disk alone."""
    engine, _ = await start_engine(str(path), outputs.sink, options)
    try:
        engine.add(first)
        await outputs.finished(first.rid)
        disk = engine.scheduler.prefix_cache.disk  # type: ignore[union-attr]
        assert await asyncio.to_thread(disk.flush)
    finally:
        await engine.aclose()


async def from_disk(path: Path, options: EngineOptions, outputs: Outputs, turn: EngineRequest) -> EngineStats:
    """Run ``turn`` on a fresh engine (its memory empty: what it reuses comes from the disk tier ``options``
    name) and close it; its stats."""
    engine, _ = await start_engine(str(path), outputs.sink, options)
    try:
        engine.add(turn)
        await outputs.finished(turn.rid)
        return engine.stats
    finally:
        await engine.aclose()


def preempt_for_high(s: Scheduler, run: Run, stream: mx.Stream, low: list[list[int]], high: list[int],
                     max_tokens: int) -> None:
    """The preemption scenario: ``low`` (two rows, ``low0`` and ``low1``, of 3 x ``max_tokens`` each) fill a batch
    of two; once ``low1`` has made ``max_tokens``, ``high`` (priority 1, ``max_tokens``) arrives and takes a row's
    place; then every request runs to its end."""
    for i, p in enumerate(low):
        s.add(EngineRequest(f"low{i}", p, SamplingParams(max_tokens=3 * max_tokens)))
    drive(s, run, stream, until=lambda: len(run.tokens("low1")) >= max_tokens)
    s.add(EngineRequest("high", high, SamplingParams(max_tokens=max_tokens), priority=1))
    drive(s, run, stream)


def words(tokenizer: Any, n: int, seed: int = 0) -> list[int]:
    """``n`` tokens of the generated models' corpus: varied text (a random model given a repetitive prompt soon
    repeats one token, and a comparison of such outputs says little)."""
    return list(tokenizer.encode(" ".join(corpus(seed + 1, n_lines=n))))[:n]
