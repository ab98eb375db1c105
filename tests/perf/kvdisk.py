"""The prefix cache's tier on disk against issue 38's overhead target, on a worker process serving a generated
model through an embedded Redis:

- **stream**: chat jobs whose prompts never repeat (each a system message of its own, so a job stores two
  entries, its system prompt's and its whole conversation's, and every one goes to disk while none is read
  back), ``concurrency`` kept in flight; tok/s with the tier on (``MLXQ_KV_DISK_GB``, one directory for the
  whole run, so later runs also evict) against the tier off (``MLXQ_KV_DISK_GB=0``): two workers, started
  first, whose runs alternate (the order swapped each round; the other idle meanwhile), so background load on a
  shared machine falls on both alike. Target: on ÷ off ≥ 0.97 (the median of each round's ratio, and best run
  against best run). Each run also says what the tier did so far (entries written, dropped because the writer
  was behind) and how long its worker took to start;
- **index**: how long opening the tier takes with 1,024 small entries on disk (entries of the tiny model: the
  start-up scan reads only their trailers), with the files in the page cache and out of it.

``python3 -m tests.perf.kvdisk --out DIR`` writes ``kvdisk.md`` and ``kvdisk.json`` (``--quick``: the tiny
model, two short rounds). OpenBLAS is preloaded as the other benchmarks do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["main"]

TARGET = 0.97  # on ÷ off tok/s
_WORDS = ("queue", "model", "token", "server", "batch", "cache", "prompt", "worker", "stream", "reply", "disk",
          "write", "river", "stone", "light", "north", "paper", "glass", "table", "green", "seven", "field")


@dataclass(frozen=True, slots=True)
class Plan:
    """What a run does (``quick``: a smoke run)."""

    size: str = "small"
    rounds: int = 8
    jobs: int = 16  # per run
    concurrency: int = 8
    max_tokens: int = 64
    system_words: int = 60
    user_words: int = 20
    disk_gb: float = 1.0
    index_entries: int = 1024
    index_tokens: int = 200

    @classmethod
    def quick(cls) -> Plan:
        return cls(size="tiny", rounds=2, jobs=8, concurrency=4, max_tokens=16, system_words=60, user_words=20,
                   index_entries=64)


@dataclass(frozen=True, slots=True)
class Run:
    """One worker's run of the stream."""

    round: int
    disk: bool
    jobs: int
    tokens: int  # generated
    prompt_tokens: int  # mean per job
    seconds: float
    ready_s: float  # the worker's start: spawn to its health record showing the model served
    writes: int  # entries the tier wrote (its health record at the end of the run)
    dropped: int  # entries it did not write: the writer was behind
    disk_hits: int  # must stay 0: nothing repeats
    disk_entries: int
    disk_bytes: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class IndexScan:
    """Opening the tier over ``entries`` entries of ``tokens`` tokens each."""

    entries: int
    tokens: int
    mib: float
    warm_ms: float  # the files in the page cache
    cold_ms: float  # dropped from it first (posix_fadvise); -1 where that is not available


@dataclass(frozen=True, slots=True)
class Results:
    plan: Plan
    model: str
    runs: list[Run]
    index: IndexScan
    blas: str

    def pairs(self) -> list[float]:
        """Each round's on ÷ off tok/s."""
        out = []
        for r in range(self.plan.rounds):
            on = [x for x in self.runs if x.round == r and x.disk]
            off = [x for x in self.runs if x.round == r and not x.disk]
            if on and off and off[0].tok_s > 0:
                out.append(on[0].tok_s / off[0].tok_s)
        return out

    def best(self) -> float:
        on = max((x.tok_s for x in self.runs if x.disk), default=0.0)
        off = max((x.tok_s for x in self.runs if not x.disk), default=0.0)
        return on / off if off > 0 else 0.0

    def median_pairs(self) -> float:
        pairs = self.pairs()
        return statistics.median(pairs) if pairs else 0.0

    @property
    def passed(self) -> bool:
        return self.median_pairs() >= TARGET and self.best() >= TARGET


# --- the stream -------------------------------------------------------------------------------------------
def _messages(rng: random.Random, tag: str, plan: Plan) -> list[dict[str, str]]:
    """A conversation no other job shares: its system message starts with its own tag."""
    words = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))  # noqa: E731
    return [{"role": "system", "content": f"Session {tag}. {words(plan.system_words)}"},
            {"role": "user", "content": words(plan.user_words)}]


async def _warm(url: str, prefix: str, plan: Plan, tag: str) -> None:
    """A fresh worker's first jobs (not measured)."""
    from mlxq.api.client import Client

    rng = random.Random(tag)
    async with Client(url, prefix=prefix, retry_deadline=30) as client:
        for i in range(2):
            await client.generate(model="m", messages=_messages(rng, f"{tag}-{i}", plan), max_tokens=plan.max_tokens,
                                  timeout=600)


async def _burst(url: str, prefix: str, plan: Plan, tag: str) -> tuple[int, int, float]:
    """``plan.jobs`` jobs, ``plan.concurrency`` in flight: (tokens generated, prompt tokens, seconds)."""
    from mlxq.api.client import Client

    rng = random.Random(tag)
    queue = [_messages(rng, f"{tag}-{i}", plan) for i in range(plan.jobs)]
    tokens = prompt = 0
    async with Client(url, prefix=prefix, retry_deadline=30) as client:

        async def one() -> None:
            nonlocal tokens, prompt
            while queue:
                result = await client.generate(model="m", messages=queue.pop(), max_tokens=plan.max_tokens,
                                               timeout=600)
                tokens += result.usage.completion_tokens
                prompt += result.usage.prompt_tokens

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(plan.concurrency)))
        return tokens, prompt, time.perf_counter() - start


class _Worker:
    """A worker process with the tier on or off, under a Redis prefix of its own."""

    def __init__(self, server: Any, model: str, plan: Plan, out: Path, kv_dir: Path, disk: bool) -> None:
        from mlxq.worker.tools.process import WorkerProcess

        self.url, self.plan, self.disk = server.url, plan, disk
        self.prefix = f"mlxq-bench-kvdisk-{uuid.uuid4().hex[:6]}"
        env = {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": "m", "MLXQ_REDIS_URL": self.url, "MLXQ_PREFIX": self.prefix,
               "MLXQ_BATCH_CAPACITY": str(plan.concurrency), "MLXQ_JOB_EXPIRY": "0", "MLXQ_HEARTBEAT": "0.5",
               "MLXQ_KV_DISK_GB": str(plan.disk_gb if disk else 0), "MLXQ_KV_DIR": str(kv_dir),
               "OPENBLAS_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        self.proc = WorkerProcess(env, out / "logs" / f"worker-kvdisk-{'on' if disk else 'off'}.log").start()
        self.proc.wait_ready(timeout=300)
        self.ready_s = time.perf_counter() - t0
        asyncio.run(_warm(self.url, self.prefix, plan, f"warm-{uuid.uuid4().hex[:8]}"))

    def run(self, rnd: int) -> Run:
        tokens, prompt, seconds = asyncio.run(_burst(self.url, self.prefix, self.plan, uuid.uuid4().hex))
        time.sleep(1.2)  # the last jobs' writes land (so they do not slow the other worker's run), and two beats
        assert self.proc.proc is not None
        m = _record(self.url, self.prefix, self.proc.proc.pid)
        return Run(rnd, self.disk, self.plan.jobs, tokens, prompt // max(1, self.plan.jobs), seconds, self.ready_s,
                   m.prefix_disk_writes, m.prefix_disk_dropped, m.prefix_disk_hits, m.prefix_disk_entries,
                   m.prefix_disk_bytes)


def _record(url: str, prefix: str, pid: int) -> Any:
    """The worker's model in its health record (it beats every half second here)."""
    import redis

    from mlxq.api.keys import Keys
    from mlxq.api.schema import WorkerStatus

    keys, r = Keys(prefix), redis.Redis.from_url(url)
    try:
        for raw in r.mget([keys.worker(i.decode()) for i in r.zrange(keys.workers(), 0, -1)]):  # type: ignore[union-attr]
            status = WorkerStatus.model_validate_json(raw) if raw else None
            if status is not None and status.pid == pid:
                return status.models[0]
    finally:
        r.close()
    raise RuntimeError("the worker's health record is gone")


def stream(plan: Plan, model: str, out: Path) -> list[Run]:
    """Two workers, the tier on and off, both started first; their runs alternate (the order swapped each round),
    the other worker idle meanwhile."""
    from mlxq.worker.tools.bench.runs import say
    from mlxq.worker.tools.redis_server import RedisServer

    runs: list[Run] = []
    kv_dir = Path(tempfile.mkdtemp(prefix="mlxq-kvdisk-", dir=out))
    workers: list[_Worker] = []
    try:
        with RedisServer() as server:
            try:
                workers = [_Worker(server, model, plan, out, kv_dir, disk) for disk in (True, False)]
                for rnd in range(plan.rounds):
                    for w in (workers if rnd % 2 == 0 else workers[::-1]):
                        runs.append(r := w.run(rnd))
                        say(f"[kvdisk] round {rnd} tier {'on ' if r.disk else 'off'}: {r.tok_s:.1f} tok/s "
                            f"({r.tokens} tokens in {r.seconds:.1f} s); so far written {r.writes}, dropped "
                            f"{r.dropped}, held {r.disk_entries}")
            finally:
                for w in workers:
                    w.proc.stop()
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
    return runs


# --- the index --------------------------------------------------------------------------------------------
def index_scan(plan: Plan, model: str, out: Path) -> IndexScan:
    """Write ``plan.index_entries`` entries, then time opening the tier over them (warm, then cold)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from mlxq.engine.prefix_disk import PrefixDisk

    lm = mlx_lm.load(model)[0]
    rng = random.Random(0)
    vocab = int(lm.args.vocab_size)
    directory = Path(tempfile.mkdtemp(prefix="mlxq-kvindex-", dir=out))
    try:
        cache = make_prompt_cache(lm)
        lm(mx.array([[rng.randrange(vocab) for _ in range(plan.index_tokens)]]), cache=cache)
        mx.eval([c.state for c in cache])
        disk = PrefixDisk(directory, 1 << 40)
        for _ in range(plan.index_entries):  # one cache under many token lists: what the scan reads is the same
            disk.save([rng.randrange(vocab) for _ in range(plan.index_tokens)], cache, "assistant", True,
                      bounded=False)
        disk.close(timeout_s=600)
        files = list(directory.iterdir())
        mib = sum(f.stat().st_size for f in files) / (1 << 20)
        warm = _open_ms(directory, plan.index_entries)
        cold = -1.0
        if hasattr(os, "posix_fadvise"):
            os.sync()
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            cold = _open_ms(directory, plan.index_entries)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return IndexScan(plan.index_entries, plan.index_tokens, round(mib, 1), warm, cold)


def _open_ms(directory: Path, entries: int) -> float:
    from mlxq.engine.prefix_disk import PrefixDisk

    t0 = time.perf_counter()
    disk = PrefixDisk(directory, 1 << 40)
    ms = (time.perf_counter() - t0) * 1000
    found = len(disk)
    disk.close()
    if found != entries:
        raise RuntimeError(f"the index holds {found} entries of {entries}")
    return round(ms, 1)


# --- the report -------------------------------------------------------------------------------------------
def markdown(r: Results) -> str:
    p = r.plan
    lines = [f"# The prefix cache on disk: a stream that never repeats ({p.size} model)", "",
             f"BLAS: {r.blas}. Two workers (capacity {p.concurrency}), the tier on (`MLXQ_KV_DISK_GB="
             f"{p.disk_gb:g}`) and off, 2 jobs each unmeasured; then runs of {p.jobs} chat jobs, {p.concurrency} in "
             f"flight, {p.max_tokens} tokens each (greedy), alternating. Written, dropped, held: the tier's "
             "counters so far.", "",
             "| round | tier | tok/s | tokens | s | prompt tokens | written | dropped | disk hits | held | "
             "held MiB | worker ready s |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r.runs:
        lines.append(f"| {x.round} | {'on' if x.disk else 'off'} | {x.tok_s:.1f} | {x.tokens} | {x.seconds:.1f} | "
                     f"{x.prompt_tokens} | {x.writes} | {x.dropped} | {x.disk_hits} | {x.disk_entries} | "
                     f"{x.disk_bytes / (1 << 20):.0f} | {x.ready_s:.1f} |")
    pairs = ", ".join(f"{v:.3f}" for v in r.pairs())
    ix = r.index
    cold = f"{ix.cold_ms:.1f} ms" if ix.cold_ms >= 0 else "n/a"
    lines += ["", "| target | value | limit | |", "|---|---:|---:|---|",
              f"| tok/s, tier on ÷ off, median of rounds ({pairs}) | {r.median_pairs():.3f} | ≥ {TARGET} | "
              f"{'PASS' if r.median_pairs() >= TARGET else 'MISS'} |",
              f"| tok/s, tier on ÷ off, best runs | {r.best():.3f} | ≥ {TARGET} | "
              f"{'PASS' if r.best() >= TARGET else 'MISS'} |", "",
              f"Index: opening the tier over {ix.entries} entries of {ix.tokens} tokens ({ix.mib:.0f} MiB) took "
              f"{ix.warm_ms:.1f} ms with the files in the page cache, {cold} out of it.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.kvdisk", description=__doc__)
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--no-reexec", action="store_true", help="run with whatever BLAS this process has")
    args = ap.parse_args(argv)
    from mlxq.worker.tools.bench.preload import reexec_with_openblas

    if not args.no_reexec:
        reexec_with_openblas(["-m", "tests.perf.kvdisk", *(argv if argv is not None else sys.argv[1:])])
    from mlxq.worker.tools.blas import blas_of
    from mlxq.worker.tools.tinymodel import ensure_model

    plan = Plan.quick() if args.quick else Plan()
    if args.rounds or args.jobs:
        plan = Plan(**{**asdict(plan), **{k: v for k, v in (("rounds", args.rounds), ("jobs", args.jobs)) if v}})
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = str(ensure_model(plan.size))
    index = index_scan(plan, str(ensure_model("tiny")), out)  # small entries: the tiny model's 1 KiB a token
    runs = stream(plan, model, out)
    result = Results(plan, model, runs, index, blas_of())
    text = markdown(result)
    (out / "kvdisk.md").write_text(text)
    data: dict[str, Any] = asdict(result)
    data["tok_s"] = [x.tok_s for x in runs]
    data["pairs"], data["median_pairs"], data["best"] = result.pairs(), result.median_pairs(), result.best()
    data["target"], data["passed"] = TARGET, result.passed
    (out / "kvdisk.json").write_text(json.dumps(data, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
