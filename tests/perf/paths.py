"""The paths the benchmark drives: raw mlx-lm in this process, the engine without Redis, the queue and a
serial worker in a child process; and the cancel and enqueue phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxq.api.client import Client
from mlxq.api.connection import redis_client
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import DoneEvent, ErrorEvent
from mlxq.worker.config import WorkerConfig
from mlxq.worker.tools import bench
from mlxq.worker.tools.bench.paths import frozen, run_queue
from mlxq.worker.tools.bench.runs import PROMPT, SETTLE_S, TIMEOUT_S, PathResult, Run, prompt_batch, say
from mlxq.worker.tools.blas import OPENBLAS, blas_of, openblas
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import free_port

from .peer import ServerPath
from .runs import (
    NOBODY,
    PROBE_OFFSET,
    PROBE_TOKENS,
    BenchConfig,
    CancelResult,
    CpuUse,
    EnqueueResult,
    GatewayResult,
    Site,
    WorkerStats,
    fmt,
    fmt_runs,
    pct_or_none,
)

if TYPE_CHECKING:
    from mlxq.engine.core.engine import Engine
    from mlxq.engine.core.request import RequestOutput
    from mlxq.engine.mlx.loader import LoadedModel


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
    gateway: GatewayResult | None = None
    server: dict[int, PathResult] = field(default_factory=dict)  # mlx_lm.server's runs, when it ran


@dataclass(frozen=True, slots=True)
class DriveContext:
    """One running worker and what measuring it needs."""

    url: str
    prefix: str
    model: str
    cfg: BenchConfig
    worker: WorkerProcess
    meter: _CpuMeter
    out: Path
    metrics_url: str
    server: ServerPath | None = None  # mlx_lm.server, the peer path (peer.py)


@dataclass(frozen=True, slots=True)
class _WorkerRun:
    driven: _Driven
    stats: WorkerStats
    blas: str


@dataclass(slots=True)
class _CancelTrace:
    """One job of the cancel phase."""

    wait_tokens: int
    token_times: list[float] = field(default_factory=list)  # token events before the cancel
    token_counts: list[int] = field(default_factory=list)  # tokens in each (several when steps are fast)
    cancelled_at: float | None = None
    ended_at: float | None = None
    finish: str = ""


def openblas_in_use() -> Any:
    """The preloaded OpenBLAS (ctypes), or None when mlx runs another BLAS."""
    return openblas(OPENBLAS) if blas_of().startswith("openblas") else None


# --- raw: BatchGenerator in this process -----------------------------------------------------------
class RawPath(bench.RawPath):
    """The product bench's raw path, metered (this process's CPU and Redis's), with the worker's engine on the
    same MLX thread and model (:meth:`engine_run`) and the OpenBLAS thread count settable."""

    def __init__(self, model: str, capacity: int, redis_pid: int | None = None) -> None:
        super().__init__(model, capacity)
        self.meter = _CpuMeter(None, redis_pid)
        self._engine: _EngineRun | None = None

    async def engine_run(self, prompts: list[str], max_tokens: int) -> Run:
        """The worker's engine, as the worker builds it, on this MLX thread: the same runs without Redis."""
        if self._engine is None:
            self._engine = await _EngineRun.start(self.loaded, self.capacity, self.thread)
        return await self._engine.run(self.encode(prompts), max_tokens)

    def set_blas_threads(self, n: int) -> None:
        """OpenBLAS threads for this process's later raw runs (set on the MLX thread, which calls BLAS)."""
        blas = openblas_in_use()
        if blas is not None:
            self.thread.submit(blas.openblas_set_num_threads, n).result()

    def close(self) -> None:
        if self._engine is not None:
            self.thread.submit(self._engine.engine.scheduler.backend.close).result()
        super().close()


class EngineClock:
    """Times a run's requests where their outputs leave an engine (its sink, on the MLX thread): first output
    with tokens, and the run's end once every request has finished."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}  # rid -> request index, while it runs
        self._first: dict[int, float] = {}
        self._tokens = 0
        self._done: asyncio.Future[float] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def begin(self, n: int) -> list[str]:
        """A new run of ``n`` requests (on the event loop): their ids, in order."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._first, self._tokens = {}, 0
        tag = uuid.uuid4().hex[:8]
        self._left = {f"{tag}-{i}": i for i in range(n)}
        return list(self._left)

    async def end(self, t0: float, n: int) -> Run:
        """The run, once its last request has finished."""
        assert self._done is not None
        end = await self._done
        return Run(self._tokens, end - t0, [(self._first.get(i, end) - t0) * 1000 for i in range(n)])

    def sink(self, outs: list[RequestOutput]) -> None:  # on the MLX thread
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
            # Taken before its result is set: once set, the loop thread may start the next run (a new future
            # here) before this thread would get to clear it, and that run would never end.
            done, self._done = self._done, None
            self._loop.call_soon_threadsafe(done.set_result, now)


class _EngineRun:
    """The worker's ``Engine`` (scheduler, detokenizers, pacer, admission wait) with the worker's defaults,
    outputs timed where they leave it (on the MLX thread): what the queue path adds to raw, minus the
    transport."""

    def __init__(self, admit_wait_s: float) -> None:
        self.engine: Engine
        self.clock = EngineClock()
        self._admit_wait_s = admit_wait_s

    @classmethod
    async def start(cls, loaded: LoadedModel, capacity: int, thread: Any) -> _EngineRun:
        from mlxq.engine.mlx.loader import EngineOptions, build_engine

        d = WorkerConfig()
        opts = EngineOptions(capacity, d.prefill_batch_size, d.prefill_step_size, d.stream_interval_ms / 1000,
                             stream_rate=d.stream_rate)
        run = cls(d.admit_wait_ms / 1000)
        run.engine = await build_engine(loaded, thread, run.clock.sink, opts)
        return run

    async def run(self, tokens: list[list[int]], max_tokens: int) -> Run:
        from mlxq.engine.core.request import EngineRequest, SamplingParams

        rids = self.clock.begin(len(tokens))
        t0 = time.perf_counter()
        self.engine.expect(len(tokens), self._admit_wait_s)  # as the worker announces a claimed burst
        for rid, prompt in zip(rids, tokens):
            self.engine.add(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens)))
        return await self.clock.end(t0, len(tokens))


# --- queue and serial: the worker in a child process -----------------------------------------------
GatewayPhase = Callable[["DriveContext", Client], Awaitable[GatewayResult | None]]


def worker_phase(
    kind: str, size: str, model: str, cfg: BenchConfig, site: Site, raw: RawPath | None,
    extra_env: dict[str, str], gateway: GatewayPhase | None = None, server: ServerPath | None = None,
) -> _WorkerRun:
    """Start ``arq mlxq.worker.Settings`` and measure it: batched ("queue", interleaved with ``raw``, then the
    ``gateway`` phase on the same worker) or "serial"."""
    batched = raw is not None
    prefix = f"mlxq-bench-{kind}-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": size, "MLXQ_REDIS_URL": site.url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(cfg.capacity if batched else 1),
           "MLXQ_MAX_JOBS": "0" if batched else "1", "MLXQ_METRICS_PORT": str(port),
           "MLXQ_METRICS_ADDR": "127.0.0.1", "MLXQ_HEARTBEAT": "0.5", **extra_env}
    log_path = site.out / "logs" / f"worker-{size}-{kind}.log"
    log_path.unlink(missing_ok=True)
    worker = WorkerProcess(env, log_path).start()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        worker.wait_ready()
        assert worker.proc is not None
        blas = blas_of(worker.proc.pid)
        threads = f", {extra_env['OPENBLAS_NUM_THREADS']} BLAS thread(s)" if extra_env else ""
        say(f"[{size}] {kind}: worker ready (capacity {env['MLXQ_BATCH_CAPACITY']}, {blas}{threads})")
        ctx = DriveContext(site.url, prefix, size, cfg, worker, _CpuMeter(worker.proc.pid, site.redis_pid),
                            site.out, metrics_url, server)
        driven = asyncio.run(_drive_batched(ctx, raw, gateway) if raw is not None else _drive_serial(ctx))
        stats = scrape_stats(metrics_url)  # the worker's own counters, as its metrics endpoint serves them
    finally:
        worker.signal(signal.SIGCONT)
        code = worker.stop()
    if stats is None:
        raise RuntimeError(f"no metrics at {metrics_url} (worker exit {code}); log:\n{worker.tail()}")
    return _WorkerRun(driven, stats, blas)


def scrape_stats(url: str) -> WorkerStats | None:
    """A worker's counters from its Prometheus endpoint (summed over labels), or None if it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return None
    counters: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            name = family.name.removeprefix("mlxq:")
            counters[name] = int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    known = {k: counters.pop(k, 0) for k in ("engine_steps", "redis_writes", "events")}
    return WorkerStats(**known, other=counters)


def _running_in(metrics: bytes) -> bool:
    """Whether a scrape of a worker's metrics shows sequences in a batch."""
    from prometheus_client.parser import text_string_to_metric_families

    return any(s.value > 0 for f in text_string_to_metric_families(metrics.decode()) for s in f.samples
               if s.name == "mlxq:num_requests_running")


async def _live_sample(ctx: DriveContext, client: Client, n: int) -> None:
    """While jobs run: ``mlxq status`` and the worker's metrics endpoint as they read then, saved beside the
    results (live-status.txt, live-metrics.txt): both show live numbers, from any host. Waves of 2N jobs (N in
    the batch, more waiting in Redis) until a health record written mid-wave shows sequences running."""
    from mlxq.api.status import collect, render

    t0 = time.time()

    async def sample() -> None:
        while True:
            report = await collect(client)
            if any(m.running for w in report.workers if w.updated_at > t0 for m in w.models):
                text = await asyncio.to_thread(lambda: urllib.request.urlopen(ctx.metrics_url, timeout=10).read())
                if _running_in(text):  # read while the batch still ran, both of them
                    (ctx.out / "live-status.txt").write_text(render(report) + "\n")
                    (ctx.out / "live-metrics.txt").write_bytes(text)
                    return
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    deadline = time.monotonic() + 120
    while not sampler.done() and time.monotonic() < deadline:
        await run_queue(client, ctx.model, prompt_batch(2 * n), ctx.cfg.max_tokens)
    if not sampler.done():
        sampler.cancel()
        say(f"[{ctx.model}] no health record showed a running batch in 120 s: no live sample")
        return
    await sampler
    say(f"[{ctx.model}] status and metrics sampled mid-run: {ctx.out / 'live-status.txt'}, "
         f"{ctx.out / 'live-metrics.txt'}")


async def _drive_batched(ctx: DriveContext, raw: RawPath, gateway: GatewayPhase | None = None) -> _Driven:
    """Raw and queue run by run in turn (background load hits both alike), then probes, the gateway and cancels."""
    cfg, model = ctx.cfg, ctx.model
    async with Client(ctx.url, prefix=ctx.prefix) as client:
        await client.generate(model=model, prompt="warm up", max_tokens=cfg.warmup_tokens, timeout=TIMEOUT_S)
        before = await _commandstats(ctx.url)
        runs = {n: await _measure_at(ctx, client, raw, n) for n in cfg.concurrency}
        commands = _delta(before, await _commandstats(ctx.url))
        raw_probe, queue_probe = await _probe_pair(ctx, client, raw)
        via_http = await gateway(ctx, client) if gateway is not None else None
        cancel = await _cancel_phase(client, model, cfg)
        await _live_sample(ctx, client, max(cfg.concurrency))
    queue = _Measured({n: q for n, (_, _, q, _) in runs.items()}, ctx.meter.stop(), queue_probe)
    raw_measured = _Measured({n: r for n, (r, _, _, _) in runs.items()}, raw.meter.stop(), raw_probe)
    return _Driven(queue, cancel, commands, raw_measured, {n: e for n, (_, e, _, _) in runs.items()}, via_http,
                   {n: sv for n, (_, _, _, sv) in runs.items() if sv is not None})


PathRun = Callable[[int], Awaitable[Run]]  # one run of a path at some N, given max_tokens


async def alternate_runs(worker: WorkerProcess, cfg: BenchConfig, repeats: int, raw: PathRun, engine: PathRun,
                         queue: PathRun, server: PathRun | None = None
                         ) -> tuple[PathResult, PathResult, PathResult, PathResult | None]:
    """Warm the paths, then alternate measured runs: raw, engine (both with the worker stopped), queue, and the
    peer server (the worker stopped) when there is one."""
    with frozen(worker):
        await raw(cfg.warmup_tokens)
        await engine(cfg.warmup_tokens)
        if server is not None:
            await server(cfg.warmup_tokens)
    await queue(cfg.warmup_tokens)
    runs: tuple[list[Run], list[Run], list[Run], list[Run]] = ([], [], [], [])
    for _ in range(repeats):
        with frozen(worker):
            runs[0].append(await raw(cfg.max_tokens))
            time.sleep(SETTLE_S)  # every run after the same idle pause (see frozen)
            runs[1].append(await engine(cfg.max_tokens))
        runs[2].append(await queue(cfg.max_tokens))
        if server is not None:
            with frozen(worker):
                runs[3].append(await server(cfg.max_tokens))
    peer = PathResult.of(runs[3]) if runs[3] else None
    return PathResult.of(runs[0]), PathResult.of(runs[1]), PathResult.of(runs[2]), peer


async def _measure_at(ctx: DriveContext, client: Client, raw: RawPath, n: int
                      ) -> tuple[PathResult, PathResult, PathResult, PathResult | None]:
    """Raw, engine, queue (and mlx_lm.server) runs at N, alternating (the raw and queue runs metered)."""
    prompts = prompt_batch(n)

    async def raw_run(max_tokens: int) -> Run:
        with raw.meter.running():
            return await raw.run(prompts, max_tokens)

    async def queue_run(max_tokens: int) -> Run:
        with ctx.meter.running():
            return await run_queue(client, ctx.model, prompts, max_tokens)

    peer = ctx.server
    server_run = functools.partial(_server_run, peer, prompts) if peer is not None else None
    r, e, q, sv = await alternate_runs(ctx.worker, ctx.cfg, ctx.cfg.repeats_for(ctx.model), raw_run,
                                       functools.partial(raw.engine_run, prompts), queue_run, server_run)
    tail = f"; mlx_lm.server {sv.tok_s:8.1f} tok/s (runs {fmt_runs(sv)})" if sv is not None else ""
    say(f"[{ctx.model}] N={n:<3} raw {r.tok_s:8.1f} tok/s (runs {fmt_runs(r)}); "
         f"engine {e.tok_s:8.1f} tok/s (runs {fmt_runs(e)}); queue {q.tok_s:8.1f} tok/s (runs {fmt_runs(q)})"
         f"{tail}")
    return r, e, q, sv


async def _server_run(server: ServerPath, prompts: list[str], max_tokens: int) -> Run:
    """One burst on mlx_lm.server, the process running only for it (stopped between its runs)."""
    os.kill(server.proc.pid, signal.SIGCONT)
    try:
        return await server.run(prompts, max_tokens)
    finally:
        os.kill(server.proc.pid, signal.SIGSTOP)


async def _probe_pair(ctx: DriveContext, client: Client, raw: RawPath) -> tuple[list[float], list[float]]:
    """TTFT of single requests, raw and queue in turn."""
    raw_ttft: list[float] = []
    queue_ttft: list[float] = []
    for k in range(ctx.cfg.ttft_probes):
        prompts = prompt_batch(1, PROBE_OFFSET + k)
        with frozen(ctx.worker):
            raw_ttft += (await raw.run(prompts, PROBE_TOKENS)).ttft_ms
        queue_ttft += (await run_queue(client, ctx.model, prompts, PROBE_TOKENS)).ttft_ms
    return raw_ttft, queue_ttft


async def _drive_serial(ctx: DriveContext) -> _Driven:
    """The one-job-at-a-time worker: its batch shape never changes, so one full-length job warms it."""
    cfg = ctx.cfg
    async with Client(ctx.url, prefix=ctx.prefix) as client:
        await client.generate(model=ctx.model, prompt="warm up", max_tokens=cfg.max_tokens, timeout=TIMEOUT_S)
        before = await _commandstats(ctx.url)
        paths: dict[int, PathResult] = {}
        for n in cfg.concurrency:
            with ctx.meter.running():
                runs = [await run_queue(client, ctx.model, prompt_batch(n), cfg.max_tokens)
                        for _ in range(cfg.serial_repeats)]
            paths[n] = PathResult.of(runs)
            say(f"[{ctx.model}] N={n:<3} serial {paths[n].tok_s:8.1f} tok/s (runs {fmt_runs(paths[n])})")
        commands = _delta(before, await _commandstats(ctx.url))
    return _Driven(_Measured(paths, ctx.meter.stop()), None, commands)


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

    def fresh(self) -> _CpuMeter:
        """A meter of the same processes, from zero."""
        meter = _CpuMeter(None, None)
        meter._pids = dict(self._pids)
        return meter

    def resume(self) -> None:
        self._mark = (time.perf_counter(), {k: cpu_seconds(p) for k, p in self._pids.items()})

    def pause(self) -> None:
        if self._mark is None:
            return
        t0, start = self._mark
        self._wall += time.perf_counter() - t0
        for k, p in self._pids.items():
            self._spent[k] += cpu_seconds(p) - start[k]
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


def cpu_seconds(pid: int | str | None) -> float:
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
    result = CancelResult(len(traces), len(done), pct_or_none(lat, 50), pct_or_none(lat, 99),
                          max(lat) if lat else None, step, step + 50.0 if step is not None else None)
    say(f"[{model}] cancel: {result.cancelled}/{result.jobs} cancelled, p50 {fmt(result.p50_ms)} ms, "
         f"p99 {fmt(result.p99_ms)} ms, decode step {fmt(result.step_ms_mean)} ms")
    return result


async def _cancel_one(
    client: Client, model: str, prompt: str, wait_tokens: int, max_tokens: int
) -> _CancelTrace:
    trace = _CancelTrace(wait_tokens)
    rid = await client.submit(model=model, prompt=prompt, max_tokens=max_tokens)
    async for ev in client.events(rid, timeout=TIMEOUT_S):
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
async def enqueue_phase(url: str, cfg: BenchConfig) -> EnqueueResult:
    """``enqueue_jobs`` submits one after another, then as many in gathered batches; then clean up."""
    async with Client(url, prefix=f"mlxq-bench-enq-{uuid.uuid4().hex[:6]}") as client:
        ids = [await client.submit(model=NOBODY, prompt="warm up", max_tokens=1)]  # opens the pool
        t0 = time.perf_counter()
        for i in range(cfg.enqueue_jobs):
            ids.append(await client.submit(model=NOBODY, prompt=f"job {i}", max_tokens=1))
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        for start in range(0, cfg.enqueue_jobs, cfg.enqueue_batch):
            batch = range(start, min(start + cfg.enqueue_batch, cfg.enqueue_jobs))
            ids += await asyncio.gather(*(client.submit(model=NOBODY, prompt=f"job {i}", max_tokens=1)
                                          for i in batch))
        gathered = time.perf_counter() - t0
        await _delete_jobs(url, client.keys.queue(NOBODY), ids)
    result = EnqueueResult(cfg.enqueue_jobs, cfg.enqueue_jobs / sequential, cfg.enqueue_jobs / gathered,
                           cfg.enqueue_batch)
    say(f"enqueue: {result.sequential_jobs_s:.0f} jobs/s sequential, "
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
