"""The control plane's ceiling: how many concurrent token streams one Redis carries, and one producer's enqueue rate.

Simulated workers (``simworker.py``: the real worker process, its claims, leases, pacer, run table and Redis
traffic, over engines that make ``--rate`` tokens a second per row and run no model) serve ``--rows`` rows per
engine, each engine a model of its own (``sim-0``, ``sim-1``, ...), spread over ``--workers`` processes: a fleet of
full batches. Subscriber processes (``--subscribers``) submit and follow the streams, most through the client's
``stream``, a ``--gateway-share`` through ``mlxq gateway``'s SSE (``POST /v1/completions``). Every token's text is
the wall-clock time the simulated batch made it, so each subscriber measures delivery (engine output -> text in
the subscriber's hands) per token; the processes share the machine's clock.

At each level N (``--levels``), N streams run at once; over a ``--window`` after they all started, it records
delivery p50/p99, the tokens delivered against what N streams at the rate make, and the CPU of Redis, each worker,
the gateway, each subscriber process and the whole machine; then names the first bottleneck (a process using a
whole core, or the machine's cores all busy). Levels stop rising once p99 passes ``--stop-p99-ms``.

Then one producer's enqueue rate: ``Client.submit`` awaited one after another, and with C submits in flight (the
client's enqueuer pipelines what is submitted together).

``python3 -m tests.perf.scale --out DIR`` writes ``scale.md`` and ``scale.json`` (``--quick``: a few streams, a few
seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.worker.tools.bench.http import SseClient
from mlxq.worker.tools.bench.runs import say
from mlxq.worker.tools.process import GatewayProcess, WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

from .paths import cpu_seconds
from .simworker import make_model

__all__ = ["ScaleConfig", "main", "run"]

_BIN_MS = 0.1  # latency histogram bins
_P99_TARGET_MS = 50.0
_BUSY = 0.9  # a process at this share of a core, or the machine at this share of its cores: the bottleneck
_NOBODY = "mlxq-scale-nobody"  # the enqueue phase's model: no worker serves it


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """What one run measures; :meth:`quick` is a smoke run of a few seconds."""

    levels: tuple[int, ...] = (100, 250, 500, 1000, 2000, 5000)
    rate: float = 20.0  # tokens a second per stream
    window_s: float = 8.0
    workers: int = 2
    subscribers: int = 2
    rows: int = 64  # rows per simulated engine (a full batch of a real one)
    gateway_share: float = 0.2
    stop_p99_ms: float = 1000.0
    ramp_s: float = 2.0  # before a level's window opens (plus a second per 1,000 streams): submits, claims
    enqueue_jobs: int = 20_000
    enqueue_concurrency: tuple[int, ...] = (1, 16, 64, 256)
    quick: bool = False

    @classmethod
    def quick_config(cls) -> ScaleConfig:
        return cls(levels=(2, 4), window_s=2.0, workers=1, subscribers=1, rows=2, gateway_share=0.5, ramp_s=0.5,
                   enqueue_jobs=300, enqueue_concurrency=(1, 16), quick=True)

    @property
    def engines(self) -> int:
        return math.ceil(max(self.levels) / self.rows)


# --- records ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Order:
    """What a subscriber process follows at one level: (model, through the gateway) per stream."""

    streams: list[tuple[str, bool]]
    max_tokens: int
    t0: float  # the measured window, wall clock
    t1: float


@dataclass(slots=True)
class Received:
    """What a subscriber process saw at one level: delivery latencies of the window's tokens (0.1 ms bins)."""

    bins: Counter[int] = field(default_factory=Counter)
    tokens: int = 0  # tokens made in the window and delivered
    completed: int = 0  # streams read to their end
    errors: list[str] = field(default_factory=list)

    def add(self, text: str, now: float, t0: float, t1: float) -> None:
        for stamp in text.split():
            made = float(stamp)
            if t0 <= made < t1:
                self.tokens += 1
                self.bins[int((now - made) * 1000 / _BIN_MS)] += 1


@dataclass(frozen=True, slots=True)
class Cpu:
    """Cores used over the window (CPU seconds ÷ window seconds)."""

    redis: float
    workers: list[float]
    gateway: float | None
    subscribers: list[float]
    machine: float  # every process on the machine (others' too)
    cores: int


@dataclass(frozen=True, slots=True)
class Level:
    """One level's measurements."""

    streams: int
    rate: float
    engines: int
    via_gateway: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    delivered: float  # tokens made in the window and delivered ÷ what N streams at the rate make in it
    completed: int
    errors: list[str]
    cpu: Cpu
    redis_commands_s: float
    bottleneck: str
    redis_idle: float  # Redis's cores with the same fleet and no stream (heartbeats, polls, leases' loops)
    # Per Redis command (``INFO commandstats``) over the window: (calls, µs inside Redis), the scripts' inner
    # commands counted under their own names too (so EVALSHA's µs include theirs)
    commandstats: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def redis_cores_per_1000(self) -> float:
        """Redis's cores per 1,000 streams, less what the idle fleet costs it."""
        return max(0.0, self.cpu.redis - self.redis_idle) / self.streams * 1000

    @property
    def redis_us_per_token(self) -> float:
        """Redis's CPU per token delivered (µs), less the idle fleet's: its cost per event of one token."""
        tokens_s = self.streams * self.delivered * self.rate
        return max(0.0, self.cpu.redis - self.redis_idle) / tokens_s * 1e6 if tokens_s else 0.0


@dataclass(frozen=True, slots=True)
class Enqueue:
    """One producer's submits with ``concurrency`` in flight, and the CPU each job cost the producer and Redis."""

    concurrency: int
    jobs: int
    jobs_s: float
    producer_us: float  # the producer's CPU per job
    redis_us: float  # Redis's CPU per job


@dataclass(frozen=True, slots=True)
class ScaleResult:
    config: ScaleConfig
    levels: list[Level]
    enqueue: list[Enqueue]


# --- subscriber processes --------------------------------------------------------------------------
def _subscriber_main(conn: Connection, url: str, prefix: str, gateway: str | None) -> None:
    """A subscriber process: follow each level's streams, send back what arrived; ``None`` ends it."""
    conn.send("ready")  # imported: the first level's streams do not wait for this process to start
    while (order := conn.recv()) is not None:
        conn.send(asyncio.run(_follow_all(order, url, prefix, gateway)))


async def _follow_all(order: Order, url: str, prefix: str, gateway: str | None) -> Received:
    got = Received()
    http = None
    if gateway is not None:
        where = urlsplit(gateway)
        assert where.hostname is not None and where.port is not None
        http = SseClient(where.hostname, where.port)
    async with Client(url, prefix=prefix, retry_deadline=60) as client:
        async def one(model: str, via_gateway: bool) -> None:
            try:
                if via_gateway:
                    assert http is not None
                    await _follow_gateway(http, model, order, got)
                else:
                    async for text in client.stream(model=model, prompt="p", max_tokens=order.max_tokens,
                                                    timeout=order.t1 - time.time() + 120):
                        got.add(text, time.time(), order.t0, order.t1)
                got.completed += 1
            except Exception as exc:  # counted and reported, not raised: one failed stream ends no level
                got.errors.append(f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(m, g) for m, g in order.streams))
    if http is not None:
        await http.aclose()
    got.errors = got.errors[:5] + ([f"... {len(got.errors) - 5} more"] if len(got.errors) > 5 else [])
    return got


async def _follow_gateway(http: SseClient, model: str, order: Order, got: Received) -> None:
    body = json.dumps({"model": model, "prompt": "p", "max_tokens": order.max_tokens, "stream": True}).encode()
    async for data in http.events("/v1/completions", body):
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the gateway's stream failed: {chunk['error']}")
        if chunk["choices"]:
            got.add(chunk["choices"][0]["text"], time.time(), order.t0, order.t1)


# --- the deployment --------------------------------------------------------------------------------
class _Fleet:
    """An embedded Redis, the simulated workers, a gateway, and the subscriber processes."""

    def __init__(self, cfg: ScaleConfig, out: Path) -> None:
        self.cfg, self.out = cfg, out
        self.prefix = f"mlxq-scale-{uuid.uuid4().hex[:6]}"
        self.server = RedisServer(tcp=True)
        self.workers: list[WorkerProcess] = []
        self.gateway: GatewayProcess | None = None
        self.subs: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []

    def start(self) -> None:
        self.server.start()
        model = make_model(self.out / "sim-model", self.cfg.rate)
        env = {"MLXQ_REDIS_URL": self.server.url, "MLXQ_PREFIX": self.prefix, "MLXQ_BATCH_CAPACITY": str(self.cfg.rows),
               "MLXQ_LOG_LEVEL": "WARNING"}
        for w in range(self.cfg.workers):
            names = [f"sim-{k}" for k in range(self.cfg.engines) if k % self.cfg.workers == w]
            if names:
                spec = ",".join(f"{model}={n}" for n in names)
                proc = WorkerProcess({**env, "MLXQ_MODELS": spec}, self.out / "logs" / f"simworker-{w}.log",
                                     settings="tests.perf.simworker.Settings").start()
                self.workers.append(proc)
        # Every process starts before any is waited for: their imports overlap.
        if self.cfg.gateway_share > 0:
            self.gateway = GatewayProcess(env, self.out / "logs" / "gateway.log").start()
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads and sockets
        for _ in range(self.cfg.subscribers):
            ours, theirs = ctx.Pipe()
            sub = ctx.Process(target=_subscriber_main, daemon=True,
                              args=(theirs, self.server.url, self.prefix, self.gateway.url if self.gateway else None))
            sub.start()
            self.subs.append((sub, ours))
        for proc in self.workers:
            proc.wait_ready(timeout=300)
        if self.gateway is not None:
            self.gateway.wait_ready()
        for _, conn in self.subs:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a subscriber process did not start")

    def stop(self) -> None:
        for proc, conn in self.subs:
            conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if self.gateway is not None:
            self.gateway.stop()
        for w in self.workers:
            w.stop()
        self.server.stop()

    def pids(self) -> dict[str, list[int | None]]:
        return {"redis": [self.server.proc.pid if self.server.proc else None],
                "workers": [w.proc.pid if w.proc else None for w in self.workers],
                "gateway": [self.gateway.pid] if self.gateway else [],
                "subscribers": [p.pid for p, _ in self.subs]}


# --- one level ---------------------------------------------------------------------------------------
def _orders(cfg: ScaleConfig, n: int, t0: float, t1: float, max_tokens: int) -> list[Order]:
    engines = math.ceil(n / cfg.rows)
    streams: list[list[tuple[str, bool]]] = [[] for _ in range(cfg.subscribers)]
    for i in range(n):
        via = int((i + 1) * cfg.gateway_share) > int(i * cfg.gateway_share)
        streams[i % cfg.subscribers].append((f"sim-{i % engines}", via))
    return [Order(s, max_tokens, t0, t1) for s in streams]


def _machine_busy() -> tuple[float, float]:
    """Seconds the machine's CPUs were busy and in all, since boot (/proc/stat)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


class _CpuMeter:
    def __init__(self, fleet: _Fleet) -> None:
        self.pids = fleet.pids()
        self.before = {k: [cpu_seconds(p) for p in v] for k, v in self.pids.items()}
        self.busy0, self.wall0 = _machine_busy(), time.monotonic()
        self.redis = redis.Redis.from_url(fleet.server.url)
        self.cmds0 = self._commands()
        self.stats0 = self._commandstats()

    def _commands(self) -> int:
        info: dict[str, Any] = self.redis.info("stats")  # type: ignore[assignment]
        return int(info["total_commands_processed"])

    def _commandstats(self) -> dict[str, tuple[int, int]]:
        info: dict[str, Any] = self.redis.info("commandstats")  # type: ignore[assignment]
        return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in info.items()}

    def stop(self) -> tuple[Cpu, float, dict[str, tuple[int, int]]]:
        wall = time.monotonic() - self.wall0
        used = {k: [(cpu_seconds(p) - b) / wall for p, b in zip(v, self.before[k])] for k, v in self.pids.items()}
        busy = _machine_busy()[0] - self.busy0[0]
        commands = (self._commands() - self.cmds0) / wall
        stats = {k: (c - self.stats0.get(k, (0, 0))[0], u - self.stats0.get(k, (0, 0))[1])
                 for k, (c, u) in self._commandstats().items()}
        self.redis.close()
        cpu = Cpu(used["redis"][0], used["workers"], used["gateway"][0] if used["gateway"] else None,
                  used["subscribers"], busy / wall, os.cpu_count() or 1)
        return cpu, commands, {k: v for k, v in stats.items() if v[0] > 0 and k != "info"}


def _bottleneck(cpu: Cpu) -> str:
    procs = {"redis-server": cpu.redis, **{f"worker {i}": c for i, c in enumerate(cpu.workers)},
             **{f"subscriber {i}": c for i, c in enumerate(cpu.subscribers)},
             **({"gateway": cpu.gateway} if cpu.gateway is not None else {})}
    top = max(procs, key=lambda k: procs[k])
    if procs[top] >= _BUSY:
        return f"{top} (a whole core: {procs[top]:.2f})"
    if cpu.machine >= _BUSY * cpu.cores:
        return f"the machine's {cpu.cores} cores ({cpu.machine:.2f} busy; the most, {top}: {procs[top]:.2f})"
    return f"none found (busiest: {top} {procs[top]:.2f} cores; machine {cpu.machine:.2f} of {cpu.cores})"


def _idle(fleet: _Fleet, window_s: float) -> float:
    """Redis's cores over a window with the fleet up and no stream."""
    meter = _CpuMeter(fleet)
    time.sleep(window_s)
    cpu, _, _ = meter.stop()
    say(f"[scale] idle fleet: redis {cpu.redis:.3f} cores; workers {sum(cpu.workers):.2f}")
    return cpu.redis


def _level(fleet: _Fleet, n: int, window_s: float, idle: float = 0.0) -> Level:
    cfg = fleet.cfg
    ramp_s = cfg.ramp_s + n / 1000  # submits, claims and the first tokens, before the window opens
    t0 = time.time() + ramp_s
    t1 = t0 + window_s
    max_tokens = math.ceil(cfg.rate * (ramp_s + window_s + 1.0))
    orders = _orders(cfg, n, t0, t1, max_tokens)
    for (_, conn), order in zip(fleet.subs, orders):
        conn.send(order)
    time.sleep(max(0.0, t0 - time.time()))
    meter = _CpuMeter(fleet)
    time.sleep(max(0.0, t1 - time.time()))
    cpu, commands, stats = meter.stop()
    got = [conn.recv() for _, conn in fleet.subs]
    bins: Counter[int] = sum((g.bins for g in got), Counter())
    tokens = sum(g.tokens for g in got)
    p50, p99, top = _quantile(bins, 0.5), _quantile(bins, 0.99), _quantile(bins, 1.0)
    level = Level(n, cfg.rate, math.ceil(n / cfg.rows), sum(g for o in orders for _, g in o.streams), p50, p99, top,
                  tokens / (n * cfg.rate * window_s), sum(g.completed for g in got),
                  [e for g in got for e in g.errors][:5], cpu, commands, _bottleneck(cpu), idle, stats)
    say(f"[scale] N={n:<5} delivery p50 {p50:7.1f} ms p99 {p99:7.1f} ms; delivered {level.delivered:.3f}; "
        f"redis {cpu.redis:.2f} cores ({level.redis_cores_per_1000:.2f} per 1,000 streams, "
        f"{level.redis_us_per_token:.1f} µs a token, idle fleet's taken off); workers "
        f"{sum(cpu.workers):.2f}; subscribers {sum(cpu.subscribers):.2f}; machine {cpu.machine:.2f}/{cpu.cores}; "
        f"bottleneck: {level.bottleneck}")
    say(f"[scale] N={n:<5} Redis per token: {_per_token(level, window_s)}")
    return level


def _per_token(level: Level, window_s: float) -> str:
    """The busiest Redis commands of a level, as calls and µs inside Redis per token delivered."""
    tokens = level.streams * level.delivered * level.rate * window_s
    if not tokens:
        return "no token"
    top = sorted(level.commandstats.items(), key=lambda kv: -kv[1][1])[:8]
    return ", ".join(f"{k} {c / tokens:.2f}x {u / tokens:.1f} µs" for k, (c, u) in top)


def _quantile(bins: Counter[int], q: float) -> float:
    total = sum(bins.values())
    if total == 0:
        return 0.0
    rank, seen = max(1, math.ceil(q * total)), 0
    for b in sorted(bins):
        seen += bins[b]
        if seen >= rank:
            return (b + 0.5) * _BIN_MS
    return 0.0


# --- one producer's enqueues -------------------------------------------------------------------------
async def _enqueue(url: str, redis_pid: int | None, cfg: ScaleConfig) -> list[Enqueue]:
    results = []
    uncapped = dataclasses.replace(ClientConfig.from_env(), max_queued=0)  # every job of a round stays queued
    async with Client(url, prefix=f"mlxq-scale-enq-{uuid.uuid4().hex[:6]}", config=uncapped) as client:
        await client.submit(model=_NOBODY, prompt="warm up", max_tokens=1)  # opens the connections
        for c in cfg.enqueue_concurrency:
            left = cfg.enqueue_jobs

            async def producer() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await client.submit(model=_NOBODY, prompt=f"job {left}", max_tokens=1)

            t0, cpu0, redis0 = time.perf_counter(), time.process_time(), cpu_seconds(redis_pid)
            await asyncio.gather(*(producer() for _ in range(c)))
            rate = cfg.enqueue_jobs / (time.perf_counter() - t0)
            per_job = 1e6 / cfg.enqueue_jobs
            result = Enqueue(c, cfg.enqueue_jobs, rate, (time.process_time() - cpu0) * per_job,
                             (cpu_seconds(redis_pid) - redis0) * per_job)
            results.append(result)
            say(f"[scale] enqueue: {rate:8.0f} jobs/s with {c} submits in flight (CPU per job: producer "
                f"{result.producer_us:.0f} µs, Redis {result.redis_us:.0f} µs)")
            await client.redis.flushdb()  # the next round starts from an empty queue
    return results


# --- the run -----------------------------------------------------------------------------------------
def run(cfg: ScaleConfig, out: Path) -> ScaleResult:
    """Every level (until delivery degrades past ``stop_p99_ms``), then the enqueue rates."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    fleet = _Fleet(cfg, out)
    levels: list[Level] = []
    try:
        fleet.start()
        _level(fleet, cfg.subscribers * 2, 1.0)  # warm-up (connections, first imports); not recorded
        idle = _idle(fleet, cfg.window_s)
        for n in cfg.levels:
            levels.append(_level(fleet, n, cfg.window_s, idle))
            if levels[-1].p99_ms > cfg.stop_p99_ms:
                say(f"[scale] delivery p99 past {cfg.stop_p99_ms:g} ms: no higher level")
                break
        for proc in fleet.workers:
            proc.stop()  # the enqueue phase measures the producer and Redis alone
        fleet.workers = []
        enqueue = asyncio.run(_enqueue(fleet.server.url, fleet.pids()["redis"][0], cfg))
    finally:
        fleet.stop()
    return ScaleResult(cfg, levels, enqueue)


def markdown(r: ScaleResult) -> str:
    cfg = r.config
    rows = [f"| {lv.streams} | {lv.engines} | {lv.via_gateway} | {lv.p50_ms:.1f} | {lv.p99_ms:.1f} | {lv.max_ms:.0f} | "
            f"{lv.delivered:.3f} | {lv.completed}/{lv.streams} | {lv.cpu.redis:.2f} | {lv.redis_cores_per_1000:.2f} | "
            f"{lv.redis_us_per_token:.1f} | "
            f"{lv.redis_commands_s:.0f} | {' + '.join(f'{c:.2f}' for c in lv.cpu.workers)} | "
            f"{'-' if lv.cpu.gateway is None else f'{lv.cpu.gateway:.2f}'} | "
            f"{' + '.join(f'{c:.2f}' for c in lv.cpu.subscribers)} | {lv.cpu.machine:.2f}/{lv.cpu.cores} | "
            f"{lv.bottleneck} |" for lv in r.levels]
    first = next((lv for lv in r.levels if lv.p99_ms > _P99_TARGET_MS or lv.delivered < 0.95), None)
    verdict = (f"Delivery degraded first at {first.streams} streams (p99 {first.p99_ms:.1f} ms, delivered "
               f"{first.delivered:.3f}); bottleneck there: {first.bottleneck}." if first else
               f"Delivery held (p99 ≤ {_P99_TARGET_MS:g} ms, ≥ 0.95 delivered) at every level measured.")
    enq = [f"| {e.concurrency} | {e.jobs} | {e.jobs_s:.0f} | {e.producer_us:.0f} | {e.redis_us:.0f} |"
           for e in r.enqueue]
    errors = [f"- N={lv.streams}: {e}" for lv in r.levels for e in lv.errors]
    return "\n".join([
        f"# The control plane's ceiling ({'quick run, ' if cfg.quick else ''}{cfg.rate:g} tokens/s a stream, "
        f"{cfg.rows} rows per simulated engine, {cfg.workers} worker processes, {cfg.subscribers} subscriber "
        f"processes, {cfg.gateway_share:.0%} of streams through the gateway, {cfg.window_s:g} s windows)", "",
        "Delivery: engine output -> the text in a subscriber's hands. CPU in cores over the window; machine: every "
        "process on it (others' too).", "",
        "| streams | engines | via gateway | p50 ms | p99 ms | max ms | delivered | completed | Redis cores | "
        "Redis cores per 1,000 | Redis µs a token | Redis cmds/s | workers | gateway | subscribers | machine | "
        "bottleneck |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---|", *rows, "",
        f"Redis with the fleet up and no stream: {r.levels[0].redis_idle if r.levels else 0:.3f} cores (taken off "
        "the per-1,000 and per-token figures).", "", verdict, "",
        "## One producer's enqueues (`Client.submit`)", "",
        "| submits in flight | jobs | jobs/s | producer CPU µs/job | Redis CPU µs/job |",
        "|---:|---:|---:|---:|---:|",
        *enq, "", *(["## Stream errors", "", *errors, ""] if errors else [])])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--levels", help="concurrent streams per level, e.g. 100,250,500")
    ap.add_argument("--window", type=float, help="seconds measured per level")
    ap.add_argument("--workers", type=int, help="simulated worker processes")
    ap.add_argument("--subscribers", type=int, help="subscriber processes")
    ap.add_argument("--rows", type=int, help="rows per simulated engine")
    ap.add_argument("--gateway-share", type=float, help="share of the streams through the gateway (0: none)")
    ap.add_argument("--enqueue-jobs", type=int)
    args = ap.parse_args(argv)
    cfg = ScaleConfig.quick_config() if args.quick else ScaleConfig()
    changes: dict[str, Any] = {k: v for k, v in {
        "levels": tuple(int(n) for n in args.levels.split(",")) if args.levels else None,
        "window_s": args.window, "workers": args.workers, "subscribers": args.subscribers, "rows": args.rows,
        "gateway_share": args.gateway_share, "enqueue_jobs": args.enqueue_jobs}.items() if v is not None}
    cfg = dataclasses.replace(cfg, **changes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(cfg, out)
    text = markdown(result)
    (out / "scale.md").write_text(text)
    data: dict[str, Any] = asdict(result)
    for lv, d in zip(result.levels, data["levels"]):
        d["redis_cores_per_1000"] = lv.redis_cores_per_1000
        d["redis_us_per_token"] = lv.redis_us_per_token
    (out / "scale.json").write_text(json.dumps(data, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
