"""The benchmark's several-models phase: one worker process serving two models (MLXQ_MODELS), each with its own
engine thread and MLX stream.

Runs of N jobs per model, in turn: **sequential** (the first model's N jobs, then the second's, through the
same worker) and **concurrent** (all 2N at once, both engines stepping side by side). concurrent / sequential
throughput says what a second engine in one process buys; the worker process's CPU (cores busy over each run)
says what bounds it. Both models are the same generated model served twice under two names: two engines of
equal weight, so neither finishes early and leaves the other alone.

The same pair without the queue (mlx-lm's ``BatchGenerator`` alone, the raw path's loop) says where the bound
lies: two engines as two MLX threads of this process, and as two processes, each sequential against concurrent.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlxq.api.client import Client
from mlxq.api.schema import DoneEvent, ErrorEvent
from mlxq.worker.tools.bench.runs import SETTLE_S, TIMEOUT_S, paired_median, prompt_batch, say
from mlxq.worker.tools.process import WorkerProcess

from .paths import RawPath, openblas_in_use
from .runs import BenchConfig, Site, Target

__all__ = ["ModelsResult", "md_models", "models_targets", "run_models"]

_ROOT = Path(__file__).resolve().parents[2]  # the checkout
_TARGET = 1.2  # issue 17: concurrent / sequential wall time, or what bounds it:
_OF_BOUND = 0.95  # the share of the one-process bound (mlx-lm alone as two threads, this run) that meets it


@dataclass(frozen=True, slots=True)
class ModelsResult:
    """Two engines in one worker process: seconds per run of 2N jobs, and the worker's cores busy."""

    size: str
    n: int
    blas_threads: str
    sequential_s: list[float]
    concurrent_s: list[float]
    sequential_cores: list[float]
    concurrent_cores: list[float]
    speedup: float  # median over the run pairs of sequential / concurrent wall time
    threads: RawPair  # mlx-lm alone: two engines as two threads of one process
    processes: RawPair  # and as two processes


@dataclass(frozen=True, slots=True)
class RawPair:
    """Two mlx-lm engines without the queue: wall seconds of each sequential and concurrent run of N jobs each."""

    sequential_s: list[float]
    concurrent_s: list[float]

    @property
    def speedup(self) -> float:
        return paired_median(self.sequential_s, self.concurrent_s)


def run_models(cfg: BenchConfig, site: Site) -> ModelsResult:
    """Start a worker serving one generated model twice and time its runs; then the pair without the queue."""
    from mlxq.worker.tools.tinymodel import ensure_model

    size = "small" if "small" in cfg.sizes else cfg.sizes[0]
    path = str(ensure_model(size))
    threads, processes = _raw_pairs(path, cfg)
    prefix = f"mlxq-bench-models-{uuid.uuid4().hex[:6]}"
    # One BLAS thread (one core) per engine: two engines at once would share two cores otherwise.
    env = {"MLXQ_MODELS": f"{path}=a,{path}=b", "MLXQ_REDIS_URL": site.url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(cfg.models_n), "OPENBLAS_NUM_THREADS": "1"}
    log_path = site.out / "logs" / "worker-two-models.log"
    log_path.unlink(missing_ok=True)
    worker = WorkerProcess(env, log_path).start()
    try:
        worker.wait_ready()
        assert worker.proc is not None
        say(f"[models] worker ready: two engines of the {size} model in one process (1 BLAS thread each)")
        result = asyncio.run(_drive(site.url, prefix, cfg, psutil.Process(worker.proc.pid), size, "1", threads,
                                    processes))
    finally:
        worker.stop()
    say(f"[models] N={cfg.models_n} per model: concurrent / sequential {result.speedup:.2f}x; worker cores busy "
         f"{_median(result.concurrent_cores):.2f} concurrent, {_median(result.sequential_cores):.2f} sequential; "
         f"mlx-lm alone: {threads.speedup:.2f}x as two threads, {processes.speedup:.2f}x as two processes")
    return result


# --- the pair without the queue ----------------------------------------------------------------------------
def _raw_pairs(path: str, cfg: BenchConfig) -> tuple[RawPair, RawPair]:
    """Two engines of mlx-lm's BatchGenerator on ``path`` (N jobs each, one BLAS thread): as two MLX threads of
    this process, then as two child processes, sequential and concurrent runs alternating."""
    blas = openblas_in_use()
    if blas is not None:
        blas.openblas_set_num_threads(1)
    prompts = prompt_batch(cfg.models_n)
    engines = [RawPath(path, cfg.models_n) for _ in range(2)]
    try:
        in_process = _alternate(cfg, lambda sel: _threads_run([engines[i] for i in sel], prompts, cfg.max_tokens))
    finally:
        for e in engines:
            e.close()
    children = [_Child(path, cfg) for _ in range(2)]
    try:
        in_children = _alternate(cfg, lambda sel: _children_run([children[i] for i in sel]))
    finally:
        for c in children:
            c.close()
    return in_process, in_children


def _alternate(cfg: BenchConfig, run: Any) -> RawPair:
    run((0, 1))  # warm-up
    seq, con = [], []
    for _ in range(cfg.models_repeats):
        time.sleep(SETTLE_S)
        seq.append(run((0,)) + run((1,)))
        time.sleep(SETTLE_S)
        con.append(run((0, 1)))
    return RawPair(seq, con)


def _threads_run(engines: list[Any], prompts: list[str], max_tokens: int) -> float:
    async def both() -> None:
        await asyncio.gather(*(e.run(prompts, max_tokens) for e in engines))

    t0 = time.perf_counter()
    asyncio.run(both())
    return time.perf_counter() - t0


class _Child:
    """A process with one raw engine: runs N jobs at each line on its stdin, answers a line when done."""

    def __init__(self, path: str, cfg: BenchConfig) -> None:
        script = f"from tests.perf.models import _child_main; _child_main({path!r}, {cfg.models_n}, {cfg.max_tokens})"
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=_child_env())
        self._line()  # loaded and warmed up

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def _line(self) -> None:
        assert self.proc.stdout is not None
        if not self.proc.stdout.readline():
            raise RuntimeError("a raw engine child process exited")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=TIMEOUT_S)


def _children_run(children: list[_Child]) -> float:
    t0 = time.perf_counter()
    for c in children:
        c.go()
    for c in children:
        c._line()
    return time.perf_counter() - t0


def _child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": path}  # ``tests.perf`` from any directory


def _child_main(path: str, n: int, max_tokens: int) -> None:
    """A raw engine child's loop (see :class:`_Child`)."""
    engine = RawPath(path, n)
    prompts = prompt_batch(n)
    asyncio.run(engine.run(prompts, max_tokens))
    print("ready", flush=True)
    while sys.stdin.readline():
        asyncio.run(engine.run(prompts, max_tokens))
        print("done", flush=True)
    engine.close()


async def _drive(url: str, prefix: str, cfg: BenchConfig, proc: psutil.Process, size: str, blas_threads: str,
                 threads: RawPair, processes: RawPair) -> ModelsResult:
    n = cfg.models_n
    seq_s: list[float] = []
    con_s: list[float] = []
    seq_cores: list[float] = []
    con_cores: list[float] = []
    async with Client(url, prefix=prefix) as client:
        for model in ("a", "b"):  # warm both engines
            await _jobs(client, [model], n, cfg.warmup_tokens)
        for _ in range(cfg.models_repeats):
            time.sleep(SETTLE_S)
            s, c = await _timed(proc, _sequential(client, n, cfg.max_tokens))
            seq_s.append(s)
            seq_cores.append(c)
            time.sleep(SETTLE_S)
            s, c = await _timed(proc, _jobs(client, ["a", "b"], n, cfg.max_tokens))
            con_s.append(s)
            con_cores.append(c)
    return ModelsResult(size, n, blas_threads, seq_s, con_s, seq_cores, con_cores, paired_median(seq_s, con_s), threads,
                        processes)


async def _sequential(client: Client, n: int, max_tokens: int) -> None:
    await _jobs(client, ["a"], n, max_tokens)
    await _jobs(client, ["b"], n, max_tokens)


async def _timed(proc: psutil.Process, run: object) -> tuple[float, float]:
    """Wall seconds of ``run``, and the worker's CPU seconds over them (cores busy)."""
    cpu0, t0 = _cpu(proc), time.perf_counter()
    await run  # type: ignore[misc]
    wall = time.perf_counter() - t0
    return wall, (_cpu(proc) - cpu0) / wall if wall > 0 else 0.0


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


async def _jobs(client: Client, models: list[str], n: int, max_tokens: int) -> None:
    prompts = prompt_batch(n)
    await asyncio.gather(*(_one(client, m, p, max_tokens) for m in models for p in prompts))


async def _one(client: Client, model: str, prompt: str, max_tokens: int) -> None:
    async for ev in client.submit_and_follow(model=model, prompt=prompt, max_tokens=max_tokens, timeout=TIMEOUT_S):
        if isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
        if isinstance(ev, DoneEvent):
            return


def models_targets(result: ModelsResult | None) -> list[Target]:
    if result is None:
        return []
    # The issue asks for 1.2x "or the measurement that shows what bounds it": mlx-lm's own two engines as two
    # threads of one process, measured beside it, are that bound; keeping 95 % of it (as the queue keeps 95 % of
    # raw mlx-lm elsewhere) meets the target as well as 1.2x does.
    bound = result.threads.speedup
    passed = result.speedup >= _TARGET or result.speedup >= _OF_BOUND * bound
    return [Target(f"two models in one process: concurrent / sequential ({result.size}, N={result.n} each)",
                   round(result.speedup, 3), f">= {_TARGET}, or >= {_OF_BOUND:g} x {bound:.2f} (mlx-lm alone, "
                   "two threads of one process)", passed)]


def md_models(result: ModelsResult | None) -> list[str]:
    if result is None:
        return []
    return [
        "## Two models in one worker process", "",
        f"Two engines (the {result.size} model served as `a` and `b`, {result.blas_threads} OpenBLAS thread each) "
        f"in one `arq mlxq.worker.Settings`, N={result.n} jobs per model: the first model's jobs then the second's "
        "(sequential), against both at once (concurrent), alternating.", "",
        "| run | wall s (median) | worker cores busy (median) |", "|---|---:|---:|",
        f"| sequential | {_median(result.sequential_s):.2f} | {_median(result.sequential_cores):.2f} |",
        f"| concurrent | {_median(result.concurrent_s):.2f} | {_median(result.concurrent_cores):.2f} |",
        "", f"concurrent / sequential: **{result.speedup:.2f}x** (median of pairs; target {_TARGET}x, or "
        f"{_OF_BOUND:g} of the one-process bound below: {_OF_BOUND * result.threads.speedup:.2f}x in this run).", "",
        "The same pair without the queue: mlx-lm's BatchGenerator alone (the raw path's loop, one OpenBLAS thread "
        "each), as two MLX threads of one process (as the worker runs its engines) and as two processes.", "",
        "| mlx-lm alone | sequential s (median) | concurrent s (median) | concurrent / sequential |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {_median(pair.sequential_s):.2f} | {_median(pair.concurrent_s):.2f} | {pair.speedup:.2f}x |"
          for name, pair in (("two threads, one process", result.threads), ("two processes", result.processes))),
        "",
    ]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
