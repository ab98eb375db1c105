"""``python3 -m tests.perf.burst``: one burst size, the queue against ``mlx_lm.server`` (and the gateway), runs
alternated: the suite's N = 32 comparison in a few minutes, to measure a change to a burst's first tokens.

Each path runs while the others' processes are stopped (SIGSTOP: their idle polling does not tax it), every run
after the same idle pause. Per run: tok/s and TTFT p50; per path: the median run's and the best run's. OpenBLAS
is preloaded as ``mlxq bench`` does. Writes ``burst.json`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mlxq.api.client import Client
from mlxq.worker.tools.bench.http import SseClient
from mlxq.worker.tools.bench.paths import run_gateway, run_queue
from mlxq.worker.tools.bench.preload import reexec_with_openblas
from mlxq.worker.tools.bench.runs import SETTLE_S, TIMEOUT_S, Run, percentile, prompt_batch, say
from mlxq.worker.tools.blas import blas_of
from mlxq.worker.tools.process import GatewayProcess, WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer

from .peer import ServerPath

_ROOT = Path(__file__).resolve().parents[2]
_PATHS = ("queue", "server", "gateway")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m tests.perf.burst", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf-out")
    p.add_argument("--size", default="small", help="generated model size (tiny, small)")
    p.add_argument("--n", type=int, default=32, help="requests per burst (also the batch capacity)")
    p.add_argument("--runs", type=int, default=4, help="measured runs per path, alternated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--paths", default="queue,server", help=f"comma-separated, of {','.join(_PATHS)}")
    p.add_argument("--blas-threads", type=int, default=2, help="OPENBLAS_NUM_THREADS of every path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    reexec_with_openblas(["-m", "tests.perf.burst", *(sys.argv[1:] if argv is None else argv)], _ROOT)
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - set(_PATHS):
        raise SystemExit(f"--paths: some of {','.join(_PATHS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, splits = _measure(args, paths, out)
    summary = {p: _summary(rs) for p, rs in runs.items()}
    records = {p: [_run_record(r, sp) for r, sp in zip(rs, splits[p], strict=True)] for p, rs in runs.items()}
    (out / "burst.json").write_text(json.dumps({"args": vars(args), "blas": blas_of(), "summary": summary,
                                                "runs": records}, indent=1))
    for p, s in summary.items():
        say(f"{p:8} TTFT p50 per run {s['ttft_p50_runs']}: median {s['ttft_p50_median']:.0f} ms, best "
            f"{s['ttft_p50_best']:.0f} ms; tok/s per run {s['tok_s_runs']}: median {s['tok_s_median']:.1f}, best "
            f"{s['tok_s_best']:.1f}")
    return 0


def _measure(args: argparse.Namespace, paths: list[str], out: Path
             ) -> tuple[dict[str, list[Run]], dict[str, list[Split | None]]]:
    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(args.size))
    env = {"OPENBLAS_NUM_THREADS": str(args.blas_threads)}
    os.environ.update(env)
    with RedisServer() as redis, contextlib.ExitStack() as stack:
        prefix = f"mlxq-burst-{os.getpid()}"
        worker = WorkerProcess({"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": args.size, "MLXQ_REDIS_URL": redis.url,
                                "MLXQ_PREFIX": prefix, "MLXQ_BATCH_CAPACITY": str(args.n), "MLXQ_HEARTBEAT": "0.5",
                                **env}, out / "logs" / "burst-worker.log").start()
        stack.callback(worker.stop)
        worker.wait_ready()
        assert worker.proc is not None
        pids = {"queue": [worker.proc.pid]}
        server = ServerPath(model, args.n, env, out / "logs" / "burst-mlx_lm-server.log") if "server" in paths else None
        if server is not None:
            stack.callback(server.close)
            pids["server"] = [server.proc.pid]
        gateway = None
        if "gateway" in paths:
            gateway = GatewayProcess({"MLXQ_REDIS_URL": redis.url, "MLXQ_PREFIX": prefix},
                                     out / "logs" / "burst-gateway.log").start()
            stack.callback(gateway.stop)
            gateway.wait_ready()
            pids["gateway"] = [worker.proc.pid, gateway.pid or 0]
        say(f"[{args.size}] N={args.n}: {', '.join(paths)} ready; BLAS {blas_of(worker.proc.pid)}")
        return asyncio.run(_alternate(args, paths, model, redis.url, prefix, server, gateway, pids))


async def _alternate(args: argparse.Namespace, paths: list[str], model: str, url: str, prefix: str,
                     server: ServerPath | None, gateway: GatewayProcess | None, pids: dict[str, list[int]]
                     ) -> tuple[dict[str, list[Run]], dict[str, list[Split | None]]]:
    prompts = prompt_batch(args.n)
    async with Client(url, prefix=prefix) as client:
        http = None
        if gateway is not None:
            where = urlsplit(gateway.url)
            assert where.hostname is not None and where.port is not None
            http = SseClient(where.hostname, where.port)
        run_of: dict[str, Callable[[int], Awaitable[Run]]] = {
            "queue": lambda m: run_queue(client, args.size, prompts, m),
            "server": lambda m: server.run(prompts, m) if server is not None else _never(),
            "gateway": lambda m: run_gateway(http, args.size, prompts, m) if http is not None else _never(),
        }
        everyone = {pid for ps in pids.values() for pid in ps}
        runs: dict[str, list[Run]] = {p: [] for p in paths}
        split: dict[str, list[Split | None]] = {p: [] for p in paths}
        try:
            for k in range(args.runs + 1):  # the first round warms every path up (kernels, connections)
                for p in paths:
                    with _only(set(pids[p]), everyone):
                        run = await asyncio.wait_for(run_of[p](args.max_tokens if k else 8), TIMEOUT_S)
                    if k:
                        runs[p].append(run)
                        split[p].append(await _split(client, run))
                        say(f"run {k} {p:8} {run.tok_s:7.1f} tok/s, TTFT p50 {percentile(run.ttft_ms, 50):6.0f} ms"
                            + _split_text(split[p][-1]))
        finally:
            if http is not None:
                await http.aclose()
    return runs, split


@dataclass(frozen=True, slots=True)
class Split:
    """Where a run's TTFT went, per job (p50s): in the worker (enqueue -> first token published, the job's own
    ``ttft_ms``; of it, enqueue -> admitted) and outside it (the client's TTFT less that: the submit, the HTTP
    request and the gateway for that path, and the first token's way back)."""

    worker_ms: float
    outside_ms: float
    admit_ms: float  # of the worker's part, enqueue -> the engine admitted the job (``queue_ms``)


async def _split(client: Client, run: Run) -> Split | None:
    """The run's split, from its jobs' results (queue and gateway paths; None for a path without job ids)."""
    if not run.rids or not all(run.rids):
        return None
    results = await asyncio.gather(*(client.result(rid, timeout=10) for rid in run.rids))
    worker = [r.timings.ttft_ms or 0.0 for r in results]
    outside = [c - w for c, w in zip(run.ttft_ms, worker, strict=True)]
    return Split(percentile(worker, 50), percentile(outside, 50), percentile([r.timings.queue_ms for r in results], 50))


def _split_text(split: Split | None) -> str:
    if split is None:
        return ""
    return (f" (in the worker {split.worker_ms:.0f}, of which to admission {split.admit_ms:.0f}; outside it "
            f"{split.outside_ms:.0f})")


@contextlib.contextmanager
def _only(running: set[int], everyone: set[int]) -> Iterator[None]:
    """The other paths' processes stopped around a run, which starts after the same idle pause as any other."""
    stopped = everyone - running
    for pid in everyone:
        os.kill(pid, signal.SIGSTOP if pid in stopped else signal.SIGCONT)
    time.sleep(SETTLE_S)
    try:
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        time.sleep(SETTLE_S)


async def _never() -> Run:
    raise RuntimeError("path not started")


def _summary(runs: list[Run]) -> dict[str, object]:
    p50s = [percentile(r.ttft_ms, 50) for r in runs]
    toks = [r.tok_s for r in runs]
    return {"ttft_p50_runs": [round(v) for v in p50s], "ttft_p50_median": percentile(p50s, 50),
            "ttft_p50_best": min(p50s), "tok_s_runs": [round(v, 1) for v in toks],
            "tok_s_median": percentile(toks, 50), "tok_s_best": max(toks)}


def _run_record(run: Run, split: Split | None) -> dict[str, object]:
    where = {} if split is None else {"ttft_p50_in_worker_ms": round(split.worker_ms, 1),
                                      "ttft_p50_outside_worker_ms": round(split.outside_ms, 1),
                                      "queue_ms_p50": round(split.admit_ms, 1)}
    return {"tokens": run.tokens, "seconds": run.seconds, "ttft_ms": [round(t, 1) for t in run.ttft_ms], **where}


if __name__ == "__main__":
    sys.exit(main())
