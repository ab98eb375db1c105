"""Issue 37's overhead target, side by side: with one tenant, starts per second and tok/s of this checkout against
another (the commit before tenants landed), on the same machine, alternated run by run.

Each run is a child process of the checkout measured (its own ``.venv``, its own code: this file uses only what
both have) with its own embedded Redis and one worker process on the generated model (``--size``):

- **burst**: ``--n`` jobs of ``--max-tokens`` sent at once to a worker of capacity ``--n`` (the research suite's
  queue burst), ``--batches // 2`` times: tok/s over the bursts, each from its first submit to its last end;
- **churn**: ``--batches`` bursts of ``4 x --n`` jobs of 4 tokens, one after another, on a worker of capacity
  ``--n // 4``: jobs start as slots free, so claims (CLAIM) dominate: starts/s over the bursts, each from its
  first submit to its last start (one burst of the tiny model takes about 0.2 s: too short to tell 3 % from
  noise on its own);
- **claim**: CLAIM alone on Redis (no worker): 2,000 queued jobs claimed 8 at a time, starts/s.

``python3 -m tests.perf.overhead --before DIR --out DIR`` (DIR: a checkout of the earlier commit with a
``.venv`` installed: ``git worktree add DIR COMMIT && cd DIR && python3 -m venv .venv && .venv/bin/pip install
-e '.[dev]'``) writes ``overhead.md`` and ``overhead.json``: each measure's best of ``--rounds`` per checkout
(background load only slows a run down), and after ÷ before (target: within 3 %).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["main"]

_LIMIT = 0.03
_MEASURES = ("burst_tok_s", "churn_starts_s", "claim_starts_s")
_TARGETS = ("burst_tok_s", "churn_starts_s")  # the (CLAIM alone says where a miss would come from)


async def _jobs(url: str, prefix: str, n: int, max_tokens: int) -> dict[str, float]:
    """Send ``n`` jobs at once; the times of the first submit, the last start and the last end, and tokens."""
    from mlxq.api.client import Client
    from mlxq.api.schema import DoneEvent

    starts: list[float] = []
    tokens = 0
    async with Client(url, prefix=prefix) as c:
        t0 = time.perf_counter()
        rids = await asyncio.gather(*(c.submit(model="m", prompt=f"a story about {i}", max_tokens=max_tokens)
                                      for i in range(n)))

        async def follow(rid: str) -> None:
            nonlocal tokens
            async for ev in c.events(rid, timeout=300):
                if ev.type == "start":
                    starts.append(time.perf_counter())
                if isinstance(ev, DoneEvent):
                    tokens += ev.usage.completion_tokens

        await asyncio.gather(*(follow(rid) for rid in rids))
        t1 = time.perf_counter()
    return {"t0": t0, "last_start": max(starts), "end": t1, "tokens": tokens}


def _worker_run(url: str, model: str, capacity: int, n: int, max_tokens: int, out: Path, name: str,
                batches: int = 1) -> list[dict[str, float]]:
    from mlxq.worker.tools.process import WorkerProcess

    prefix = f"mlxq-overhead-{uuid.uuid4().hex[:6]}"
    env = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": "m", "MLXQ_REDIS_URL": url, "MLXQ_PREFIX": prefix,
           "MLXQ_BATCH_CAPACITY": str(capacity), "MLXQ_MAX_JOBS": "0", "MLXQ_JOB_EXPIRY": "0",
           "OPENBLAS_NUM_THREADS": "1"}
    worker = WorkerProcess(env, out / f"worker-{name}.log").start()
    try:
        worker.wait_ready()
        asyncio.run(_jobs(url, prefix, min(n, 8), 8))  # warm-up
        return [asyncio.run(_jobs(url, prefix, n, max_tokens)) for _ in range(batches)]
    finally:
        worker.stop()


async def _claims(url: str, jobs: int = 2000, per_claim: int = 8) -> float:
    """Starts per second of CLAIM alone: ``jobs`` queued, claimed ``per_claim`` at a time."""
    import redis.asyncio as aredis

    from mlxq.api.client import Client
    from mlxq.worker.jobs.transitions import Transitions

    try:
        from mlxq.api.protocol.emit import LogTTL
        from mlxq.api.protocol.keys import Keys
    except ImportError:  # a checkout from before the protocol package (this file runs in both checkouts)
        from mlxq.api.keys import Keys  # type: ignore[no-redef]
        from mlxq.worker.jobs.transitions import LogTTL  # type: ignore[no-redef,attr-defined]

    prefix = f"mlxq-overhead-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    async with Client(url, prefix=prefix) as c:
        for i in range(0, jobs, 200):
            await asyncio.gather(*(c.submit(model="m", prompt="x", max_tokens=4) for _ in range(i, i + 200)))
    r = aredis.Redis.from_url(url)
    t = Transitions(r, keys, "w1", LogTTL(), lease_ttl_s=60)
    await t.open()
    started = 0
    t0 = time.perf_counter()
    while started < jobs:
        due = await t.claim({keys.queue("m"): per_claim}, per_claim)
        if not due.entries:
            break
        started += len(due.entries)
    elapsed = time.perf_counter() - t0
    await r.aclose()
    return started / elapsed


def one(size: str, n: int, max_tokens: int, batches: int, out: Path) -> dict[str, float]:
    """One run of every measure on this process's checkout."""
    from mlxq.worker.tools.redis_server import RedisServer
    from mlxq.worker.tools.tinymodel import ensure_model

    model = str(ensure_model(size))
    out.mkdir(parents=True, exist_ok=True)
    with RedisServer() as server:
        bursts = _worker_run(server.url, model, n, n, max_tokens, out, "burst", max(1, batches // 2))
        churn = _worker_run(server.url, model, max(1, n // 4), 4 * n, 4, out, "churn", batches)
        claim = asyncio.run(_claims(server.url))
    return {"burst_tok_s": sum(b["tokens"] for b in bursts) / sum(b["end"] - b["t0"] for b in bursts),
            "churn_starts_s": 4 * n * len(churn) / sum(c["last_start"] - c["t0"] for c in churn),
            "claim_starts_s": claim}


def _verdict(measure: str, ratio: float) -> str:
    if measure not in _TARGETS:
        return "(no target)"
    return "PASS" if ratio >= 1 - _LIMIT else "MISS"


def _child(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [str(tree / ".venv" / "bin" / "python"), str(Path(__file__).resolve()), "--one", "--size", args.size,
           "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--batches", str(args.batches), "--out", str(out)]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"run in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="a checkout of the earlier commit, with a .venv")
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=8, help="churn bursts per run")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if args.one:
        print(json.dumps(one(args.size, args.n, args.max_tokens, args.batches, out / "logs")))
        return 0
    if not args.before:
        ap.error("--before DIR is needed")
    trees = {"before": Path(args.before).resolve(), "after": Path(__file__).resolve().parents[2]}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):  # alternated
            runs[name].append(_child(trees[name], args, out / f"overhead-{name}"))
            print(f"[overhead] round {i + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()),
                  flush=True)
    best = {name: {m: max(r[m] for r in rs) for m in _MEASURES} for name, rs in runs.items()}
    ratios = {m: best["after"][m] / best["before"][m] for m in _MEASURES}
    # each round's two runs ran next to each other: their ratio sees the same background load
    median_ratios = {m: statistics.median(a[m] / b[m] for a, b in zip(runs["after"], runs["before"], strict=True))
                     for m in _MEASURES}
    rows = [f"| {m} | {best['before'][m]:.1f} | {best['after'][m]:.1f} | {ratios[m]:.3f} | {median_ratios[m]:.3f} | "
            f"{_verdict(m, min(ratios[m], median_ratios[m]))} |" for m in _MEASURES]
    text = "\n".join([f"# Overhead of tenants, one tenant ({args.size} model, N={args.n}, {args.max_tokens} tokens, "
                      f"churn {args.batches} bursts a run; {args.rounds} alternated runs each)", "",
                      f"before: {trees['before']}  after: {trees['after']}", "",
                      "| measure | before (best) | after (best) | best ÷ best | rounds' ratios, median | both ≥ 0.97 |",
                      "|---|---:|---:|---:|---:|---|", *rows, ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.md").write_text(text)
    data: dict[str, Any] = {"runs": runs, "best": best, "ratios": ratios,
                            "median_ratios": median_ratios, "limit": _LIMIT,
                            "trees": {k: str(v) for k, v in trees.items()}}
    (out / "overhead.json").write_text(json.dumps(data, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
