"""``mlxq bench``: how much of raw mlx-lm's batching throughput survives the queue, on your model, in one run.

At each concurrency N, bursts of N requests go in turn through **raw** (mlx-lm's ``BatchGenerator`` in this
process: the ceiling), **queue** (``Client`` -> embedded Redis -> an arq worker -> pub/sub) and, with the
gateway extra, **gateway** (``mlxq gateway`` before the same worker, ``POST /v1/completions`` streamed). It
prints tok/s and TTFT p50 per path with the ratios to raw and writes ``results.md``, ``results.json`` and
``chart.png``. Paths alternate run by run; throughput is the best run, as background load only slows a run.
On Linux it first re-executes itself with Debian's OpenBLAS preloaded (``preload.py``). The research
benchmarks are ``python3 -m tests.perf``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlxq.api.client import Client
from mlxq.api.errors import install_hint

from ..blas import blas_of
from ..process import GatewayProcess, WorkerProcess
from ..redis_server import RedisServer
from .http import SseClient
from .paths import RawPath, frozen, run_gateway, run_queue
from .preload import reexec_with_openblas
from .report import render_markdown, write_outputs
from .runs import (
    SETTLE_S,
    TIMEOUT_S,
    BenchConfig,
    BenchResult,
    PathResult,
    Row,
    Run,
    drive,
    paired_median,
    prompt_batch,
    say,
)

__all__ = ["BenchConfig", "BenchResult", "RawPath", "measure", "render_markdown", "run_bench", "write_outputs"]

_NAME = "bench"  # the model's name on the queue
_GATEWAY_NEEDS = ("starlette", "uvicorn")


def run_bench(args: argparse.Namespace, *, reexec: bool = True) -> int:
    """``mlxq bench``: measure, write results.json, results.md and chart.png to ``args.out``, print the table.

    With ``reexec`` (the CLI), first re-executes itself with OpenBLAS preloaded when that helps.
    """
    if reexec:
        reexec_with_openblas(["-m", "mlxq.api.cli", *_argv_of(args)])
    return drive("mlxq bench", args, BenchConfig.from_args, measure, write_outputs)


def _argv_of(args: argparse.Namespace) -> list[str]:
    argv = ["--debug"] if getattr(args, "debug", False) else []  # mlxq's own option, before the command
    argv += ["bench", "--out", str(args.out)]
    if args.quick:
        argv.append("--quick")
    for flag, value in (("--model", args.model), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def measure(cfg: BenchConfig, out: Path) -> BenchResult:
    """Raw, queue (and gateway) runs at every N of ``cfg``; workers' and gateways' logs go to ``out/logs``."""
    from ..tinymodel import ensure_model

    t0 = time.perf_counter()
    machine = _machine()
    model = cfg.model or str(ensure_model("tiny" if cfg.quick else "small"))
    say(f"model {model}; BLAS: {machine['blas']}; mlx {machine['mlx']}, mlx-lm {machine['mlx_lm']}, "
        f"{machine['cpus']} cores")
    with RedisServer() as redis, contextlib.ExitStack() as stack:
        prefix = f"mlxq-bench-{uuid.uuid4().hex[:6]}"
        raw = _load(model, cfg.capacity)
        stack.callback(raw.close)
        worker = stack.enter_context(_worker(model, cfg, redis.url, prefix, out))
        gateway = stack.enter_context(_gateway(redis.url, prefix, out))
        rows = asyncio.run(_drive(cfg, raw, worker, redis.url, prefix, gateway))
    return BenchResult(model, machine, cfg, rows, time.perf_counter() - t0)


def _load(model: str, capacity: int) -> RawPath:
    from mlxq.engine.mlx.loader import ModelLoadError

    try:
        return RawPath(model, capacity)
    except ModelLoadError as exc:  # not a model directory, not in the cache, not on the hub
        raise RuntimeError(str(exc)) from exc


@contextlib.contextmanager
def _worker(model: str, cfg: BenchConfig, url: str, prefix: str, out: Path) -> Iterator[WorkerProcess]:
    """A queue worker serving ``model`` with the bench's capacity, until the block ends."""
    env = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": _NAME, "MLXQ_REDIS_URL": url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(cfg.capacity), "MLXQ_MAX_JOBS": "0", "MLXQ_HEARTBEAT": "0.5"}
    log = out / "logs" / "worker.log"
    log.unlink(missing_ok=True)
    worker = WorkerProcess(env, log).start()
    try:
        worker.wait_ready()  # RuntimeError, with the log's tail, if it exits or never serves
        say(f"queue: worker ready (capacity {cfg.capacity}, {blas_of(worker.proc.pid if worker.proc else 'self')})")
        yield worker
    finally:
        worker.signal(signal.SIGCONT)  # were it stopped when something failed
        worker.stop()


@contextlib.contextmanager
def _gateway(url: str, prefix: str, out: Path) -> Iterator[str | None]:
    """``mlxq gateway`` on the worker's deployment (its URL), or None where the gateway extra is missing."""
    missing = [m for m in _GATEWAY_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        say(f"gateway: skipped ({', '.join(missing)} missing: {install_hint('gateway')})")
        yield None
        return
    gateway = GatewayProcess({"MLXQ_REDIS_URL": url, "MLXQ_PREFIX": prefix}, out / "logs" / "gateway.log").start()
    try:
        gateway.wait_ready()
        yield gateway.url
    finally:
        gateway.stop()


async def _drive(cfg: BenchConfig, raw: RawPath, worker: WorkerProcess, url: str, prefix: str,
                 gateway: str | None) -> list[Row]:
    where = urlsplit(gateway) if gateway else None
    http = SseClient(where.hostname or "127.0.0.1", where.port or 80) if where else None
    try:
        async with Client(url, prefix=prefix) as client:
            await client.generate(model=_NAME, prompt="warm up", max_tokens=cfg.warmup_tokens, timeout=TIMEOUT_S)
            return [await _measure_at(cfg, n, raw, worker, client, http) for n in cfg.concurrency]
    finally:
        if http is not None:
            await http.aclose()


async def _measure_at(cfg: BenchConfig, n: int, raw: RawPath, worker: WorkerProcess, client: Client,
                      http: SseClient | None) -> Row:
    """A warm-up burst on each path, then ``repeats`` rounds of raw, queue and gateway runs in turn."""
    prompts = prompt_batch(n)
    paths: dict[str, Callable[[int], Awaitable[Run]]] = {
        "raw": lambda t: raw.run(prompts, t), "queue": lambda t: run_queue(client, _NAME, prompts, t)}
    if http is not None:
        paths["gateway"] = lambda t: run_gateway(http, _NAME, prompts, t)
    runs: dict[str, list[Run]] = {name: [] for name in paths}
    for k in range(cfg.repeats + 1):  # round 0 warms each path up at this N
        for name, path in paths.items():
            tokens = cfg.max_tokens if k else cfg.warmup_tokens
            if name == "raw":
                with frozen(worker):
                    run = await path(tokens)
            else:
                time.sleep(SETTLE_S)  # every run after the same idle pause (see paths.frozen)
                run = await path(tokens)
            if k:
                runs[name].append(run)
    return _row(n, {name: PathResult.of(r) for name, r in runs.items()})


def _row(n: int, res: dict[str, PathResult]) -> Row:
    raw, queue, gateway = res["raw"], res["queue"], res.get("gateway")
    row = Row(n, raw, queue, gateway, paired_median(queue.runs_tok_s, raw.runs_tok_s),
              paired_median(gateway.runs_tok_s, raw.runs_tok_s) if gateway is not None else None)
    line = f"N={n:<3} raw {raw.tok_s:8.1f} tok/s; queue {queue.tok_s:8.1f} tok/s ({row.queue_over_raw:.2f} of raw)"
    if gateway is not None:
        line += f"; gateway {gateway.tok_s:8.1f} tok/s ({row.gateway_over_raw:.2f} of raw)"
    say(line)
    return row


def _machine() -> dict[str, Any]:
    return {
        "blas": blas_of(), "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "mlx": importlib.metadata.version("mlx"), "mlx_lm": importlib.metadata.version("mlx-lm"),
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
