"""The research run: how much of mlx-lm's raw batching throughput survives the queue, and the targets of the
issues (tests/perf/README.md lists them), each PASS or MISS, measured in one run.

Why: a queue is worth running only if Redis, arq and a process hop cost little next to the model. So one
run measures, on the same generated models, prompts and ``max_tokens``:

- **raw**: mlx-lm's ``BatchGenerator`` driven in this process on its own MLX thread (no Redis, no arq):
  the ceiling (the product bench's raw path, ``mlxq.worker.tools.bench.paths``);
- **queue**: ``mlxq.api.client.Client`` -> Redis -> ``arq mlxq.worker.Settings`` (continuous batching, in a child
  process) -> pub/sub -> the client;
- **serial**: the same worker with a batch of one and one arq job at a time: what batching buys;
- **engine** (a decomposition, no target): the worker's own engine (scheduler, detokenizers, pacer) on the
  raw path's MLX thread, no Redis: queue/raw ~ engine/raw (the engine's bookkeeping) x queue/engine (the
  transport: client, Redis, arq, event loop);
- **scheduling** (``scheduling.py``): the engine's prefix cache (TTFT cached against cold), admission under
  KV over-subscription (peak KV against the headroom, throughput against no KV limit), a priority job's
  TTFT with every slot busy, and structured output;
- **gateway** (``gateway.py``): ``mlxq gateway`` (a child process) in front of the same queue worker, streamed
  over HTTP (OpenAI's ``/v1/completions``), run by run in turn with the in-process client (the queue path);
- **mlx_lm.server** (``peer.py``, not on a quick run): mlx-lm's own HTTP server as a peer path;

plus time to first token (TTFT), cancel -> terminal-event latency, Redis round trips per engine step, CPU
per process, OpenBLAS threads and MLX's kernel-thread policy, and the enqueue rate of one producer; image
jobs on the generated vision-language models, raw mlx-vlm ``BatchGenerator`` against the queue (``vision.py``);
and two models in one worker process, both at once against one after the other (``models.py``). Results go to
``results.json``, ``results.md`` and ``chart.png``.

Machines running this are often shared, so raw and queue runs alternate at each N (the idle worker is
SIGSTOPped during raw runs so its polling does not tax the ceiling), and throughput is the best of the
repeats: background load only ever slows a run down. OpenBLAS is preloaded as ``mlxq bench`` does
(``mlxq.worker.tools.bench.preload``); every result says which BLAS ran.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import platform
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools.bench.preload import reexec_with_openblas
from mlxq.worker.tools.bench.runs import (
    SETTLE_S,
    PathResult,
    drive,
    fmt_list,
    paired_median,
    percentile,
    prompt_batch,
    safe_ratio,
    say,
)
from mlxq.worker.tools.blas import blas_of
from mlxq.worker.tools.redis_server import RedisServer

from .gateway import gateway_phase
from .models import models_targets, run_models
from .paths import RawPath, enqueue_phase, openblas_in_use, worker_phase
from .peer import ServerPath
from .report import size_targets, write_outputs
from .results import BenchResult, SizeResult
from .runs import (
    BLAS_MARGIN,
    BenchConfig,
    BlasThreads,
    KernelPolicy,
    RoundTrips,
    Row,
    Site,
    TtftProbe,
)
from .scheduling import run_scheduling
from .tenants import Phases, tenants_targets
from .tenants import run as run_tenants
from .tenants import write as write_tenants
from .vision import run_vision, vision_targets

__all__ = ["pick_threads", "run_suite"]

_ROOT = Path(__file__).resolve().parents[2]  # the checkout: ``tests.perf`` imports from it


# --- entry point -----------------------------------------------------------------------------------
def run_suite(args: argparse.Namespace, *, reexec: bool = True) -> int:
    """``python3 -m tests.perf``: measure, write results.json, results.md and chart.png to ``args.out``, print
    the markdown. With ``reexec``, first re-executes itself with OpenBLAS preloaded when that helps."""
    if reexec:
        reexec_with_openblas(["-m", "tests.perf", *_argv_of(args)], _ROOT)
    return drive("tests.perf", args, BenchConfig.from_args, _run, write_outputs)


def _argv_of(args: argparse.Namespace) -> list[str]:
    argv = ["--out", str(args.out)]
    if args.quick:
        argv.append("--quick")
    for flag, value in (("--sizes", args.sizes), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _run(cfg: BenchConfig, out: Path) -> BenchResult:
    t0 = time.perf_counter()
    machine = _machine()
    say(f"BLAS: {machine['blas']}; mlx {machine['mlx']}, mlx-lm {machine['mlx_lm']}, "
         f"{machine['cpus']} cores, load average {machine['loadavg_start']}")
    with RedisServer() as server:
        assert server.proc is not None
        site = Site(server.url, server.proc.pid, out)
        machine["redis"] = _redis_version(server.url)
        sizes = [_bench_size(size, cfg, site) for size in cfg.sizes]
        vision = run_vision(cfg, site)
        models = run_models(cfg, site)
        say("enqueue: one producer, no worker")
        enqueue = asyncio.run(enqueue_phase(server.url, cfg))
    say("tenants: fair share, isolation, max-running (tests/perf/tenants.py)")
    tenants = run_tenants(Phases.quick() if cfg.quick else Phases(), out)  # its own Redis and workers
    write_tenants(tenants, out)
    machine["loadavg_end"] = _loadavg()
    machine["probe_ms_end"] = _speed_probe_ms()
    machine["mlx_vlm"] = importlib.metadata.version("mlx-vlm")
    targets = (size_targets(sizes, enqueue) + vision_targets(vision) + models_targets(models)
               + tenants_targets(tenants))
    return BenchResult(machine, cfg, sizes, enqueue, targets, time.perf_counter() - t0, vision, models, tenants)


def _bench_size(size: str, cfg: BenchConfig, site: Site) -> SizeResult:
    from mlxq.worker.tools.tinymodel import ensure_model

    t0 = time.perf_counter()
    model = str(ensure_model(size))
    say(f"[{size}] model {model}")
    raw = RawPath(model, cfg.capacity, site.redis_pid)
    try:
        threads = asyncio.run(_calibrate_blas(raw, cfg)) if openblas_in_use() is not None else None
        env = {"OPENBLAS_NUM_THREADS": str(threads.chosen)} if threads is not None else {}
        policy = asyncio.run(_measure_policy(raw, cfg, size))
        server = _peer(model, cfg, env, site, size)
        try:
            queue = worker_phase("queue", size, model, cfg, site, raw, env, gateway_phase, server)
        finally:
            if server is not None:
                server.close()
        scheduling = asyncio.run(run_scheduling(raw, cfg, size))
    finally:
        raw.close()
    serial = worker_phase("serial", size, model, cfg, site, None, env)
    q, sr, rw = queue.driven.measured, serial.driven.measured, queue.driven.raw
    assert rw is not None and queue.driven.cancel is not None
    rows = [_row(size, n, rw.paths[n], q.paths[n], sr.paths[n], queue.driven.engine.get(n),
                 queue.driven.server.get(n)) for n in cfg.concurrency]
    trips = RoundTrips(queue.stats, queue.stats.writes_per_step, serial.stats, serial.stats.writes_per_step,
                       queue.driven.commandstats)
    return SizeResult(size, model, rows, _probe(rw.probe_ttft_ms, q.probe_ttft_ms), queue.driven.cancel,
                      trips, {"raw": rw.cpu, "queue": q.cpu, "serial": sr.cpu}, queue.blas,
                      time.perf_counter() - t0, threads, policy, scheduling, queue.driven.gateway)


def _peer(model: str, cfg: BenchConfig, env: dict[str, str], site: Site, size: str) -> ServerPath | None:
    """mlx_lm.server on the model, stopped until its runs (None on a quick run)."""
    if cfg.quick:
        return None
    server = ServerPath(model, cfg.capacity, env, site.out / "logs" / f"mlx_lm-server-{size}.log")
    os.kill(server.proc.pid, signal.SIGSTOP)
    say(f"[{size}] mlx_lm.server: ready on port {server.port} (the peer path)")
    return server


def _row(size: str, n: int, raw: PathResult, queue: PathResult, serial: PathResult,
         engine: PathResult | None = None, server: PathResult | None = None) -> Row:
    # Best-of compares each path's luckiest run; the paired median compares runs made seconds apart, so
    # the machine's slow swings (other tenants: ±10 % here) hit both sides of each ratio alike.
    e_runs = engine.runs_tok_s if engine else []
    return Row(size, n, raw, queue, serial, safe_ratio(queue.tok_s, raw.tok_s), safe_ratio(queue.tok_s, serial.tok_s),
               queue.ttft_p50_ms - raw.ttft_p50_ms, queue.ttft_p99_ms - raw.ttft_p99_ms,
               paired_median(queue.runs_tok_s, raw.runs_tok_s), engine, paired_median(e_runs, raw.runs_tok_s),
               paired_median(queue.runs_tok_s, e_runs), server,
               paired_median(queue.runs_tok_s, server.runs_tok_s if server else []))


def _probe(raw: list[float], queue: list[float]) -> TtftProbe:
    r50, r99, q50, q99 = percentile(raw, 50), percentile(raw, 99), percentile(queue, 50), percentile(queue, 99)
    return TtftProbe(min(len(raw), len(queue)), r50, r99, q50, q99, q50 - r50, q99 - r99)


# --- BLAS and the kernel thread ---------------------------------------------------------------------
async def _measure_policy(raw: RawPath, cfg: BenchConfig, size: str) -> KernelPolicy | None:
    """Raw runs at N=1 and the largest N with the MLX stream's kernel thread under the default policy and
    under SCHED_BATCH, in turn (engine/mlx/thread.py says why mlxq sets it)."""
    if raw.thread.kernel_thread is None:
        return None
    ns = sorted({1, cfg.capacity})
    runs: dict[str, dict[int, list[float]]] = {"default": {n: [] for n in ns}, "batch": {n: [] for n in ns}}
    try:
        for n in ns:
            prompts = prompt_batch(n)
            for _ in range(cfg.policy_repeats):
                for policy, on in (("default", False), ("batch", True)):
                    raw.thread.set_kernel_policy(on)
                    time.sleep(SETTLE_S)
                    runs[policy][n].append((await raw.run(prompts, cfg.max_tokens)).tok_s)
    finally:
        raw.thread.set_kernel_policy(True)
    paired = {n: paired_median(runs["batch"][n], runs["default"][n]) for n in ns}
    say(f"[{size}] MLX kernel thread, SCHED_BATCH / default policy (raw, paired): "
         + ", ".join(f"N={n} {r:.2f}" for n, r in paired.items()))
    return KernelPolicy(runs, paired)


def _machine() -> dict[str, Any]:
    return {
        "blas": blas_of(), "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "mlx": importlib.metadata.version("mlx"), "mlx_lm": importlib.metadata.version("mlx-lm"),
        "arq": importlib.metadata.version("arq"), "cpus": os.cpu_count(),
        "platform": platform.platform(), "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "loadavg_start": _loadavg(),  # other processes on the machine skew every number
        "probe_ms_start": _speed_probe_ms(),
        "worker_env": _worker_env(),
    }


def _worker_env() -> dict[str, str]:
    """The worker settings in effect (MLXQ_* from this environment, which the workers inherit, or defaults)."""
    cfg = WorkerConfig.from_env()
    return {"MLXQ_STREAM_INTERVAL_MS": f"{cfg.stream_interval_ms:g}", "MLXQ_STREAM_RATE": f"{cfg.stream_rate:g}",
            "MLXQ_ADMIT_WAIT_MS": f"{cfg.admit_wait_ms:g}", "MLXQ_PREFILL_BATCH": str(cfg.prefill_batch_size)}


def _speed_probe_ms() -> float:
    """Milliseconds a fixed pure-Python loop takes: how fast this machine runs right now.

    On a shared VM other tenants slow the cores by 2-3x for minutes at a time without any steal time or
    load showing here; comparing this at the start and end of a run says whether its numbers are comparable.
    """
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        n = 0
        for i in range(1_000_000):
            n += i
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 1)


def _loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _redis_version(url: str) -> str:
    import redis

    client = redis.Redis.from_url(url)
    try:
        info: dict[str, Any] = client.info("server")  # type: ignore[assignment]
        return str(info.get("redis_version", "?"))
    finally:
        client.close()


def pick_threads(raw_tok_s: dict[int, list[float]], margin: float = BLAS_MARGIN) -> int:
    """The fewest threads whose median raw throughput is within ``margin`` of the best one.

    More threads must clearly pay: each spins a core between calls that the worker, Redis and the client
    need, and three runs on a noisy machine cannot tell a few percent apart.
    """
    best = max(percentile(v, 50) for v in raw_tok_s.values())
    return min(n for n, v in raw_tok_s.items() if percentile(v, 50) >= best * (1 - margin))


async def _calibrate_blas(raw: RawPath, cfg: BenchConfig) -> BlasThreads:
    """Raw runs at the largest N with 1 and with all cores' OpenBLAS threads, alternating (see pick_threads)."""
    counts = sorted({1, os.cpu_count() or 1})
    prompts = prompt_batch(cfg.capacity)
    runs: dict[int, list[float]] = {n: [] for n in counts}
    for n in counts:  # warm each setting once
        raw.set_blas_threads(n)
        await raw.run(prompts, cfg.warmup_tokens)
    for _ in range(cfg.blas_repeats):
        for n in counts:
            raw.set_blas_threads(n)
            time.sleep(SETTLE_S)
            runs[n].append((await raw.run(prompts, cfg.max_tokens)).tok_s)
    chosen = pick_threads(runs)
    raw.set_blas_threads(chosen)
    say("BLAS threads: " + ", ".join(f"{n}: {fmt_list(v)} tok/s" for n, v in runs.items()) + f" -> {chosen}")
    return BlasThreads(chosen, runs)
