"""The prefix cache's tier on disk against issue 38's targets (its overhead, a restart's next turn), on worker
processes serving a generated model through an embedded Redis:

- **stream**: chat jobs whose prompts never repeat (each a system message of its own, so a job stores two
  entries, its system prompt's and its whole conversation's, and every one goes to disk while none is read
  back), ``concurrency`` kept in flight; tok/s with the tier on (``MLXQ_KV_DISK_GB``, one directory for the
  whole run, so later runs also evict) against the tier off (``MLXQ_KV_DISK_GB=0``): two workers, started
  first, whose runs alternate (the order swapped each round; the other idle meanwhile), so background load on a
  shared machine falls on both alike. Target: on ÷ off ≥ 0.97 (the median of each round's ratio, and best run
  against best run). Each run also says what the tier did so far (entries written, dropped because the writer
  was behind) and how long its worker took to start;
- **index**: how long opening the tier takes with 1,024 small entries on disk (entries of the tiny model: the
  start-up scan reads only their trailers), with the files in the page cache and out of it;
- **restart**: a worker restarted between two turns of a conversation (a ~1,500-token system prompt): turn 1 on
  a worker with the tier on and a fresh directory; once the turn's entry is on disk, that worker is stopped
  (SIGTERM, waited for) or killed (kill -9), a fresh worker starts on the same directory, and turn 2 is its
  first job. Against the same turn 2 as the first job of a fresh worker with the tier off (cold). Targets, for
  each way of stopping: TTFT (submit to first token, at the client) cold ÷ restarted ≥ 10, and turn 2's greedy
  text the same as cold's.

- **system** (issue 52): the deployment of long system prompts and single-turn requests, restarted: two workers,
  each with the tier on in a directory of its own, run ``system_conversations`` first turns at once (each its own
  ~1,500-token system prompt and a question); once their entries are on disk, both are stopped (SIGTERM) or killed
  (kill -9) and restarted on their directories, and each conversation's next request (its system message and a
  new question: it shares only the system prompt) runs, one at a time. Against the same requests on two fresh
  workers with the tier off (cold: each the first of its system prompt there). Targets, for each way of
  stopping: TTFT p50 cold ÷ restarted ≥ 10, every request found its system prompt on disk (on the worker that
  holds it), and the greedy texts the same as cold's.

``python3 -m tests.perf.kvdisk --out DIR`` writes ``kvdisk.md`` and ``kvdisk.json`` (``--quick``: the tiny
model, two short rounds, a ~300-token system prompt; ``--phases restart``: some of the phases only). OpenBLAS is
preloaded as the other benchmarks do.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.perf.affinity import TurnOut

__all__ = ["main"]

TARGET = 0.97  # on ÷ off tok/s
RESTART_TARGET = 10.0  # a restarted worker's next turn: cold TTFT ÷ its TTFT
PHASES = ("stream", "index", "restart", "system")
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
    restart_system_tokens: int = 1500  # the restart phase's system prompt
    restart_max_tokens: int = 16  # each of its turns
    restart_rounds: int = 3  # of each way of stopping, and of cold
    system_conversations: int = 6  # the system phase's system prompts (restart_system_tokens each)

    @classmethod
    def quick(cls) -> Plan:
        return cls(size="tiny", rounds=2, jobs=8, concurrency=4, max_tokens=16, system_words=60, user_words=20,
                   index_entries=64, restart_system_tokens=300, restart_max_tokens=8,
                   restart_rounds=1, system_conversations=3)  # the tiny model: 512 tokens


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
class Turn2:
    """A conversation's second turn on a freshly started worker: ``mode`` "cold" (the tier off, nothing cached),
    or "sigterm" / "kill9" (the worker that ran the first turn stopped so, this one started on its directory)."""

    mode: str
    prompt_tokens: int
    first_entries: int  # entry files on disk when the first turn's worker was stopped (0 for cold)
    first_exit: int | None  # its exit status (SIGTERM: 0; kill -9: -9)
    ready_s: float  # this worker's start: spawn to its health record showing the model served
    ttft_ms: float  # submit to the first token event, at the client
    worker_ttft_ms: float  # the done event's timings: enqueue to the first token published
    disk_hits: int  # this worker's, after the turn (a warm turn: 1)
    text: str  # its greedy tokens
    exact: bool | None = None  # text equals the cold turn's (None: the cold turn itself, or none ran)
    round: int = 0


@dataclass(frozen=True, slots=True)
class Later:
    """The system phase's request of one conversation after the restart (``mode`` "sigterm" or "kill9"), or on a
    fresh worker with the tier off ("cold")."""

    mode: str
    conversation: int
    ttft_ms: float  # submit to the first token event, at the client
    worker_ttft_ms: float
    prompt_tokens: int
    text: str


@dataclass(frozen=True, slots=True)
class SystemRun:
    """One way of stopping in the system phase: its requests, and the restarted workers' disk hits."""

    mode: str
    requests: list[Later]
    disk_hits: int
    first_entries: int  # entry files in both directories when the workers were stopped


@dataclass(frozen=True, slots=True)
class Results:
    plan: Plan
    model: str
    runs: list[Run]  # empty when the stream phase did not run
    index: IndexScan | None
    blas: str
    restarts: list[Turn2] = field(default_factory=list)
    system: list[SystemRun] = field(default_factory=list)

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

    def modes(self) -> list[str]:
        """The restart phase's ways of stopping the first worker, in the order they ran (cold not among them)."""
        return list(dict.fromkeys(t.mode for t in self.restarts if t.mode != "cold"))

    def ttft_ms(self, mode: str) -> float:
        """The median TTFT (client-side) of ``mode``'s turns 2 over the rounds; 0 if none ran."""
        values = [t.ttft_ms for t in self.restarts if t.mode == mode]
        return statistics.median(values) if values else 0.0

    def speedup(self, mode: str) -> float:
        """Cold TTFT ÷ ``mode``'s, medians over the rounds."""
        warm = self.ttft_ms(mode)
        return self.ttft_ms("cold") / warm if warm > 0 else 0.0

    def exact(self, mode: str) -> bool:
        """Every one of ``mode``'s turns 2 answered as cold did."""
        return all(t.exact for t in self.restarts if t.mode == mode)

    @property
    def passed(self) -> bool:
        """Every phase that ran met its target (the index phase has none)."""
        stream = not self.runs or (self.median_pairs() >= TARGET and self.best() >= TARGET)
        restart = not self.restarts or all(self.speedup(m) >= RESTART_TARGET and self.exact(m) for m in self.modes())
        system = all(self.system_speedup(x) >= RESTART_TARGET and self.system_exact(x)
                     and x.disk_hits >= len(x.requests) for x in self.system if x.mode != "cold")
        return stream and restart and system

    def system_cold(self) -> SystemRun | None:
        return next((x for x in self.system if x.mode == "cold"), None)

    def system_speedup(self, run: SystemRun) -> float:
        """The system phase: cold TTFT p50 ÷ ``run``'s."""
        cold = self.system_cold()
        if cold is None or not run.requests:
            return 0.0
        warm = statistics.median(t.ttft_ms for t in run.requests)
        return statistics.median(t.ttft_ms for t in cold.requests) / warm if warm > 0 else 0.0

    def system_exact(self, run: SystemRun) -> bool:
        """Every request of ``run`` answered as cold did."""
        cold = self.system_cold()
        texts = {t.conversation: t.text for t in cold.requests} if cold is not None else {}
        return all(texts.get(t.conversation) == t.text for t in run.requests)


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
        env = _env(self.url, self.prefix, model, plan, kv_dir, disk)
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


def _env(url: str, prefix: str, model: str, plan: Plan, kv_dir: Path, disk: bool) -> dict[str, str]:
    """A worker's settings: the tier on (``plan.disk_gb``) or off, its health record beating every half second."""
    return {"MLXQ_MODEL": model, "MLXQ_MODEL_NAME": "m", "MLXQ_REDIS_URL": url, "MLXQ_PREFIX": prefix,
            "MLXQ_BATCH_CAPACITY": str(plan.concurrency), "MLXQ_JOB_EXPIRY": "0", "MLXQ_HEARTBEAT": "0.5",
            "MLXQ_KV_DISK_GB": str(plan.disk_gb if disk else 0), "MLXQ_KV_DIR": str(kv_dir),
            "OPENBLAS_NUM_THREADS": "1"}


def _record(url: str, prefix: str, pid: int) -> Any:
    """The worker's model in its health record (it beats every half second here)."""
    import redis

    from mlxq.api.protocol.keys import Keys
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

    from mlxq.engine.mlx.prefix.disk import PrefixDisk

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
    from mlxq.engine.mlx.prefix.disk import PrefixDisk

    t0 = time.perf_counter()
    disk = PrefixDisk(directory, 1 << 40)
    ms = (time.perf_counter() - t0) * 1000
    found = len(disk)
    disk.close()
    if found != entries:
        raise RuntimeError(f"the index holds {found} entries of {entries}")
    return round(ms, 1)


# --- the restart ------------------------------------------------------------------------------------------
def _conversation(plan: Plan, model: str) -> list[dict[str, str]]:
    """Turn 1: a system prompt of about ``plan.restart_system_tokens`` tokens (affinity's), and a question."""
    from transformers import AutoTokenizer

    from tests.perf.affinity import _system_prompt

    system = _system_prompt(0, plan.restart_system_tokens, AutoTokenizer.from_pretrained(model))
    return [{"role": "system", "content": system}, {"role": "user", "content": "What survives a restart?"}]


def _second(first: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And what does not?"}]


async def _timed(url: str, prefix: str, plan: Plan, messages: list[dict[str, str]]) -> TurnOut:
    """One greedy job of the restart phase, followed to its end."""
    from mlxq.api.client import Client
    from tests.perf.affinity import turn

    async with Client(url, prefix=prefix, retry_deadline=30) as client:
        return await turn(client, messages, plan.restart_max_tokens)


def _wait_on_disk(kv_dir: Path, timeout: float = 120.0) -> int:
    """Poll ``kv_dir`` until an entry is on disk (the first turn's: its system prompt's checkpoint waits 5 s, and
    the turn's entry supersedes it); returns how many are. A file gets an entry's name only once written whole:
    what a kill -9 leaves is what the directory shows, seen at once (the health record's ``writes`` counts it at
    the next beat)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if n := len(list(kv_dir.rglob("*.kv.safetensors"))):
            return n
        time.sleep(0.05)
    raise RuntimeError(f"the first turn's entry was not written in {timeout:.0f} s")


def _disk_hits(url: str, prefix: str, pid: int, timeout: float = 3.0) -> int:
    """The worker's disk hits once its health record counts one (it beats every half second), or as it stands
    after ``timeout``."""
    end = time.monotonic() + timeout
    while (hits := int(_record(url, prefix, pid).prefix_disk_hits)) < 1 and time.monotonic() < end:
        time.sleep(0.1)
    return hits


class _Start:
    """A fresh worker on ``kv_dir`` under ``prefix``, waited for until it serves."""

    def __init__(self, url: str, prefix: str, model: str, plan: Plan, out: Path, kv_dir: Path, disk: bool,
                 name: str) -> None:
        from mlxq.worker.tools.process import WorkerProcess

        t0 = time.perf_counter()
        self.proc = WorkerProcess(_env(url, prefix, model, plan, kv_dir, disk),
                                  out / "logs" / f"worker-kvdisk-restart-{name}.log").start()
        try:
            self.proc.wait_ready(timeout=300)
        except BaseException:
            self.proc.kill()
            raise
        self.ready_s = time.perf_counter() - t0

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid


@contextmanager
def _scratch(out: Path) -> Iterator[tuple[Path, str]]:
    """A KV directory of its own (removed after) and a Redis prefix of its own."""
    kv_dir = Path(tempfile.mkdtemp(prefix="mlxq-kvrestart-", dir=out))
    try:
        yield kv_dir, f"mlxq-bench-kvrestart-{uuid.uuid4().hex[:6]}"
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)


def _restarted(url: str, model: str, plan: Plan, out: Path, mode: str,
               first: list[dict[str, str]]) -> tuple[Turn2, str]:
    """Turn 1 on a worker with the tier on, that worker stopped (``mode``), turn 2 on a fresh one on the same
    directory: (turn 2, turn 1's answer)."""
    with _scratch(out) as (kv_dir, prefix):
        one = _Start(url, prefix, model, plan, out, kv_dir, True, f"{mode}-first")
        try:
            answer = asyncio.run(_timed(url, prefix, plan, first)).text
            written = _wait_on_disk(kv_dir)
            if mode == "sigterm":
                code = one.proc.stop(timeout=120)
            else:
                one.proc.kill()
                code = one.proc.proc.returncode if one.proc.proc is not None else None
        finally:
            one.proc.kill()
        two = _Start(url, prefix, model, plan, out, kv_dir, True, f"{mode}-second")
        try:
            t = asyncio.run(_timed(url, prefix, plan, _second(first, answer)))
            hits = _disk_hits(url, prefix, two.pid)
        finally:
            two.proc.stop()
    return Turn2(mode, t.prompt_tokens, written, code, two.ready_s, t.client_ttft_ms, t.ttft_ms, hits, t.text), answer


def _cold(url: str, model: str, plan: Plan, out: Path, messages: list[dict[str, str]]) -> Turn2:
    """Turn 2 on a fresh worker with the tier off: nothing cached anywhere."""
    with _scratch(out) as (kv_dir, prefix):
        w = _Start(url, prefix, model, plan, out, kv_dir, False, "cold")
        try:
            t = asyncio.run(_timed(url, prefix, plan, messages))
        finally:
            w.proc.stop()
    return Turn2("cold", t.prompt_tokens, 0, None, w.ready_s, t.client_ttft_ms, t.ttft_ms, 0, t.text)


def restart(plan: Plan, model: str, out: Path) -> list[Turn2]:
    """Rounds of: for SIGTERM and kill -9, a conversation's second turn on a worker restarted between its turns;
    then the same turn on a fresh worker with the tier off (cold), whose greedy text each restarted turn must
    equal. Each turn 2 is its worker's first job."""
    from mlxq.worker.tools.bench.runs import say
    from mlxq.worker.tools.redis_server import RedisServer

    first = _conversation(plan, model)
    turns: list[Turn2] = []
    answer = cold_text = None
    with RedisServer() as server:
        for rnd in range(plan.restart_rounds):
            for mode in ("sigterm", "kill9"):
                turn, said = _restarted(server.url, model, plan, out, mode, first)
                answer = said if answer is None else answer
                turns.append(replace(turn, round=rnd, exact=said == answer))  # the same turn 2 so far; text below
                say(f"[kvdisk] restart {rnd} ({mode}): TTFT {turn.ttft_ms:.0f} ms (worker {turn.worker_ttft_ms:.0f} "
                    f"ms), {turn.prompt_tokens} prompt tokens, disk hits {turn.disk_hits}, first worker left "
                    f"{turn.first_entries} entries and exited {turn.first_exit}")
            assert answer is not None
            cold = _cold(server.url, model, plan, out, _second(first, answer))
            cold_text = cold.text if cold_text is None else cold_text
            turns.append(replace(cold, round=rnd))
            say(f"[kvdisk] restart {rnd} (cold): TTFT {cold.ttft_ms:.0f} ms (worker {cold.worker_ttft_ms:.0f} ms)")
    # greedy: every round's turn 2, restarted or cold, the same text (a cold one differing fails them all)
    same = all(t.text == cold_text for t in turns if t.mode == "cold")
    return [t if t.mode == "cold" else replace(t, exact=bool(t.exact) and same and t.text == cold_text)
            for t in turns]


# --- the system shape, restarted ------------------------------------------------------------------------------
def _systems(plan: Plan, model: str) -> list[str]:
    from transformers import AutoTokenizer

    from tests.perf.affinity import SYSTEM_SHAPE_TOKENS, _system_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = max(plan.restart_system_tokens, SYSTEM_SHAPE_TOKENS)  # each long enough for a key of its own
    return [_system_prompt(i, tokens, tokenizer) for i in range(plan.system_conversations)]


def _asking(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def _firsts(url: str, prefix: str, plan: Plan, systems: list[str]) -> None:
    """Every conversation's first request, at once (unmeasured)."""
    from mlxq.api.client import Client
    from tests.perf.affinity import turn

    async with Client(url, prefix=prefix, retry_deadline=30) as client:
        await asyncio.gather(*(turn(client, _asking(s, f"What is {_WORDS[i]}?"), plan.restart_max_tokens)
                               for i, s in enumerate(systems)))


async def _laters(url: str, prefix: str, plan: Plan, systems: list[str], mode: str) -> list[Later]:
    """Each conversation's next request (its system prompt, a new question), one at a time."""
    from mlxq.api.client import Client
    from tests.perf.affinity import turn

    out = []
    async with Client(url, prefix=prefix, retry_deadline=30) as client:
        for i, s in enumerate(systems):
            t = await turn(client, _asking(s, f"And why does {_WORDS[-1 - i]} matter?"), plan.restart_max_tokens)
            out.append(Later(mode, i, t.client_ttft_ms, t.ttft_ms, t.prompt_tokens, t.text))
    return out


def _wait_entries(dirs: list[Path], n: int, timeout: float = 120.0) -> int:
    """Poll until ``n`` entries are on disk in ``dirs`` together, then a moment for any still being written
    (a system prompt's checkpoint is handed to the writer before its turn's entry); how many are."""
    end = time.monotonic() + timeout
    count = 0
    while time.monotonic() < end and (count := sum(len(list(d.rglob("*.kv.safetensors"))) for d in dirs)) < n:
        time.sleep(0.05)
    if count < n:
        raise RuntimeError(f"{count} of {n} entries written in {timeout:.0f} s")
    time.sleep(1.0)
    return sum(len(list(d.rglob("*.kv.safetensors"))) for d in dirs)


def _system_restarted(url: str, model: str, plan: Plan, out: Path, mode: str, systems: list[str]) -> SystemRun:
    """The first requests on two workers with the tier on, both stopped (``mode``) and restarted on their
    directories, then each conversation's next request."""
    with _scratch(out) as (one_dir, prefix), _scratch(out) as (two_dir, _):
        dirs = [one_dir, two_dir]
        first = [_Start(url, prefix, model, plan, out, d, True, f"system-{mode}-first-{k}") for k, d in enumerate(dirs)]
        try:
            asyncio.run(_firsts(url, prefix, plan, systems))
            entries = _wait_entries(dirs, len(systems))
            for w in first:
                if mode == "sigterm":
                    w.proc.stop(timeout=120)
                else:
                    w.proc.kill()
        finally:
            for w in first:
                w.proc.kill()
        second = [_Start(url, prefix, model, plan, out, d, True, f"system-{mode}-second-{k}")
                  for k, d in enumerate(dirs)]
        try:
            laters = asyncio.run(_laters(url, prefix, plan, systems, mode))
            time.sleep(1.0)  # a heartbeat or two: the health records carry the disk hits
            hits = sum(int(_record(url, prefix, w.pid).prefix_disk_hits) for w in second)
        finally:
            for w in second:
                w.proc.stop()
    return SystemRun(mode, laters, hits, entries)


def _system_cold(url: str, model: str, plan: Plan, out: Path, systems: list[str]) -> SystemRun:
    """The same next requests on two fresh workers with the tier off: each the first of its system prompt."""
    with _scratch(out) as (kv_dir, prefix):
        workers = [_Start(url, prefix, model, plan, out, kv_dir, False, f"system-cold-{k}") for k in range(2)]
        try:
            laters = asyncio.run(_laters(url, prefix, plan, systems, "cold"))
        finally:
            for w in workers:
                w.proc.stop()
    return SystemRun("cold", laters, 0, 0)


def system_restart(plan: Plan, model: str, out: Path) -> list[SystemRun]:
    """The system phase (module docstring): SIGTERM, kill -9, then cold."""
    from mlxq.worker.tools.bench.runs import say
    from mlxq.worker.tools.redis_server import RedisServer

    systems = _systems(plan, model)
    runs = []
    with RedisServer() as server:
        for mode in ("sigterm", "kill9"):
            runs.append(x := _system_restarted(server.url, model, plan, out, mode, systems))
            say(f"[kvdisk] system ({mode}): TTFT p50 {statistics.median(t.ttft_ms for t in x.requests):.0f} ms, "
                f"disk hits {x.disk_hits} of {len(x.requests)}, {x.first_entries} entries left")
        runs.append(x := _system_cold(server.url, model, plan, out, systems))
        say(f"[kvdisk] system (cold): TTFT p50 {statistics.median(t.ttft_ms for t in x.requests):.0f} ms")
    return runs


# --- the report -------------------------------------------------------------------------------------------
def markdown(r: Results) -> str:
    lines = [f"# The prefix cache on disk ({r.plan.size} model)", "", f"BLAS: {r.blas}.", ""]
    if r.runs:
        lines += _stream_md(r)
    if r.index is not None:
        ix = r.index
        cold = f"{ix.cold_ms:.1f} ms" if ix.cold_ms >= 0 else "n/a"
        lines += [f"Index: opening the tier over {ix.entries} entries of {ix.tokens} tokens ({ix.mib:.0f} MiB) took "
                  f"{ix.warm_ms:.1f} ms with the files in the page cache, {cold} out of it.", ""]
    if r.restarts:
        lines += _restart_md(r)
    if r.system:
        lines += _system_md(r)
    return "\n".join(lines)


def _stream_md(r: Results) -> list[str]:
    p = r.plan
    lines = ["## A stream that never repeats", "",
             f"Two workers (capacity {p.concurrency}), the tier on (`MLXQ_KV_DISK_GB={p.disk_gb:g}`) and off, 2 jobs "
             f"each unmeasured; then runs of {p.jobs} chat jobs, {p.concurrency} in flight, {p.max_tokens} tokens "
             "each (greedy), alternating. Written, dropped, held: the tier's counters so far.", "",
             "| round | tier | tok/s | tokens | s | prompt tokens | written | dropped | disk hits | held | "
             "held MiB | worker ready s |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r.runs:
        lines.append(f"| {x.round} | {'on' if x.disk else 'off'} | {x.tok_s:.1f} | {x.tokens} | {x.seconds:.1f} | "
                     f"{x.prompt_tokens} | {x.writes} | {x.dropped} | {x.disk_hits} | {x.disk_entries} | "
                     f"{x.disk_bytes / (1 << 20):.0f} | {x.ready_s:.1f} |")
    pairs = ", ".join(f"{v:.3f}" for v in r.pairs())
    lines += ["", "| target | value | limit | |", "|---|---:|---:|---|",
              f"| tok/s, tier on ÷ off, median of rounds ({pairs}) | {r.median_pairs():.3f} | ≥ {TARGET} | "
              f"{'PASS' if r.median_pairs() >= TARGET else 'MISS'} |",
              f"| tok/s, tier on ÷ off, best runs | {r.best():.3f} | ≥ {TARGET} | "
              f"{'PASS' if r.best() >= TARGET else 'MISS'} |", ""]
    return lines


def _restart_md(r: Results) -> list[str]:
    p = r.plan
    lines = ["## A worker restarted between two turns", "",
             f"Turn 1 (a ~{p.restart_system_tokens}-token system prompt and a question, {p.restart_max_tokens} "
             "greedy tokens) on a worker with the tier on; once the turn's entry is on disk (its file in the "
             "directory), the worker is stopped (SIGTERM, waited for) or killed (kill -9), a fresh one starts on "
             "the same directory, and turn 2 (turn 1, its answer, a new question) is its first job. Cold: turn 2 as "
             f"the first job of a fresh worker with the tier off. Rounds of the three: {p.restart_rounds}. TTFT: "
             "submit to the first token event, at the client (the worker's own, enqueue to first token, beside "
             "it); the targets compare each mode's median over the rounds.", "",
             "| round | turn 2 | TTFT ms | worker TTFT ms | prompt tokens | disk hits | first worker: entries, exit | "
             "worker ready s |", "|---:|---|---:|---:|---:|---:|---|---:|"]
    for t in r.restarts:
        first = "" if t.mode == "cold" else f"{t.first_entries}, {t.first_exit}"
        lines.append(f"| {t.round} | {t.mode} | {t.ttft_ms:.0f} | {t.worker_ttft_ms:.0f} | {t.prompt_tokens} | "
                     f"{t.disk_hits} | {first} | {t.ready_s:.1f} |")
    lines += ["", "| target | value | limit | |", "|---|---:|---:|---|"]
    for m in r.modes():
        x, same = r.speedup(m), r.exact(m)
        lines += [f"| TTFT p50 cold ÷ restarted, {m} ({r.ttft_ms('cold'):.0f} ms ÷ {r.ttft_ms(m):.0f} ms) | {x:.1f}x | "
                  f"≥ {RESTART_TARGET:g}x | {'PASS' if x >= RESTART_TARGET else 'MISS'} |",
                  f"| turn 2's greedy text, {m} = cold | {'same' if same else 'differs'} | same | "
                  f"{'PASS' if same else 'MISS'} |"]
    return [*lines, ""]


def _system_md(r: Results) -> list[str]:
    from tests.perf.affinity import SYSTEM_SHAPE_TOKENS

    p = r.plan
    lines = ["## Single-turn requests sharing system prompts, the fleet restarted", "",
             f"{p.system_conversations} system prompts of ~{max(p.restart_system_tokens, SYSTEM_SHAPE_TOKENS)} "
             "tokens; their first requests at "
             "once on two workers, each with the tier on in a directory of its own; once the entries are on disk "
             "both workers are stopped (SIGTERM) or killed (kill -9) and restarted on their directories; then each "
             f"system prompt's next request (a new question, {p.restart_max_tokens} greedy tokens), one at a time. "
             "Cold: the same requests on two fresh workers with the tier off.", "",
             "| run | TTFT p50 ms | worker TTFT p50 ms | disk hits | entries left | cold ÷ this | texts = cold |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for x in r.system:
        ttft = statistics.median(t.ttft_ms for t in x.requests)
        worker = statistics.median(t.worker_ttft_ms for t in x.requests)
        cold = x.mode == "cold"
        lines.append(f"| {x.mode} | {ttft:.0f} | {worker:.0f} | {'' if cold else f'{x.disk_hits} of {len(x.requests)}'}"
                     f" | {'' if cold else x.first_entries} | {'' if cold else f'{r.system_speedup(x):.1f}x'} | "
                     f"{'' if cold else ('same' if r.system_exact(x) else 'differs')} |")
    lines += ["", "| target | value | limit | |", "|---|---:|---:|---|"]
    for x in r.system:
        if x.mode == "cold":
            continue
        v, all_hit = r.system_speedup(x), x.disk_hits >= len(x.requests)
        lines += [f"| TTFT p50 cold ÷ restarted, {x.mode} | {v:.1f}x | ≥ {RESTART_TARGET:g}x | "
                  f"{'PASS' if v >= RESTART_TARGET else 'MISS'} |",
                  f"| requests served from disk, {x.mode} | {x.disk_hits} of {len(x.requests)} | all | "
                  f"{'PASS' if all_hit else 'MISS'} |"]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.perf.kvdisk", description=__doc__)
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {','.join(PHASES)} (default all)")
    ap.add_argument("--no-reexec", action="store_true", help="run with whatever BLAS this process has")
    args = ap.parse_args(argv)
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}
    if not phases or not phases <= set(PHASES):
        ap.error(f"--phases: some of {','.join(PHASES)}")
    from mlxq.worker.tools.bench.preload import reexec_with_openblas

    if not args.no_reexec:
        reexec_with_openblas(["-m", "tests.perf.kvdisk", *(argv if argv is not None else sys.argv[1:])])
    from mlxq.worker.tools.blas import blas_of
    from mlxq.worker.tools.tinymodel import ensure_model

    plan = Plan.quick() if args.quick else Plan()
    plan = replace(plan, **{k: v for k, v in (("rounds", args.rounds), ("jobs", args.jobs)) if v})
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = str(ensure_model(plan.size))
    # small entries for the index: the tiny model's 1 KiB a token
    index = index_scan(plan, str(ensure_model("tiny")), out) if "index" in phases else None
    runs = stream(plan, model, out) if "stream" in phases else []
    restarts = restart(plan, model, out) if "restart" in phases else []
    system = system_restart(plan, model, out) if "system" in phases else []
    result = Results(plan, model, runs, index, blas_of(), restarts, system)
    text = markdown(result)
    (out / "kvdisk.md").write_text(text)
    (out / "kvdisk.json").write_text(json.dumps(_data(result), indent=2))
    print(text)
    return 0


def _data(result: Results) -> dict[str, Any]:
    data: dict[str, Any] = asdict(result)
    data["tok_s"] = [x.tok_s for x in result.runs]
    data["pairs"], data["median_pairs"], data["best"] = result.pairs(), result.median_pairs(), result.best()
    data["target"], data["restart_target"], data["passed"] = TARGET, RESTART_TARGET, result.passed
    data["restart"] = {m: {"ttft_ms": result.ttft_ms(m), "cold_ttft_ms": result.ttft_ms("cold"),
                           "speedup": result.speedup(m), "exact": result.exact(m)} for m in result.modes()}
    data["system_restart"] = {x.mode: {"speedup": result.system_speedup(x), "exact": result.system_exact(x),
                                       "disk_hits": x.disk_hits} for x in result.system if x.mode != "cold"}
    return data


if __name__ == "__main__":
    sys.exit(main())
