"""Tenants against issue 37's targets, on worker processes serving a generated model through an embedded Redis:

- **share**: two tenants backlogged on one worker (capacity 8), weights 1:1 and 3:1: each one's share of the
  tokens generated while both are backlogged (jobs that ended before the first tenant's queue drained, less the
  last batch's worth), against its weight's share (target: within ±10 % of it);
- **isolation**: tenant B sends a job a second on a clock (``--quick``: five a second), whether or not its last one
  ended, while tenant A floods the queue; B's queue wait (its ``done`` event's ``timings.queue_ms``) p50 against
  B's with A idle (target: within 2x);
- **max-running**: a tenant with ``max-running 2`` on two workers at once: the most of its jobs running,
  from its jobs' start and end events as one subscriber receives them (target: never 3).

``python3 -m tests.perf.tenants --out DIR`` writes ``tenants.md`` and ``tenants.json`` (``--quick``: fewer jobs;
``--phases isolation``: only the phases named). Its clients' jobs never expire: on a loaded machine the share
phases' backlog takes longer than a job's default expiry to drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mlxq.api.client import Client
from mlxq.api.config import ClientConfig
from mlxq.api.schema import DoneEvent, ErrorEvent
from mlxq.worker.tools.bench.runs import say
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

from .runs import Target

__all__ = ["Phases", "Results", "main", "run", "tenants_targets", "write"]

_SHARE_TOLERANCE = 0.10  # of the weight's share
_ISOLATION_LIMIT = 2.0


@dataclass(frozen=True, slots=True)
class Phases:
    """How much each phase does (``quick``: a smoke run)."""

    size: str = "small"
    share_jobs: int = 120  # per tenant
    share_tokens: int = 32
    flood_jobs: int = 1000
    probe_jobs: int = 15  # B's jobs, one every probe_interval_s
    probe_tokens: int = 16
    probe_interval_s: float = 1.0
    cap_jobs: int = 24  # per tenant, max-running phase

    @classmethod
    def quick(cls) -> Phases:
        # B's probes 0.2 s apart: a tiny model's job takes a few ms, and the tests' quick runs wait out the pauses.
        return cls(size="tiny", share_jobs=40, share_tokens=16, flood_jobs=200, probe_jobs=5, probe_interval_s=0.2,
                   cap_jobs=8)


@dataclass(frozen=True, slots=True)
class Share:
    weights: tuple[int, int]
    tokens: tuple[int, int]  # generated while both were backlogged
    jobs: int  # jobs counted

    @property
    def first_share(self) -> float:
        return self.tokens[0] / max(1, sum(self.tokens))

    @property
    def want(self) -> float:
        return self.weights[0] / sum(self.weights)

    @property
    def passed(self) -> bool:
        return abs(self.first_share - self.want) <= _SHARE_TOLERANCE * self.want


@dataclass(frozen=True, slots=True)
class Isolation:
    alone_ms: list[float]  # B's queue waits with A idle
    flooded_ms: list[float]  # with A flooding
    flood_outlasted: bool  # A still had jobs queued when B's last probe ended

    @property
    def ratio(self) -> float:
        return statistics.median(self.flooded_ms) / max(1e-3, statistics.median(self.alone_ms))


@dataclass(frozen=True, slots=True)
class Results:
    size: str
    shares: list[Share]
    isolation: Isolation | None  # None: the phase was not run (--phases)
    most_running: int | None  # the max-running 2 tenant's most jobs running at once (None: not run)


class _Deployment:
    """An embedded Redis and worker processes on one generated model, under a prefix of their own."""

    def __init__(self, server: RedisServer, model: str, out: Path) -> None:
        self.server, self.model, self.out = server, model, out
        self.prefix = f"mlxq-bench-tenants-{uuid.uuid4().hex[:6]}"
        self.workers: list[WorkerProcess] = []

    def start(self, *names: str, capacity: int = 8) -> None:
        """A worker per name, started side by side (their imports overlap), then waited for."""
        env = {"MLXQ_MODEL": self.model, "MLXQ_MODEL_NAME": "m", "MLXQ_REDIS_URL": self.server.url,
               "MLXQ_PREFIX": self.prefix, "MLXQ_BATCH_CAPACITY": str(capacity), "MLXQ_JOB_EXPIRY": "0",
               "OPENBLAS_NUM_THREADS": "1"}
        procs = [WorkerProcess(env, self.out / "logs" / f"worker-tenants-{name}.log").start() for name in names]
        self.workers += procs
        for proc in procs:
            proc.wait_ready()

    def client(self, tenant: str | None = None) -> Client:
        # Its jobs wait as long as the backlog takes (no expiry).
        config = replace(ClientConfig.from_env(), job_expiry_s=0)
        return Client(self.server.url, prefix=self.prefix, tenant=tenant, retry_deadline=30, config=config)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


async def _follow(c: Client, rid: str, log: list[tuple[float, str]] | None = None) -> DoneEvent:
    async for ev in c.events(rid, timeout=900):
        if log is not None and ev.type in ("start", "reset"):
            log.append((time.monotonic(), "start" if ev.type == "start" else "end"))
        if isinstance(ev, ErrorEvent):
            raise RuntimeError(f"job {ev.id} failed: {ev.code.value}: {ev.message}")
        if isinstance(ev, DoneEvent):
            if log is not None:
                log.append((time.monotonic(), "end"))
            return ev
    raise RuntimeError(f"job {rid}: no end")


async def _share(d: _Deployment, p: Phases, weights: tuple[int, int]) -> Share:
    d.prefix = f"mlxq-bench-tenants-{uuid.uuid4().hex[:6]}"  # fresh accounts for each pair of weights
    async with d.client() as admin:
        await admin.set_tenant("a", weight=weights[0])
        await admin.set_tenant("b", weight=weights[1])
        rids = [(await admin.submit(model="m", prompt=f"tell a story {i}", max_tokens=p.share_tokens, tenant=t), t)
                for i in range(p.share_jobs) for t in ("a", "b")]  # both backlogged before the worker starts
        d.start("share")
        try:
            ends: list[tuple[float, str, int]] = []

            async def one(rid: str, tenant: str) -> None:
                done = await _follow(admin, rid)
                ends.append((time.monotonic(), tenant, done.usage.completion_tokens))

            await asyncio.gather(*(one(rid, t) for rid, t in rids))
        finally:
            d.stop()
    ends.sort()
    drained = min(max(i for i, e in enumerate(ends) if e[1] == t) for t in ("a", "b"))
    both = ends[:max(0, drained - 8)]
    tokens = (sum(n for _, t, n in both if t == "a"), sum(n for _, t, n in both if t == "b"))
    return Share(weights, tokens, len(both))


async def _probes(c: Client, p: Phases) -> list[float]:
    """B's jobs, one every ``probe_interval_s`` on a clock, and each one's queue wait. Sent on a clock, not after
    the last one's end: a job that outlasts the interval (a flooded one does) would have its successor submitted
    at its own end, which the engine emits at a step's end, so every probe would come just as the next step
    began and wait for all of it (at ~1.8 s a job, one every 1.8 s, not one a second)."""
    t0 = time.monotonic()
    follows = []
    for i in range(p.probe_jobs):
        await asyncio.sleep(max(0.0, t0 + i * p.probe_interval_s - time.monotonic()))
        rid = await c.submit(model="m", prompt=f"a question {i}", max_tokens=p.probe_tokens)
        follows.append(asyncio.create_task(_follow(c, rid)))
    return [(await f).timings.queue_ms for f in follows]


async def _isolation(d: _Deployment, p: Phases) -> Isolation:
    d.prefix = f"mlxq-bench-tenants-{uuid.uuid4().hex[:6]}"
    d.start("isolation")
    try:
        async with d.client("b") as b, d.client("a") as a:
            alone = await _probes(b, p)
            flood = [await a.submit(model="m", prompt=f"batch job {i}", max_tokens=p.share_tokens)
                     for i in range(p.flood_jobs)]
            flooded = await _probes(b, p)
            backlogged = sum(q.tenants.get("a", 0) for q in await a.queues()) > 0
            for rid in flood:  # what is left of the flood is not measured
                await a.cancel(rid)
    finally:
        d.stop()
    return Isolation(alone, flooded, backlogged)


async def _cap(d: _Deployment, p: Phases) -> int:
    d.prefix = f"mlxq-bench-tenants-{uuid.uuid4().hex[:6]}"
    d.start("cap-1", "cap-2")
    try:
        async with d.client() as c:
            await c.set_tenant("a", max_running=2)
            log: list[tuple[float, str]] = []
            rids = [(await c.submit(model="m", prompt=f"job {i}", max_tokens=p.share_tokens, tenant=t), t)
                    for i in range(p.cap_jobs) for t in ("a", "b")]
            await asyncio.gather(*(_follow(c, rid, log if t == "a" else None) for rid, t in rids))
    finally:
        d.stop()
    running = most = 0
    for _, what in sorted(log):
        running += 1 if what == "start" else -1
        most = max(most, running)
    return most


_PHASES = ("share", "isolation", "cap")


def run(p: Phases, out: Path, phases: tuple[str, ...] = _PHASES) -> Results:
    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(p.size))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with RedisServer() as server:
        d = _Deployment(server, model, out)
        shares: list[Share] = []
        for weights in ((1, 1), (3, 1)) if "share" in phases else ():
            shares.append(asyncio.run(_share(d, p, weights)))
            say(f"[tenants] share {weights[0]}:{weights[1]}: first tenant {shares[-1].first_share:.3f} of the "
                f"tokens (want {shares[-1].want:.3f}) over {shares[-1].jobs} jobs")
        isolation = asyncio.run(_isolation(d, p)) if "isolation" in phases else None
        if isolation is not None:
            say(f"[tenants] isolation: B's queue wait p50 {statistics.median(isolation.flooded_ms):.1f} ms flooded, "
                f"{statistics.median(isolation.alone_ms):.1f} ms alone ({isolation.ratio:.2f}x)")
        most = asyncio.run(_cap(d, p)) if "cap" in phases else None
        if most is not None:
            say(f"[tenants] max-running 2 on two workers: at most {most} running")
    return Results(p.size, shares, isolation, most)


def markdown(r: Results) -> str:
    iso = r.isolation
    rows = [f"| share {s.weights[0]}:{s.weights[1]}, first tenant's share of tokens generated while both were "
            f"backlogged ({s.jobs} jobs) | {s.first_share:.3f} | {s.want:.3f} ± {_SHARE_TOLERANCE * s.want:.3f} | "
            f"{'PASS' if s.passed else 'MISS'} |" for s in r.shares]
    if iso is not None:
        rows.append(f"| isolation: B's queue wait p50 flooded ÷ alone ({statistics.median(iso.flooded_ms):.1f} ms ÷ "
                    f"{statistics.median(iso.alone_ms):.1f} ms; A still backlogged at the end: "
                    f"{'yes' if iso.flood_outlasted else 'no'}) | {iso.ratio:.2f} | ≤ {_ISOLATION_LIMIT:g} | "
                    f"{'PASS' if iso.ratio <= _ISOLATION_LIMIT else 'MISS'} |")
    if r.most_running is not None:
        rows.append(f"| max-running 2 on two workers: most running at once | {r.most_running} | ≤ 2 | "
                    f"{'PASS' if r.most_running <= 2 else 'MISS'} |")
    return "\n".join([f"# Tenants ({r.size} model, one worker of capacity 8; two for max-running)", "",
                      "| target | value | limit | |", "|---|---:|---:|---|", *rows, ""])


def tenants_targets(r: Results) -> list[Target]:
    """Issue 37's targets as the research suite's targets table lists them (tests/perf/suite.py)."""
    iso = r.isolation
    out = [Target(f"tenants share {s.weights[0]}:{s.weights[1]}: first tenant's share of tokens ({r.size})",
                  round(s.first_share, 3), f"{s.want:.3f} ± {_SHARE_TOLERANCE * s.want:.3f}", s.passed)
           for s in r.shares]
    if iso is not None:
        out.append(Target(f"tenants isolation: B's queue wait p50 flooded / alone ({r.size})", round(iso.ratio, 2),
                          f"<= {_ISOLATION_LIMIT:g}", iso.ratio <= _ISOLATION_LIMIT))
    if r.most_running is not None:
        out.append(Target(f"tenants max-running 2 on two workers: most running ({r.size})", r.most_running, "<= 2",
                          r.most_running <= 2))
    return out


def write(result: Results, out: Path) -> str:
    """``tenants.md`` and ``tenants.json`` in ``out``; the markdown."""
    text = markdown(result)
    (out / "tenants.md").write_text(text)
    data: dict[str, Any] = asdict(result)
    data["targets"] = {"share": [s.passed for s in result.shares],
                       "isolation_ratio": result.isolation.ratio if result.isolation is not None else None,
                       "most_running": result.most_running}
    (out / "tenants.json").write_text(json.dumps(data, indent=2))
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.tenants", description=__doc__)
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phases", default=",".join(_PHASES), help="comma-separated: share, isolation, cap")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = tuple(args.phases.split(","))
    if not set(phases) <= set(_PHASES):
        ap.error(f"--phases: each of {', '.join(_PHASES)}")
    print(write(run(Phases.quick() if args.quick else Phases(), out, phases), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
