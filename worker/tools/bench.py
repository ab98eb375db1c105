"""``mlxq bench``: how much of mlx-lm's raw batching throughput survives the queue, measured in one run.

Why: a queue is worth running only if Redis, arq and a process hop cost little next to the model. So one
run measures, on the same generated model, prompts and ``max_tokens``:

- **raw**: mlx-lm's ``BatchGenerator`` driven in this process on its own MLX thread (no Redis, no arq):
  the ceiling;
- **queue**: ``api.client.Client`` -> Redis -> ``arq worker.Settings`` (continuous batching, in a child
  process) -> pub/sub -> the client;
- **serial**: the same worker with a batch of one and one arq job at a time: what batching buys;
- **engine** (a decomposition, no target): the worker's own engine (scheduler, detokenizers, pacer) on the
  raw path's MLX thread, no Redis: queue/raw ~ engine/raw (the engine's bookkeeping) x queue/engine (the
  transport: client, Redis, arq, event loop);

plus time to first token (TTFT), cancel -> terminal-event latency, Redis round trips per engine step, CPU
per process and the enqueue rate of one producer. Results go to ``results.json``, ``results.md`` and
``chart.png``.

Machines running this are often shared, so raw and queue runs alternate at each N (the idle worker is
SIGSTOPped during raw runs so its polling does not tax the ceiling), and throughput is the best of the
repeats: background load only ever slows a run down.

BLAS: mlx-cpu's bundled reference BLAS is so slow that batching gains nothing on Linux. When Debian's
OpenBLAS is installed, the command re-executes itself with it in ``LD_PRELOAD``, so the in-process raw path
and the worker subprocesses (which inherit the environment) both use it. Every result says which BLAS ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.client import Client
from api.connection import redis_client
from api.keys import Keys
from api.schema import DoneEvent, ErrorEvent
from worker.config import WorkerConfig

from .blas import OPENBLAS, blas_of, coretype_for, cpu_flags, openblas, openblas_core
from .process import WorkerProcess
from .redis_server import RedisServer

if TYPE_CHECKING:
    import mlx.core as mx

    from engine.engine import Engine
    from engine.loader import LoadedModel
    from engine.request import RequestOutput

__all__ = [
    "BenchConfig", "BenchResult", "RawPath", "WorkerStats", "parse_stats",
    "render_markdown", "run_bench", "write_outputs",
]

_REEXEC_MARK = "MLXQ_BENCH_REEXEC"  # set in the re-executed process: never re-exec twice
_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Hello world number {i} the quick brown fox"  # as in /work/shared/PERF-ANCHORS.md
_PROBE_TOKENS = 2  # max_tokens of the N=1 TTFT probe requests
_PROBE_OFFSET = 1000  # prompt numbers of probe requests
_TIMEOUT_S = 900.0  # one job's wait bound (serial N=32 on the small model queues for ~40 s)
_STATS_LINE_RE = re.compile(r"stats: (engine_steps=\d+.*)$", re.MULTILINE)
_KEY_VALUE_RE = re.compile(r"(\w+)=(\d+)")
_NOBODY = "mlxq-bench-nobody"  # model name of the enqueue phase: no worker serves its queue
_SETTLE_S = 0.3  # idle pause before every measured run (see _frozen)
_BLAS_MARGIN = 0.05  # more OpenBLAS threads only when their raw median is this much faster (see pick_threads)


# --- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What one bench run measures; ``quick`` is a smoke run of a few seconds."""

    sizes: tuple[str, ...] = ("tiny", "small")
    concurrency: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    repeats: int = 7  # measured runs per N on raw and queue, in pairs (the machine is noisy: ±20 % run to run)
    tiny_repeats: int = 15  # the tiny model's runs take under a second: more pairs cost little, steady the medians
    serial_repeats: int = 1  # serial runs are N jobs back to back: already an average
    blas_repeats: int = 3  # raw runs per OpenBLAS thread count when choosing it
    warmup_tokens: int = 8
    ttft_probes: int = 20  # sequential N=1 requests per path for the TTFT targets
    cancel_max_tokens: int = 400  # fits the tiny model's 512-token context with the prompt
    cancel_wait: tuple[int, int] = (2, 40)  # token events to wait before a cancel, drawn uniformly
    enqueue_jobs: int = 2000
    enqueue_batch: int = 64
    quick: bool = False

    def repeats_for(self, size: str) -> int:
        """Measured raw/queue pairs per N for a model size."""
        return self.tiny_repeats if size == "tiny" else self.repeats

    @property
    def capacity(self) -> int:
        """Batch capacity of the queue worker (and jobs of the cancel phase)."""
        return max(self.concurrency)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        """Defaults (or the quick ones), overridden by ``--sizes``, ``--concurrency``, ``--max-tokens``."""
        base = cls.quick_config() if args.quick else cls()
        sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip()) if args.sizes else base.sizes
        ns = (tuple(int(n) for n in args.concurrency.split(",") if n.strip()) if args.concurrency
              else base.concurrency)
        if not sizes or not ns or min(ns) < 1:
            raise ValueError("--sizes and --concurrency need at least one value; N must be >= 1")
        return dataclasses.replace(base, sizes=sizes, concurrency=tuple(sorted(set(ns))),
                                   max_tokens=args.max_tokens or base.max_tokens)

    @classmethod
    def quick_config(cls) -> BenchConfig:
        return cls(sizes=("tiny",), concurrency=(1, 4), max_tokens=16, repeats=1, tiny_repeats=1, blas_repeats=1,
                   warmup_tokens=4, ttft_probes=5, cancel_max_tokens=128, cancel_wait=(2, 8), enqueue_jobs=200,
                   quick=True)


# --- records ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Run:
    """One measured run of N requests on one path."""

    tokens: int
    seconds: float
    ttft_ms: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PathResult:
    """One path at one N: the best run's throughput; TTFT pooled over every measured run."""

    tok_s: float
    runs_tok_s: list[float]
    tokens: int
    seconds: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_samples: int

    @classmethod
    def of(cls, runs: Sequence[Run]) -> PathResult:
        best = max(runs, key=lambda r: r.tok_s)
        ttft = [t for r in runs for t in r.ttft_ms]
        return cls(best.tok_s, [r.tok_s for r in runs], best.tokens, best.seconds,
                   _pct(ttft, 50), _pct(ttft, 99), len(ttft))


@dataclass(frozen=True, slots=True)
class Row:
    """One model size at one N, the three paths side by side."""

    size: str
    n: int
    raw: PathResult
    queue: PathResult
    serial: PathResult
    queue_over_raw: float  # best queue run / best raw run
    queue_over_serial: float
    added_ttft_p50_ms: float  # queue - raw
    added_ttft_p99_ms: float
    queue_over_raw_paired: float = 0.0  # median over run pairs (raw run i, then queue run i) of their ratio
    engine: PathResult | None = None  # the worker's engine in-process, no Redis (see _EngineRun)
    engine_over_raw_paired: float = 0.0  # median over the runs of engine run i / raw run i
    queue_over_engine_paired: float = 0.0  # median over the runs of queue run i / engine run i


@dataclass(frozen=True, slots=True)
class TtftProbe:
    """TTFT of sequential single requests (``_PROBE_TOKENS`` each): the N=1 TTFT targets."""

    samples: int
    raw_p50_ms: float
    raw_p99_ms: float
    queue_p50_ms: float
    queue_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float


@dataclass(frozen=True, slots=True)
class CancelResult:
    """Cancel -> terminal event, measured by the client, with the decode step time seen meanwhile."""

    jobs: int
    cancelled: int  # jobs that ended ``done(cancelled)``; the others finished first and are not timed
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    step_ms_mean: float | None
    budget_ms: float | None  # one decode step + 50 ms


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """The worker's ``stats:`` line (logged at shutdown): event-publishing round trips per engine step."""

    engine_steps: int
    redis_writes: int
    events: int
    other: dict[str, int] = field(default_factory=dict)  # the line's other counters, as logged

    @property
    def writes_per_step(self) -> float:
        return self.redis_writes / self.engine_steps if self.engine_steps else 0.0


@dataclass(frozen=True, slots=True)
class RoundTrips:
    """Round trips of one model size: both workers' counters, and Redis commandstats of the queue runs."""

    queue_worker: WorkerStats
    queue_writes_per_step: float
    serial_worker: WorkerStats
    serial_writes_per_step: float
    commandstats: dict[str, int]  # calls during the queue path's throughput runs (every client included)


@dataclass(frozen=True, slots=True)
class CpuUse:
    """CPU seconds each process used during one path's throughput runs (N cores give N s per wall second).

    ``bench`` is this process: the model itself on the raw path, the client on the queue and serial paths.
    """

    wall_s: float
    bench_s: float
    worker_s: float
    redis_s: float


@dataclass(frozen=True, slots=True)
class BlasThreads:
    """OpenBLAS threads for one model size: the count whose raw runs were clearly faster, used by every path.

    The ceiling must be raw's best configuration. A small model's gemms are too small to split: the second
    thread then only spins (a whole core) between calls, and raw runs faster with one.
    """

    chosen: int
    raw_tok_s: dict[int, list[float]]  # threads -> raw runs at the largest N, alternating


@dataclass(frozen=True, slots=True)
class SizeResult:
    """Everything measured on one model size."""

    size: str
    model: str
    rows: list[Row]
    ttft_n1: TtftProbe
    cancel: CancelResult
    round_trips: RoundTrips
    cpu: dict[str, CpuUse]  # by path: raw, queue, serial
    worker_blas: str
    seconds: float
    blas_threads: BlasThreads | None = None  # None: no OpenBLAS to tune


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """Jobs/s of one producer into a queue no worker serves."""

    jobs: int
    sequential_jobs_s: float
    gathered_jobs_s: float
    gather_batch: int


@dataclass(frozen=True, slots=True)
class Target:
    """One target of issue #3 and whether this run met it."""

    name: str
    value: float
    limit: str
    passed: bool


@dataclass(frozen=True, slots=True)
class BenchResult:
    """The whole run (``results.json``)."""

    machine: dict[str, Any]
    config: BenchConfig
    sizes: list[SizeResult]
    enqueue: EnqueueResult
    targets: list[Target]
    seconds: float


@dataclass(frozen=True, slots=True)
class _Site:
    """Where the bench runs: the embedded Redis and the output directory."""

    url: str
    redis_pid: int
    out: Path


@dataclass(frozen=True, slots=True)
class _Measured:
    """One path's throughput runs, for every N."""

    paths: dict[int, PathResult]
    cpu: CpuUse
    probe_ttft_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Driven:
    """What one worker phase measured: its path through the client (and, when batched, the raw path)."""

    measured: _Measured
    cancel: CancelResult | None
    commandstats: dict[str, int]
    raw: _Measured | None = None
    engine: dict[int, PathResult] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _DriveContext:
    """One running worker and what measuring it needs."""

    url: str
    prefix: str
    model: str
    cfg: BenchConfig
    worker: WorkerProcess
    meter: _CpuMeter


@dataclass(frozen=True, slots=True)
class _WorkerRun:
    driven: _Driven
    stats: WorkerStats
    blas: str


@dataclass(slots=True)
class _Trace:
    """One queued job as the client saw it."""

    submitted: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0


@dataclass(slots=True)
class _CancelTrace:
    """One job of the cancel phase."""

    wait_tokens: int
    token_times: list[float] = field(default_factory=list)  # token events before the cancel
    token_counts: list[int] = field(default_factory=list)  # tokens in each (several when steps are fast)
    cancelled_at: float | None = None
    ended_at: float | None = None
    finish: str = ""


# --- entry point -----------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace, *, reexec: bool = True) -> int:
    """``mlxq bench``: measure, write results.json, results.md and chart.png to ``args.out``, print them.

    With ``reexec`` (the CLI), first re-executes itself with OpenBLAS preloaded when that helps.
    """
    if reexec:
        _maybe_reexec(args)
    try:
        cfg = BenchConfig.from_args(args)
    except ValueError as exc:
        _say(f"mlxq bench: {exc}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = _run(cfg, out)
    except RuntimeError as exc:
        _say(f"mlxq bench: failed: {exc}")
        return 1
    print(write_outputs(result, out), flush=True)
    return 0


def _run(cfg: BenchConfig, out: Path) -> BenchResult:
    t0 = time.perf_counter()
    machine = _machine()
    _say(f"BLAS: {machine['blas']}; mlx {machine['mlx']}, mlx-lm {machine['mlx_lm']}, "
         f"{machine['cpus']} cores, load average {machine['loadavg_start']}")
    with RedisServer() as server:
        assert server.proc is not None
        site = _Site(server.url, server.proc.pid, out)
        machine["redis"] = _redis_version(server.url)
        sizes = [_bench_size(size, cfg, site) for size in cfg.sizes]
        _say("enqueue: one producer, no worker")
        enqueue = asyncio.run(_enqueue_phase(server.url, cfg))
    machine["loadavg_end"] = _loadavg()
    machine["probe_ms_end"] = _speed_probe_ms()
    return BenchResult(machine, cfg, sizes, enqueue, _targets(sizes, enqueue), time.perf_counter() - t0)


def _bench_size(size: str, cfg: BenchConfig, site: _Site) -> SizeResult:
    from engine.tinymodel import ensure_model

    t0 = time.perf_counter()
    model = str(ensure_model(size))
    _say(f"[{size}] model {model}")
    raw = RawPath(model, cfg.capacity, site.redis_pid)
    try:
        threads = asyncio.run(_calibrate_blas(raw, cfg)) if _openblas() is not None else None
        env = {"OPENBLAS_NUM_THREADS": str(threads.chosen)} if threads is not None else {}
        queue = _worker_phase("queue", size, model, cfg, site, raw, env)
    finally:
        raw.close()
    serial = _worker_phase("serial", size, model, cfg, site, None, env)
    q, sr, rw = queue.driven.measured, serial.driven.measured, queue.driven.raw
    assert rw is not None and queue.driven.cancel is not None
    rows = [_row(size, n, rw.paths[n], q.paths[n], sr.paths[n], queue.driven.engine.get(n))
            for n in cfg.concurrency]
    trips = RoundTrips(queue.stats, queue.stats.writes_per_step, serial.stats, serial.stats.writes_per_step,
                       queue.driven.commandstats)
    return SizeResult(size, model, rows, _probe(rw.probe_ttft_ms, q.probe_ttft_ms), queue.driven.cancel,
                      trips, {"raw": rw.cpu, "queue": q.cpu, "serial": sr.cpu}, queue.blas,
                      time.perf_counter() - t0, threads)


def _row(size: str, n: int, raw: PathResult, queue: PathResult, serial: PathResult,
         engine: PathResult | None = None) -> Row:
    # Best-of compares each path's luckiest run; the paired median compares runs made seconds apart, so
    # the machine's slow swings (other tenants: ±10 % here) hit both sides of each ratio alike.
    e_runs = engine.runs_tok_s if engine else []
    return Row(size, n, raw, queue, serial, _ratio(queue.tok_s, raw.tok_s), _ratio(queue.tok_s, serial.tok_s),
               queue.ttft_p50_ms - raw.ttft_p50_ms, queue.ttft_p99_ms - raw.ttft_p99_ms,
               _paired(queue.runs_tok_s, raw.runs_tok_s), engine, _paired(e_runs, raw.runs_tok_s),
               _paired(queue.runs_tok_s, e_runs))


def _probe(raw: list[float], queue: list[float]) -> TtftProbe:
    r50, r99, q50, q99 = _pct(raw, 50), _pct(raw, 99), _pct(queue, 50), _pct(queue, 99)
    return TtftProbe(min(len(raw), len(queue)), r50, r99, q50, q99, q50 - r50, q99 - r99)


# --- BLAS ------------------------------------------------------------------------------------------
def _maybe_reexec(args: argparse.Namespace) -> None:
    """Re-execute ``python -m api.cli bench ...`` with OpenBLAS in LD_PRELOAD (Linux, if installed)."""
    if not sys.platform.startswith("linux") or os.environ.get(_REEXEC_MARK):
        return
    if not OPENBLAS.exists():
        _say(f"BLAS: {OPENBLAS} is missing, so mlx-cpu's slow bundled BLAS runs and batching gains little "
             "(install it: apt-get install libopenblas0-pthread)")
        return
    preload = os.environ.get("LD_PRELOAD", "")
    core = None if os.environ.get("OPENBLAS_CORETYPE") else openblas_core(OPENBLAS)  # the operator's stands
    coretype = coretype_for(core, cpu_flags())
    if str(OPENBLAS) in preload and coretype is None:
        return
    env = {**os.environ, _REEXEC_MARK: "1"}
    if str(OPENBLAS) not in preload:
        env["LD_PRELOAD"] = " ".join(p for p in (str(OPENBLAS), preload) if p)
    if coretype is not None:  # the workers inherit it
        env["OPENBLAS_CORETYPE"] = coretype
        _say(f"BLAS: OpenBLAS does not know this CPU and chose its generic {core} kernels; "
             f"setting OPENBLAS_CORETYPE={coretype}, which the CPU's flags allow (on an AVX-512 Xeon the generic "
             "kernels ran gemm 4-5x slower)")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    _say(f"BLAS: re-executing with LD_PRELOAD={env['LD_PRELOAD']}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "api.cli", *_argv_of(args)], env)


def _argv_of(args: argparse.Namespace) -> list[str]:
    argv = ["bench", "--out", str(args.out)]
    if args.quick:
        argv.append("--quick")
    for flag, value in (("--sizes", args.sizes), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


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
    return {"MLXQ_STREAM_INTERVAL_MS": f"{cfg.stream_interval_ms:g}", "MLXQ_ADMIT_WAIT_MS": f"{cfg.admit_wait_ms:g}",
            "MLXQ_PREFILL_BATCH": str(cfg.prefill_batch_size)}


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


def _openblas() -> Any:
    """The preloaded OpenBLAS (ctypes), or None when mlx runs another BLAS."""
    return openblas(OPENBLAS) if blas_of().startswith("openblas") else None


def pick_threads(raw_tok_s: dict[int, list[float]], margin: float = _BLAS_MARGIN) -> int:
    """The fewest threads whose median raw throughput is within ``margin`` of the best one.

    More threads must clearly pay: each spins a core between calls that the worker, Redis and the client
    need, and three runs on a noisy machine cannot tell a few percent apart.
    """
    best = max(_pct(v, 50) for v in raw_tok_s.values())
    return min(n for n, v in raw_tok_s.items() if _pct(v, 50) >= best * (1 - margin))


async def _calibrate_blas(raw: RawPath, cfg: BenchConfig) -> BlasThreads:
    """Raw runs at the largest N with 1 and with all cores' OpenBLAS threads, alternating (see pick_threads)."""
    counts = sorted({1, os.cpu_count() or 1})
    prompts = _prompts(cfg.capacity)
    runs: dict[int, list[float]] = {n: [] for n in counts}
    for n in counts:  # warm each setting once
        raw.set_blas_threads(n)
        await raw.run(prompts, cfg.warmup_tokens)
    for _ in range(cfg.blas_repeats):
        for n in counts:
            raw.set_blas_threads(n)
            time.sleep(_SETTLE_S)
            runs[n].append((await raw.run(prompts, cfg.max_tokens)).tok_s)
    chosen = pick_threads(runs)
    raw.set_blas_threads(chosen)
    _say("BLAS threads: " + ", ".join(f"{n}: {_fmt_list(v)} tok/s" for n, v in runs.items()) + f" -> {chosen}")
    return BlasThreads(chosen, runs)


# --- raw: BatchGenerator in this process -----------------------------------------------------------
class RawPath:
    """The raw path: mlx-lm's ``BatchGenerator`` on this process's own MLX thread, the model loaded once."""

    def __init__(self, model: str, capacity: int, redis_pid: int | None = None) -> None:
        from engine.loader import load_model
        from engine.mlx_thread import MLXThread

        self.thread = MLXThread(name="mlx-bench")
        self.loaded: LoadedModel = self.thread.submit(load_model, model).result()
        self.capacity = capacity
        self.meter = _CpuMeter(None, redis_pid)
        self._engine: _EngineRun | None = None

    async def run(self, prompts: list[str], max_tokens: int) -> Run:
        """Prompts tokenized as the worker does, then one :func:`_raw_run` on the MLX thread."""
        fut = self.thread.submit(_raw_run, self.loaded, self._encode(prompts), max_tokens, self.capacity,
                                 self.thread.stream)
        return await asyncio.wrap_future(fut)

    async def engine_run(self, prompts: list[str], max_tokens: int) -> Run:
        """The worker's engine, as the worker builds it, on this MLX thread: the same runs without Redis."""
        if self._engine is None:
            self._engine = await _EngineRun.start(self.loaded, self.capacity, self.thread)
        return await self._engine.run(self._encode(prompts), max_tokens)

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        from engine.prompt import encode_prompt

        return [encode_prompt(self.loaded.tokenizer, p, None) for p in prompts]

    def set_blas_threads(self, n: int) -> None:
        """OpenBLAS threads for this process's later raw runs (set on the MLX thread, which calls BLAS)."""
        blas = _openblas()
        if blas is not None:
            self.thread.submit(blas.openblas_set_num_threads, n).result()

    def close(self) -> None:
        if self._engine is not None:
            self.thread.submit(self._engine.engine.scheduler.backend.close).result()
        self.thread.shutdown()


class _EngineRun:
    """The worker's ``Engine`` (scheduler, detokenizers, pacer, admission wait) with the worker's defaults,
    outputs timed where they leave it (on the MLX thread): what the queue path adds to raw, minus the
    transport."""

    def __init__(self, admit_wait_s: float) -> None:
        self.engine: Engine
        self._admit_wait_s = admit_wait_s
        self._left: dict[str, int] = {}  # rid -> prompt index, while it runs
        self._first: dict[int, float] = {}
        self._tokens = 0
        self._done: asyncio.Future[float] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    async def start(cls, loaded: LoadedModel, capacity: int, thread: Any) -> _EngineRun:
        from engine.loader import EngineOptions, build_engine

        d = WorkerConfig()
        opts = EngineOptions(capacity, d.prefill_batch_size, d.prefill_step_size, d.stream_interval_ms / 1000)
        run = cls(d.admit_wait_ms / 1000)
        run.engine = await build_engine(loaded, thread, run._sink, opts)
        return run

    async def run(self, tokens: list[list[int]], max_tokens: int) -> Run:
        from engine.request import EngineRequest, SamplingParams

        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._first, self._tokens = {}, 0
        tag = uuid.uuid4().hex[:8]
        self._left = {f"{tag}-{i}": i for i in range(len(tokens))}
        t0 = time.perf_counter()
        self.engine.expect(len(tokens), self._admit_wait_s)  # as the worker announces a claimed burst
        for rid, i in self._left.items():
            self.engine.add(EngineRequest(rid, tokens[i], SamplingParams(max_tokens=max_tokens)))
        end = await self._done
        return Run(self._tokens, end - t0, [(self._first.get(i, end) - t0) * 1000 for i in range(len(tokens))])

    def _sink(self, outs: list[RequestOutput]) -> None:  # on the MLX thread
        now = time.perf_counter()
        for out in outs:
            i = self._left.get(out.rid)
            if i is None:
                continue
            if out.token_ids:
                self._first.setdefault(i, now)
            if out.finish is not None:
                self._tokens += out.completion_tokens
                del self._left[out.rid]
        if not self._left and self._done is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._done.set_result, now)
            self._done = None


def _raw_run(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, capacity: int,
             stream: mx.Stream) -> Run:
    """Insert every prompt at once, step until all finish (on the MLX thread)."""
    from mlx_lm.generate import BatchGenerator

    defaults = WorkerConfig()  # the worker's prefill settings, so both paths batch alike
    gen = BatchGenerator(loaded.model, stop_tokens=[[t] for t in sorted(loaded.eos_token_ids)],
                         completion_batch_size=capacity,
                         prefill_batch_size=min(defaults.prefill_batch_size, capacity),
                         prefill_step_size=defaults.prefill_step_size, stream=stream)
    try:
        t0 = time.perf_counter()
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        first: dict[int, float] = {}
        live, tokens = set(uids), 0
        while live:
            _, generated = gen.next()
            now = time.perf_counter()
            for r in generated:
                first.setdefault(r.uid, now)
                tokens += r.finish_reason != "stop"  # an EOS token is not part of the completion
                if r.finish_reason is not None:
                    live.discard(r.uid)
        seconds = time.perf_counter() - t0
    finally:
        gen.close()
    return Run(tokens, seconds, [(first[u] - t0) * 1000 for u in uids])


# --- queue and serial: the worker in a child process -----------------------------------------------
def _worker_phase(
    kind: str, size: str, model: str, cfg: BenchConfig, site: _Site, raw: RawPath | None,
    extra_env: dict[str, str],
) -> _WorkerRun:
    """Start ``arq worker.Settings`` and measure it: batched ("queue", interleaved with ``raw``) or "serial"."""
    batched = raw is not None
    prefix = f"mlxq-bench-{kind}-{uuid.uuid4().hex[:6]}"
    env = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": size, "MLXQ_REDIS_URL": site.url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(cfg.capacity if batched else 1),
           "MLXQ_MAX_JOBS": "0" if batched else "1", **extra_env}
    log_path = site.out / "logs" / f"worker-{size}-{kind}.log"
    log_path.unlink(missing_ok=True)
    worker = WorkerProcess(env, log_path).start()
    try:
        worker.wait_ready()
        assert worker.proc is not None
        blas = blas_of(worker.proc.pid)
        threads = f", {extra_env['OPENBLAS_NUM_THREADS']} BLAS thread(s)" if extra_env else ""
        _say(f"[{size}] {kind}: worker ready (capacity {env['MLXQ_BATCH_CAPACITY']}, {blas}{threads})")
        ctx = _DriveContext(site.url, prefix, size, cfg, worker, _CpuMeter(worker.proc.pid, site.redis_pid))
        driven = asyncio.run(_drive_batched(ctx, raw) if raw is not None else _drive_serial(ctx))
    finally:
        worker.signal(signal.SIGCONT)
        code = worker.stop()
    stats = parse_stats(log_path)
    if stats is None:
        raise RuntimeError(f"no stats line in {log_path} (worker exit {code}); log:\n{worker.tail()}")
    return _WorkerRun(driven, stats, blas)


def parse_stats(log_path: Path) -> WorkerStats | None:
    """The last ``stats: engine_steps=N redis_writes=N events=N ...`` line of a worker log, or None."""
    lines = _STATS_LINE_RE.findall(log_path.read_text(errors="replace")) if log_path.exists() else []
    if not lines:
        return None
    counters = {k: int(v) for k, v in _KEY_VALUE_RE.findall(lines[-1])}
    known = {k: counters.pop(k, 0) for k in ("engine_steps", "redis_writes", "events")}
    return WorkerStats(**known, other=counters)


@contextlib.contextmanager
def _frozen(worker: WorkerProcess) -> Iterator[None]:
    """SIGSTOP the idle worker around a raw run: its polling (~5% of a core) must not tax the ceiling.

    Every run starts after the same idle pause, raw or queue: this machine runs a short burst measurably
    faster after a pause than right after another burst (tiny N=8 raw: ~5,500 tok/s after 0.3 s idle,
    ~4,000 back to back), OpenBLAS threads spin for a while after their last call (2^28 cycles, ~0.1 s),
    and the resumed worker first runs the timers that fell due while it was stopped.
    """
    worker.signal(signal.SIGSTOP)
    time.sleep(_SETTLE_S)
    try:
        yield
    finally:
        worker.signal(signal.SIGCONT)
        time.sleep(_SETTLE_S)


async def _drive_batched(ctx: _DriveContext, raw: RawPath) -> _Driven:
    """Raw and queue run by run in turn (background load hits both alike), then probes and cancels."""
    cfg, model = ctx.cfg, ctx.model
    async with Client(ctx.url, prefix=ctx.prefix) as client:
        await client.generate(model=model, prompt="warm up", max_tokens=cfg.warmup_tokens, timeout=_TIMEOUT_S)
        before = await _commandstats(ctx.url)
        runs = {n: await _measure_at(ctx, client, raw, n) for n in cfg.concurrency}
        commands = _delta(before, await _commandstats(ctx.url))
        raw_probe, queue_probe = await _probe_pair(ctx, client, raw)
        cancel = await _cancel_phase(client, model, cfg)
    queue = _Measured({n: q for n, (_, _, q) in runs.items()}, ctx.meter.stop(), queue_probe)
    raw_measured = _Measured({n: r for n, (r, _, _) in runs.items()}, raw.meter.stop(), raw_probe)
    return _Driven(queue, cancel, commands, raw_measured, {n: e for n, (_, e, _) in runs.items()})


async def _measure_at(ctx: _DriveContext, client: Client, raw: RawPath, n: int
                      ) -> tuple[PathResult, PathResult, PathResult]:
    """Warm the paths at N, then alternate measured runs: raw, engine (both with the worker stopped), queue."""
    prompts, cfg = _prompts(n), ctx.cfg
    with _frozen(ctx.worker):
        await raw.run(prompts, cfg.warmup_tokens)
        await raw.engine_run(prompts, cfg.warmup_tokens)
    await _queue_run(client, ctx.model, prompts, cfg.warmup_tokens)
    raw_runs: list[Run] = []
    engine_runs: list[Run] = []
    queue_runs: list[Run] = []
    for _ in range(cfg.repeats_for(ctx.model)):
        with _frozen(ctx.worker):
            with raw.meter.running():
                raw_runs.append(await raw.run(prompts, cfg.max_tokens))
            time.sleep(_SETTLE_S)  # every run after the same idle pause (see _frozen)
            engine_runs.append(await raw.engine_run(prompts, cfg.max_tokens))
        with ctx.meter.running():
            queue_runs.append(await _queue_run(client, ctx.model, prompts, cfg.max_tokens))
    r, e, q = PathResult.of(raw_runs), PathResult.of(engine_runs), PathResult.of(queue_runs)
    _say(f"[{ctx.model}] N={n:<3} raw {r.tok_s:8.1f} tok/s (runs {_fmt_runs(r)}); "
         f"engine {e.tok_s:8.1f} tok/s (runs {_fmt_runs(e)}); queue {q.tok_s:8.1f} tok/s (runs {_fmt_runs(q)})")
    return r, e, q


async def _probe_pair(ctx: _DriveContext, client: Client, raw: RawPath) -> tuple[list[float], list[float]]:
    """TTFT of single requests, raw and queue in turn."""
    raw_ttft: list[float] = []
    queue_ttft: list[float] = []
    for k in range(ctx.cfg.ttft_probes):
        prompts = _prompts(1, _PROBE_OFFSET + k)
        with _frozen(ctx.worker):
            raw_ttft += (await raw.run(prompts, _PROBE_TOKENS)).ttft_ms
        queue_ttft += (await _queue_run(client, ctx.model, prompts, _PROBE_TOKENS)).ttft_ms
    return raw_ttft, queue_ttft


async def _drive_serial(ctx: _DriveContext) -> _Driven:
    """The one-job-at-a-time worker: its batch shape never changes, so one full-length job warms it."""
    cfg = ctx.cfg
    async with Client(ctx.url, prefix=ctx.prefix) as client:
        await client.generate(model=ctx.model, prompt="warm up", max_tokens=cfg.max_tokens, timeout=_TIMEOUT_S)
        before = await _commandstats(ctx.url)
        paths: dict[int, PathResult] = {}
        for n in cfg.concurrency:
            with ctx.meter.running():
                runs = [await _queue_run(client, ctx.model, _prompts(n), cfg.max_tokens)
                        for _ in range(cfg.serial_repeats)]
            paths[n] = PathResult.of(runs)
            _say(f"[{ctx.model}] N={n:<3} serial {paths[n].tok_s:8.1f} tok/s (runs {_fmt_runs(paths[n])})")
        commands = _delta(before, await _commandstats(ctx.url))
    return _Driven(_Measured(paths, ctx.meter.stop()), None, commands)


async def _queue_run(client: Client, model: str, prompts: list[str], max_tokens: int) -> Run:
    """Submit every prompt at once and follow each job; first submit -> last terminal event."""
    t0 = time.perf_counter()
    traces = await asyncio.gather(*(_submit_and_follow(client, model, p, max_tokens) for p in prompts))
    end = max(t.ended or t0 for t in traces)
    ttft = [((t.first_token or end) - t.submitted) * 1000 for t in traces]
    return Run(sum(t.tokens for t in traces), end - t0, ttft)


async def _submit_and_follow(client: Client, model: str, prompt: str, max_tokens: int) -> _Trace:
    trace = _Trace(time.perf_counter())
    async for ev in client.submit_and_follow(model=model, prompt=prompt, max_tokens=max_tokens, timeout=_TIMEOUT_S):
        if ev.type == "token" and trace.first_token is None:
            trace.first_token = time.perf_counter()
        elif isinstance(ev, DoneEvent):
            trace.ended, trace.tokens = time.perf_counter(), ev.usage.completion_tokens
        elif isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
    return trace


async def _commandstats(url: str) -> dict[str, int]:
    """Calls per Redis command so far (``INFO commandstats``)."""
    redis = redis_client(url)
    try:
        info = await redis.info("commandstats")
    finally:
        await redis.aclose()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if isinstance(v, dict)}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Calls per command between two snapshots (nonzero only, most first), plus ``total``."""
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}
    ordered = dict(sorted(delta.items(), key=lambda kv: -kv[1]))
    return {"total": sum(delta.values()), **ordered}


class _CpuMeter:
    """CPU seconds of this process, the worker and Redis, summed over the windows between resume and pause."""

    def __init__(self, worker_pid: int | None, redis_pid: int | None) -> None:
        self._pids: dict[str, int | str | None] = {"bench": "self", "worker": worker_pid, "redis": redis_pid}
        self._spent = dict.fromkeys(self._pids, 0.0)
        self._wall = 0.0
        self._mark: tuple[float, dict[str, float]] | None = None

    def resume(self) -> None:
        self._mark = (time.perf_counter(), {k: _cpu_seconds(p) for k, p in self._pids.items()})

    def pause(self) -> None:
        if self._mark is None:
            return
        t0, start = self._mark
        self._wall += time.perf_counter() - t0
        for k, p in self._pids.items():
            self._spent[k] += _cpu_seconds(p) - start[k]
        self._mark = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.resume()
        try:
            yield
        finally:
            self.pause()

    def stop(self) -> CpuUse:
        self.pause()
        s = self._spent
        return CpuUse(self._wall, s["bench"], s["worker"], s["redis"])


def _cpu_seconds(pid: int | str | None) -> float:
    """utime + stime of a process (all its threads), from /proc; 0.0 where that is unavailable."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- cancel latency --------------------------------------------------------------------------------
async def _cancel_phase(client: Client, model: str, cfg: BenchConfig) -> CancelResult:
    """``capacity`` long jobs at once; each is cancelled after a random number of its token events."""
    rng = random.Random(0)
    waits = [rng.randint(*cfg.cancel_wait) for _ in range(cfg.capacity)]
    traces = await asyncio.gather(*(
        _cancel_one(client, model, PROMPT.format(i=i), w, cfg.cancel_max_tokens) for i, w in enumerate(waits)
    ))
    done = [t for t in traces if t.finish == "cancelled" and t.cancelled_at is not None and t.ended_at]
    lat = [((t.ended_at or 0.0) - (t.cancelled_at or 0.0)) * 1000 for t in done]
    # Tokens arrive several per event when steps are faster than the stream interval: time per token.
    steps = [(t.token_times[-1] - t.token_times[0]) * 1000 / sum(t.token_counts[1:])
             for t in traces if len(t.token_times) > 1 and sum(t.token_counts[1:]) > 0]
    step = sum(steps) / len(steps) if steps else None
    result = CancelResult(len(traces), len(done), _pct_or_none(lat, 50), _pct_or_none(lat, 99),
                          max(lat) if lat else None, step, step + 50.0 if step is not None else None)
    _say(f"[{model}] cancel: {result.cancelled}/{result.jobs} cancelled, p50 {_fmt(result.p50_ms)} ms, "
         f"p99 {_fmt(result.p99_ms)} ms, decode step {_fmt(result.step_ms_mean)} ms")
    return result


async def _cancel_one(
    client: Client, model: str, prompt: str, wait_tokens: int, max_tokens: int
) -> _CancelTrace:
    trace = _CancelTrace(wait_tokens)
    rid = await client.submit(model=model, prompt=prompt, max_tokens=max_tokens)
    async for ev in client.events(rid, timeout=_TIMEOUT_S):
        now = time.perf_counter()
        if ev.type == "token" and trace.cancelled_at is None:
            trace.token_times.append(now)
            trace.token_counts.append(len(ev.token_ids))
            if len(trace.token_times) >= wait_tokens:
                trace.cancelled_at = time.perf_counter()
                await client.cancel(rid)
        elif isinstance(ev, DoneEvent):
            trace.ended_at, trace.finish = now, ev.finish_reason.value
        elif isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
    return trace


# --- enqueue rate ----------------------------------------------------------------------------------
async def _enqueue_phase(url: str, cfg: BenchConfig) -> EnqueueResult:
    """``enqueue_jobs`` submits one after another, then as many in gathered batches; then clean up."""
    async with Client(url, prefix=f"mlxq-bench-enq-{uuid.uuid4().hex[:6]}") as client:
        ids = [await client.submit(model=_NOBODY, prompt="warm up", max_tokens=1)]  # opens the pool
        t0 = time.perf_counter()
        for i in range(cfg.enqueue_jobs):
            ids.append(await client.submit(model=_NOBODY, prompt=f"job {i}", max_tokens=1))
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        for start in range(0, cfg.enqueue_jobs, cfg.enqueue_batch):
            batch = range(start, min(start + cfg.enqueue_batch, cfg.enqueue_jobs))
            ids += await asyncio.gather(*(client.submit(model=_NOBODY, prompt=f"job {i}", max_tokens=1)
                                          for i in batch))
        gathered = time.perf_counter() - t0
        await _delete_jobs(url, client.keys.queue(_NOBODY), ids)
    result = EnqueueResult(cfg.enqueue_jobs, cfg.enqueue_jobs / sequential, cfg.enqueue_jobs / gathered,
                           cfg.enqueue_batch)
    _say(f"enqueue: {result.sequential_jobs_s:.0f} jobs/s sequential, "
         f"{result.gathered_jobs_s:.0f} jobs/s gathered")
    return result


async def _delete_jobs(url: str, queue: str, ids: list[str]) -> None:
    redis = redis_client(url)
    try:
        await redis.unlink(queue)
        for start in range(0, len(ids), 500):
            await redis.unlink(*(Keys().job(rid) for rid in ids[start : start + 500]))
    finally:
        await redis.aclose()


# --- targets ---------------------------------------------------------------------------------------
def _targets(sizes: list[SizeResult], enqueue: EnqueueResult) -> list[Target]:
    """The targets of issue #3 that this run measured."""
    out: list[Target] = []
    for s in sizes:
        floor = 0.95 if s.size == "small" else 0.80
        for r in s.rows:
            if r.n > 1:
                out.append(_at_least(f"queue/raw {s.size} N={r.n} (best runs)", r.queue_over_raw, floor))
                out.append(_at_least(f"queue/raw {s.size} N={r.n} (median of pairs)", r.queue_over_raw_paired, floor))
        out += [_at_least(f"queue/serial {s.size} N=32", r.queue_over_serial, 6.0)
                for r in s.rows if r.n == 32 and s.size == "small"]
        out.append(_at_most(f"queue-added TTFT p50 {s.size} N=1", s.ttft_n1.added_p50_ms, 10.0, " ms"))
        out.append(_at_most(f"queue-added TTFT p99 {s.size} N=1", s.ttft_n1.added_p99_ms, 50.0, " ms"))
        c = s.cancel
        if c.p99_ms is not None and c.budget_ms is not None:
            out.append(_at_most(f"cancel p99 {s.size} (step {c.step_ms_mean:.1f} ms + 50)", c.p99_ms,
                                c.budget_ms, " ms"))
        out.append(_at_most(f"round trips per step {s.size}", s.round_trips.queue_writes_per_step, 1.0, ""))
    out.append(_at_least("enqueue jobs/s (sequential awaits)", enqueue.sequential_jobs_s, 2000.0))
    return out


def _at_least(name: str, value: float, limit: float) -> Target:
    return Target(name, value, f">= {limit:g}", value >= limit)


def _at_most(name: str, value: float, limit: float, unit: str) -> Target:
    return Target(name, value, f"<= {limit:.1f}{unit}", value <= limit)


# --- output ----------------------------------------------------------------------------------------
def write_outputs(result: BenchResult, out: Path) -> str:
    """Write results.json, results.md and chart.png into ``out``; returns the markdown."""
    (out / "results.json").write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    md = render_markdown(result)
    (out / "results.md").write_text(md)
    _chart(result, out / "chart.png")
    return md


def render_markdown(result: BenchResult) -> str:
    """``results.md``: a header, the main table, then one section per measurement and the targets."""
    return "\n".join([*_md_header(result), *_md_table(result), *_md_engine(result), *_md_blas(result),
                      *_md_ttft(result), *_md_cancel(result), *_md_round_trips(result), *_md_cpu(result),
                      *_md_enqueue(result), *_md_targets(result)])


def _md_header(result: BenchResult) -> list[str]:
    m, c = result.machine, result.config
    return [
        "# mlxq bench", "",
        f"{m['date']} · {m['cpus']} cores · BLAS: **{m['blas']}** · mlx {m['mlx']} · "
        f"mlx-lm {m['mlx_lm']} · arq {m['arq']} · redis {m.get('redis', '?')} · python {m['python']} · "
        f"run time {result.seconds:.0f} s · load average at start {m['loadavg_start']}, "
        f"at end {m.get('loadavg_end', '?')}; a fixed Python loop took {m['probe_ms_start']} ms at the start, "
        f"{m.get('probe_ms_end', '?')} ms at the end (other tenants skew every number)",
        "",
        "Worker settings: " + ", ".join(f"`{k}={v}`" for k, v in m.get("worker_env", {}).items()) + ".",
        "",
        *([f"**Warning: mlx-cpu's bundled BLAS ran; batching gains little with it** (install OpenBLAS: "
           f"`apt-get install libopenblas0-pthread`, then `mlxq bench` preloads {OPENBLAS}).", ""]
          if m["blas"].startswith("bundled") else []),
        f"Generated random-weight models; greedy; max_tokens {c.max_tokens}; prompts \"{PROMPT}\". "
        f"Throughput: best of {c.repeats} run(s) ({c.tiny_repeats} for the tiny model) for raw and queue, "
        "which alternate run by run at each N, with an engine run between them "
        "(the idle queue worker SIGSTOPped during raw and engine runs), and of "
        f"{c.serial_repeats} for serial, each after a warm-up. Aggregate tok/s = completion tokens / "
        "(first submit → last terminal event; raw: insert → last token). TTFT pooled over those runs "
        "(raw: insert → first token; queue: submit → first token event). queue/raw = best queue run / best "
        "raw run; queue/raw paired = the median, over the run pairs, of each queue run / the raw run just "
        "before it (robust to the machine's slow swings).",
        "",
    ]


def _md_table(result: BenchResult) -> list[str]:
    lines = ["## Throughput and TTFT", "",
             "| size | N | raw tok/s | queue tok/s | serial tok/s | queue/raw | queue/raw paired | queue/serial "
             "| TTFT p50 ms raw / queue / added | TTFT p99 ms raw / queue / added |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        for r in s.rows:
            lines.append(
                f"| {s.size} | {r.n} | {r.raw.tok_s:.1f} | {r.queue.tok_s:.1f} | {r.serial.tok_s:.1f} "
                f"| {r.queue_over_raw:.2f} | {r.queue_over_raw_paired:.2f} | {r.queue_over_serial:.2f} "
                f"| {r.raw.ttft_p50_ms:.1f} / {r.queue.ttft_p50_ms:.1f} / {r.added_ttft_p50_ms:+.1f} "
                f"| {r.raw.ttft_p99_ms:.1f} / {r.queue.ttft_p99_ms:.1f} / {r.added_ttft_p99_ms:+.1f} |")
    return [*lines, ""]


def _md_engine(result: BenchResult) -> list[str]:
    rows = [(s.size, r) for s in result.sizes for r in s.rows if r.engine is not None]
    if not rows:
        return []
    lines = ["## Where the queue's cost goes", "",
             "engine = the worker's own engine (scheduler, detokenizers, pacer, admission wait; the worker's "
             "defaults) driven in this process on the raw path's MLX thread, without Redis, run between each "
             "raw and queue run. engine/raw is the engine's bookkeeping; queue/engine the transport (client, "
             "Redis, arq, the worker's event loop and the CPU they take from the model on this machine). "
             "Ratios are medians over the run triples.", "",
             "| size | N | raw tok/s | engine tok/s | queue tok/s | engine/raw | queue/engine | queue/raw "
             "| TTFT p50 ms raw / engine / queue |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, r in rows:
        assert r.engine is not None
        lines.append(f"| {size} | {r.n} | {r.raw.tok_s:.1f} | {r.engine.tok_s:.1f} | {r.queue.tok_s:.1f} "
                     f"| {r.engine_over_raw_paired:.2f} | {r.queue_over_engine_paired:.2f} "
                     f"| {r.queue_over_raw_paired:.2f} | {r.raw.ttft_p50_ms:.1f} / {r.engine.ttft_p50_ms:.1f} / "
                     f"{r.queue.ttft_p50_ms:.1f} |")
    return [*lines, ""]


def _md_blas(result: BenchResult) -> list[str]:
    rows = [(s.size, s.blas_threads) for s in result.sizes if s.blas_threads is not None]
    if not rows:
        return []
    n = result.config.capacity
    lines = ["## OpenBLAS threads", "",
             f"Chosen per size before its runs: raw at N={n} with each thread count, alternating; the fewest "
             f"threads whose median is within {_BLAS_MARGIN:.0%} of the best is the ceiling's setting, and the "
             "queue and serial workers run with it too (`OPENBLAS_NUM_THREADS`).", "",
             "| size | threads | raw tok/s per thread count (runs) |", "|---|---:|---|"]
    for size, t in rows:
        runs = "; ".join(f"{k}: {_fmt_list(v)}" for k, v in sorted(t.raw_tok_s.items()))
        lines.append(f"| {size} | {t.chosen} | {runs} |")
    return [*lines, ""]


def _md_ttft(result: BenchResult) -> list[str]:
    lines = ["## TTFT at N=1", "",
             f"{result.config.ttft_probes} sequential single requests per path, raw and queue in turn "
             f"(max_tokens {_PROBE_TOKENS}).", "",
             "| size | raw p50 | raw p99 | queue p50 | queue p99 | added p50 | added p99 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        p = s.ttft_n1
        lines.append(f"| {s.size} | {p.raw_p50_ms:.1f} | {p.raw_p99_ms:.1f} | {p.queue_p50_ms:.1f} "
                     f"| {p.queue_p99_ms:.1f} | {p.added_p50_ms:+.1f} | {p.added_p99_ms:+.1f} |")
    return [*lines, ""]


def _md_cancel(result: BenchResult) -> list[str]:
    c0 = result.config
    lines = ["## Cancel → terminal event", "",
             f"{c0.capacity} jobs at once on the queue worker (max_tokens {c0.cancel_max_tokens}); each is "
             f"cancelled after {c0.cancel_wait[0]}..{c0.cancel_wait[1]} of its token events; timed by the "
             "client. Decode step = a job's time per generated token before its cancel (an event carries "
             "several tokens when steps are faster than the stream interval).", "",
             "| size | jobs | cancelled | p50 ms | p99 ms | max ms | decode step ms "
             "| budget ms (step + 50) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        c = s.cancel
        lines.append(f"| {s.size} | {c.jobs} | {c.cancelled} | {_fmt(c.p50_ms)} | {_fmt(c.p99_ms)} "
                     f"| {_fmt(c.max_ms)} | {_fmt(c.step_ms_mean)} | {_fmt(c.budget_ms)} |")
    return [*lines, ""]


def _md_round_trips(result: BenchResult) -> list[str]:
    lines = ["## Redis round trips per engine step", "",
             "From each worker's `stats:` line (its whole life: warm-up, runs, probes, cancels): "
             "event-publishing pipelines / engine steps. Commands: Redis `INFO commandstats` deltas over the "
             "queue path's throughput runs (every client: worker, arq, producer).", "",
             "| size | worker | engine steps | redis writes | events | other counters | writes/step "
             "| publish | xadd | all commands | top commands |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in result.sizes:
        t = s.round_trips
        for kind, w in (("queue", t.queue_worker), ("serial", t.serial_worker)):
            cmd = "- | - | - | -"
            if kind == "queue":
                c = t.commandstats
                top = ", ".join(f"{k} {v}" for k, v in list(c.items())[1:6])
                cmd = f"{c.get('publish', 0)} | {c.get('xadd', 0)} | {c.get('total', 0)} | {top}"
            other = " ".join(f"{k}={v}" for k, v in w.other.items()) or "-"
            lines.append(f"| {s.size} | {kind} | {w.engine_steps} | {w.redis_writes} | {w.events} "
                         f"| {other} | {w.writes_per_step:.3f} | {cmd} |")
    return [*lines, ""]


def _md_cpu(result: BenchResult) -> list[str]:
    cpus = result.machine["cpus"] or 1
    lines = ["## CPU during the throughput runs", "",
             f"CPU seconds per process over the measured runs (warm-ups excluded); {cpus} cores give "
             f"{cpus} s per wall second. bench = this process (the model on the raw path, the client otherwise).",
             "", "| size | path | wall s | bench s | worker s | redis s | cores busy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for s in result.sizes:
        for path, c in s.cpu.items():
            busy = (c.bench_s + c.worker_s + c.redis_s) / c.wall_s if c.wall_s else 0.0
            lines.append(f"| {s.size} | {path} | {c.wall_s:.2f} | {c.bench_s:.2f} | {c.worker_s:.2f} "
                         f"| {c.redis_s:.2f} | {busy:.2f} |")
    return [*lines, ""]


def _md_enqueue(result: BenchResult) -> list[str]:
    e = result.enqueue
    return ["## Enqueue rate", "",
            f"One producer, {e.jobs} `client.submit` calls into a queue no worker serves "
            "(its keys deleted after).", "",
            "| producer | jobs/s |", "|---|---:|",
            f"| sequential awaits | {e.sequential_jobs_s:.0f} |",
            f"| asyncio.gather, batches of {e.gather_batch} | {e.gathered_jobs_s:.0f} |", ""]


def _md_targets(result: BenchResult) -> list[str]:
    lines = ["## Targets", "", "| target | value | limit | result |", "|---|---:|---:|---|"]
    lines += [f"| {t.name} | {_num(t.value)} | {t.limit} | {'PASS' if t.passed else '**MISS**'} |"
              for t in result.targets]
    return [*lines, ""]


def _chart(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result.sizes), figsize=(5.5 * len(result.sizes), 4.2), squeeze=False)
    for ax, s in zip(axes[0], result.sizes, strict=True):
        ns = [r.n for r in s.rows]
        for label, pick in (("raw BatchGenerator", lambda r: r.raw), ("queue", lambda r: r.queue),
                            ("serial", lambda r: r.serial)):
            ax.plot(ns, [pick(r).tok_s for r in s.rows], marker="o", label=label)
        if all(r.engine is not None for r in s.rows):
            ax.plot(ns, [r.engine.tok_s for r in s.rows if r.engine is not None], marker=".", linestyle=":",
                    label="engine, no Redis")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set(title=f"{s.size} model", xlabel="concurrent requests N", ylabel="aggregate tok/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    m = result.machine
    fig.suptitle(f"mlxq bench · BLAS: {m['blas'].split(' ')[0]} · {m['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- small helpers ---------------------------------------------------------------------------------
def _prompts(n: int, offset: int = 0) -> list[str]:
    return [PROMPT.format(i=offset + i) for i in range(n)]


def _pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _pct_or_none(values: Sequence[float], q: float) -> float | None:
    return _pct(values, q) if values else None


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _paired(runs: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over run i of ``runs[i] / baseline[i]`` (runs made seconds apart); 0.0 for no runs."""
    return _pct([_ratio(r, b) for r, b in zip(runs, baseline)], 50)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _fmt_runs(p: PathResult) -> str:
    return _fmt_list(p.runs_tok_s)


def _fmt_list(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
