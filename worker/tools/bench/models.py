"""The benchmark's several-models phase: one worker process serving two models (MLXQ_MODELS), each with its own
engine thread and MLX stream.

Runs of N jobs per model, in turn: **sequential** (the first model's N jobs, then the second's, through the
same worker) and **concurrent** (all 2N at once, both engines stepping side by side). concurrent / sequential
throughput says what a second engine in one process buys; the worker process's CPU (cores busy over each run)
says what bounds it. Both models are the same generated model served twice under two names: two engines of
equal weight, so neither finishes early and leaves the other alone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import psutil

from api.client import Client
from api.schema import DoneEvent, ErrorEvent

from ..process import WorkerProcess
from .runs import _SETTLE_S, _TIMEOUT_S, BenchConfig, Target, _paired, _prompts, _say, _Site

__all__ = ["ModelsResult", "md_models", "models_targets", "run_models"]

_TARGET = 1.2  # issue 17: concurrent / sequential wall time


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


def run_models(cfg: BenchConfig, site: _Site) -> ModelsResult:
    """Start a worker serving one generated model twice and time its runs."""
    from engine.tinymodel import ensure_model

    size = "small" if "small" in cfg.sizes else cfg.sizes[0]
    path = str(ensure_model(size))
    prefix = f"mlxq-bench-models-{uuid.uuid4().hex[:6]}"
    threads = "1"  # one core per engine: two engines at once would share two cores otherwise
    env = {"MLXQ_MODELS": f"{path}=a,{path}=b", "MLXQ_REDIS_URL": site.url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(cfg.models_n), "OPENBLAS_NUM_THREADS": threads}
    log_path = site.out / "logs" / "worker-two-models.log"
    log_path.unlink(missing_ok=True)
    worker = WorkerProcess(env, log_path).start()
    try:
        worker.wait_ready()
        assert worker.proc is not None
        _say(f"[models] worker ready: two engines of the {size} model in one process ({threads} BLAS thread each)")
        result = asyncio.run(_drive(site.url, prefix, cfg, psutil.Process(worker.proc.pid), size, threads))
    finally:
        worker.stop()
    _say(f"[models] N={cfg.models_n} per model: concurrent / sequential {result.speedup:.2f}x; worker cores busy "
         f"{_median(result.concurrent_cores):.2f} concurrent, {_median(result.sequential_cores):.2f} sequential")
    return result


async def _drive(url: str, prefix: str, cfg: BenchConfig, proc: psutil.Process, size: str, threads: str
                 ) -> ModelsResult:
    n = cfg.models_n
    seq_s: list[float] = []
    con_s: list[float] = []
    seq_cores: list[float] = []
    con_cores: list[float] = []
    async with Client(url, prefix=prefix) as client:
        for model in ("a", "b"):  # warm both engines
            await _jobs(client, [model], n, cfg.warmup_tokens)
        for _ in range(cfg.models_repeats):
            time.sleep(_SETTLE_S)
            s, c = await _timed(proc, _sequential(client, n, cfg.max_tokens))
            seq_s.append(s)
            seq_cores.append(c)
            time.sleep(_SETTLE_S)
            s, c = await _timed(proc, _jobs(client, ["a", "b"], n, cfg.max_tokens))
            con_s.append(s)
            con_cores.append(c)
    return ModelsResult(size, n, threads, seq_s, con_s, seq_cores, con_cores, _paired(seq_s, con_s))


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
    prompts = _prompts(n)
    await asyncio.gather(*(_one(client, m, p, max_tokens) for m in models for p in prompts))


async def _one(client: Client, model: str, prompt: str, max_tokens: int) -> None:
    async for ev in client.submit_and_follow(model=model, prompt=prompt, max_tokens=max_tokens, timeout=_TIMEOUT_S):
        if isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
        if isinstance(ev, DoneEvent):
            return


def models_targets(result: ModelsResult | None) -> list[Target]:
    if result is None:
        return []
    return [Target(f"two models in one process: concurrent / sequential ({result.size}, N={result.n} each)",
                   round(result.speedup, 3), f">= {_TARGET}", result.speedup >= _TARGET)]


def md_models(result: ModelsResult | None) -> list[str]:
    if result is None:
        return []
    return [
        "## Two models in one worker process", "",
        f"Two engines (the {result.size} model served as `a` and `b`, {result.blas_threads} OpenBLAS thread each) "
        f"in one `arq worker.Settings`, N={result.n} jobs per model: the first model's jobs then the second's "
        "(sequential), against both at once (concurrent), alternating.", "",
        "| run | wall s (median) | worker cores busy (median) |", "|---|---:|---:|",
        f"| sequential | {_median(result.sequential_s):.2f} | {_median(result.sequential_cores):.2f} |",
        f"| concurrent | {_median(result.concurrent_s):.2f} | {_median(result.concurrent_cores):.2f} |",
        "", f"concurrent / sequential: **{result.speedup:.2f}x** (median of pairs; target {_TARGET}).", "",
    ]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0
