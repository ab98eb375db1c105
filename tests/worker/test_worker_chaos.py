"""Load, chaos and soak: a cancel storm, random kills and Redis restarts, and 2,000 jobs of hygiene.

Traffic goes to loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
import pytest
import redis.asyncio as aredis
from mlx_lm.generate import generate_step

from mlxq.api.client import Client
from mlxq.api.protocol.keys import Keys
from mlxq.api.schema import DoneEvent, ErrorEvent, Event, FinishReason
from mlxq.engine.core.prompt import encode_prompt
from mlxq.worker.tools.process import WorkerProcess
from mlxq.worker.tools.redis_server import RedisServer
from tests.support import RunningWorker, config_with, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = [f"prompt {i}: " + "the quick brown fox " * (i % 4) for i in range(10)]


class Overlap:
    """Wraps the batch's methods to count threads inside MLX at once, and which threads enter."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.max_inside = 0
        self.threads: set[int] = set()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.inside += 1
                self.max_inside = max(self.max_inside, self.inside)
                self.threads.add(threading.get_ident())
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.inside -= 1

        return wrapped


def reference_ids(lm: Any, prompt: str, max_tokens: int) -> list[int]:
    model, tokenizer = lm
    out: list[int] = []
    for tok, _ in generate_step(mx.array(encode_prompt(tokenizer, prompt, None)), model, max_tokens=max_tokens):
        if int(tok) in tokenizer.eos_token_ids:
            break
        out.append(int(tok))
    return out


def check_terminal(rid: str, events: list[Event]) -> Event:
    ends = [i for i, e in enumerate(events) if e.type in ("done", "error")]
    assert ends == [len(events) - 1], f"{rid}: terminal events at {ends}: {[e.type for e in events]}"
    assert [e.seq for e in events] == list(range(len(events))), rid
    return events[-1]


async def test_cancel_storm(worker_config: Any, client: Client, tiny_model: Path) -> None:
    import mlx_lm

    lm = mlx_lm.load(str(tiny_model))
    expected = {p: reference_ids(lm, p, 24) for p in PROMPTS}
    running: RunningWorker = await start_worker(config_with(worker_config, capacity=16))
    overlap = Overlap()
    backend = running.service.engine.scheduler.backend
    for name in ("insert", "remove", "step"):
        setattr(backend, name, overlap.wrap(getattr(backend, name)))
    rng = random.Random(1234)
    try:
        jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 1) for i in range(200)]
        rids = await asyncio.gather(*(client.submit(model="tiny", prompt=p, max_tokens=24) for p, _ in jobs))

        async def run(rid: str, cancel: bool) -> list[Event]:
            if cancel:
                await asyncio.sleep(rng.uniform(0, 1.0))
                await client.cancel(rid)
            return [e async for e in client.events(rid, timeout=120)]

        results = await asyncio.gather(*(run(rid, c) for rid, (_, c) in zip(rids, jobs)))
    finally:
        await running.close()
    cancelled = 0
    for rid, (prompt, cancel), events in zip(rids, jobs, results):
        end = check_terminal(rid, events)
        assert isinstance(end, DoneEvent)
        if end.finish_reason is FinishReason.CANCELLED:
            assert cancel, f"{rid} was cancelled without being asked"
            cancelled += 1
        else:
            assert [t for e in events if e.type == "token" for t in e.token_ids] == expected[prompt]
    assert cancelled >= 50  # the storm really hit jobs in flight or queued
    assert overlap.max_inside == 1
    assert len(overlap.threads) == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_chaos_kills_terms_and_redis_restarts(tiny_model: Path, tmp_path: Path) -> None:
    rng = random.Random(7)
    server = RedisServer(appendonly=True, directory=str(tmp_path / "redis")).start()
    env = {"MLXQ_MODEL": str(tiny_model), "MLXQ_MODEL_NAME": "tiny", "MLXQ_REDIS_URL": server.url,
           "MLXQ_BATCH_CAPACITY": "16", "MLXQ_LEASE_TTL": "2", "MLXQ_REAP_INTERVAL": "0.5",
           "MLXQ_DRAIN_TIMEOUT": "0.5", "MLXQ_MAX_TRIES": "6"}
    workers = [WorkerProcess(env, tmp_path / f"w{i}.log").start() for i in range(3)]
    counts = {"kill": 0, "term": 0, "redis_restart": 0}
    try:
        for w in workers:
            await asyncio.to_thread(w.wait_ready, 120)
        async with Client(server.url) as client:
            specs = [(PROMPTS[i % len(PROMPTS)], rng.randint(50, 400)) for i in range(400)]
            rids = [await client.submit(model="tiny", prompt=p, max_tokens=m) for p, m in specs]
            stamped: dict[str, list[tuple[float, Event]]] = {rid: [] for rid in rids}

            async def follow(rid: str) -> None:
                async for ev in client.events(rid, timeout=240):
                    stamped[rid].append((time.monotonic(), ev))

            followers = asyncio.gather(*(follow(rid) for rid in rids))
            await _chaos(rng, workers, server, counts, followers, duration=40.0)
            try:
                await asyncio.wait_for(asyncio.shield(followers), 90)
            except TimeoutError:
                stuck = [rid for rid in rids if not stamped[rid] or stamped[rid][-1][1].type not in ("done", "error")]
                pytest.fail(f"{len(stuck)} jobs stuck: {await _diagnose(server.url, stuck[:5], stamped)}")
        stalls, resets, lost = _check_chaos(stamped, specs)
        print(f"chaos: {len(rids)} jobs, {counts['kill']} SIGKILL, {counts['term']} SIGTERM, "
              f"{counts['redis_restart']} Redis restarts; {resets} resets, {lost} worker_lost; "
              f"max gap between a job's events {max(stalls):.2f}s")
        assert counts["kill"] >= 2 and counts["redis_restart"] >= 1
    finally:
        for w in workers:
            w.kill()
        server.close()


async def _diagnose(url: str, rids: list[str], stamped: dict[str, list[tuple[float, Event]]]) -> list[str]:
    r = aredis.Redis.from_url(url)
    out = []
    for rid in rids:
        pipe = r.pipeline(transaction=False)
        pipe.hget("mlxq:running", rid)
        pipe.get(f"mlxq:{{{rid}}}:lease")
        pipe.zscore("mlxq:queue:tiny", rid)
        pipe.get(f"mlxq:{{{rid}}}:tries")
        pipe.exists(f"mlxq:{{{rid}}}:job")
        pipe.exists(f"mlxq:{{{rid}}}:result")
        running, lease, score, tries, job, result = await pipe.execute()
        last = [e.type for _, e in stamped[rid]][-3:]
        out.append(f"{rid}: last={last} running={running} lease={lease} queued={score is not None} "
                   f"tries={tries} job={job} result={result}")
    await r.aclose()
    return out


async def _chaos(rng: random.Random, workers: list[WorkerProcess], server: RedisServer,
                 counts: dict[str, int], followers: asyncio.Future[Any], duration: float) -> None:
    """Every ~2 s: SIGKILL or SIGTERM a worker (and start it again), or restart Redis.

    The first three actions are two kills and a Redis restart; they happen even if the jobs end sooner (a faster
    machine), so every run has them.
    """
    end = time.monotonic() + duration
    actions = ["kill", "redis_restart", "kill", "term"]
    i = 0
    while i < 3 or (time.monotonic() < end and not followers.done()):
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        action = actions[i % len(actions)]
        i += 1
        if action == "redis_restart":
            await asyncio.to_thread(server.restart)
        else:
            w = rng.choice(workers)
            w.signal(signal.SIGKILL if action == "kill" else signal.SIGTERM)
            assert w.proc is not None
            try:
                code = await asyncio.to_thread(w.proc.wait, 60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker still running 60 s after {action}:\n{_stacks(w)}\nlog:\n{w.tail(80)}")
            # SIGTERM: 0 from arq's drain, or -15 if it came before arq took the signal (at start-up); 1 is the
            # shutdown watchdog, whose stacks are in the log.
            assert action == "kill" or code in (0, -signal.SIGTERM), f"SIGTERM exit {code}; log:\n{w.tail(120)}"
            w.start()
        counts[action] += 1


def _stacks(w: WorkerProcess) -> str:
    """The threads' stacks of a live worker, when py-spy is installed (else a note)."""
    spy = shutil.which("py-spy")
    if spy is None or w.proc is None:
        return "(py-spy not installed: no stacks)"
    out = subprocess.run([spy, "dump", "--pid", str(w.proc.pid)], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def _check_chaos(stamped: dict[str, list[tuple[float, Event]]], specs: list[tuple[str, int]]
                 ) -> tuple[list[float], int, int]:
    stalls, resets, lost = [], 0, 0
    for (rid, items), (_, max_tokens) in zip(stamped.items(), specs):
        events = [e for _, e in items]
        end = check_terminal(rid, events)
        times = [t for t, _ in items]
        stalls.append(max((b - a for a, b in itertools.pairwise(times)), default=0.0))
        resets += sum(e.type == "reset" for e in events)
        if isinstance(end, ErrorEvent):
            assert end.code.value == "worker_lost", end
            lost += 1
            continue
        assert isinstance(end, DoneEvent) and end.usage.completion_tokens == max_tokens
        runs = [""]
        for e in events:
            if e.type == "reset":
                runs.append("")
            elif e.type == "token":
                runs[-1] += e.text
        assert all(runs[-1].startswith(r) for r in runs[:-1]), f"{rid}: a re-run diverged"
    return stalls, resets, lost


@pytest.mark.slow
async def test_soak_2000_jobs_leaves_redis_at_baseline_and_rss_flat(tiny_model: Path, tmp_path: Path,
                                                                    redis_url: str) -> None:
    env = {"MLXQ_MODEL": str(tiny_model), "MLXQ_MODEL_NAME": "tiny", "MLXQ_REDIS_URL": redis_url,
           "MLXQ_BATCH_CAPACITY": "32", "MLXQ_DONE_TTL": "3", "MLXQ_KEEP_RESULT": "3",
           # a disk tier of its own: the session's shared one holds earlier tests' keyed entries, which a starting
           # worker advertises (its baseline would then depend on the tests run before it)
           "MLXQ_KV_DIR": str(tmp_path / "kv")}
    worker = WorkerProcess(env, tmp_path / "soak.log").start()
    r = aredis.Redis.from_url(redis_url)
    try:
        status = await asyncio.to_thread(worker.wait_ready, 120)
        # What a live worker keeps: its health records (its own and arq's), the set of workers, the epoch, and
        # its place among the model's prefix-affinity advertisers (listed holding nothing: it lapses with it).
        baseline = {b"mlxq:epoch", b"mlxq:workers", f"mlxq:worker:{status.id}".encode(),
                    Keys().arq_health(socket.gethostname(), "tiny").encode(),
                    Keys().affinity_advertisers("tiny").encode()}
        assert worker.proc is not None
        proc = psutil.Process(worker.proc.pid)
        async with Client(redis_url) as client:
            rss: list[int] = []
            for _ in range(10):
                rids = await asyncio.gather(*(
                    client.submit(model="tiny", prompt=PROMPTS[i % 10], max_tokens=4) for i in range(200)
                ))
                results = await asyncio.gather(*(client.result(rid, timeout=120) for rid in rids))
                assert all(res.usage.completion_tokens == 4 for res in results)
                rss.append(proc.memory_info().rss)
            # One sample swings by several % with the batch shapes MLX's buffer cache last saw: compare the
            # peaks of waves 2-5 and 6-10; a leak grows them, the cache's churn does not.
            rss_warm, rss_end = max(rss[1:5]), max(rss[5:])
        await asyncio.sleep(4)  # replay logs and arq results expire (3 s TTLs here)
        remaining = {k async for k in r.scan_iter()}
        print(f"soak: 2000 jobs; peak RSS waves 2-5 {rss_warm / 2**20:.1f} MiB, 6-10 {rss_end / 2**20:.1f} "
              f"MiB ({(rss_end / rss_warm - 1) * 100:+.1f}%); keys left {len(remaining)}")
        # and the tokens of each tenant's jobs that ended this minute (tokens-per-minute), gone within two minutes;
        # the dashboard's history of the last minutes' ends and its recent list, bounded in time (and length)
        buckets = {k for k in remaining if k.startswith(b"mlxq:tpm:")}
        assert all([0 < await r.ttl(k) <= 120 for k in buckets])
        history = {k for k in remaining if k.startswith(b"mlxq:hist:") or k == b"mlxq:recent"}
        assert all([0 < await r.ttl(k) <= 86_400 for k in history])
        assert await r.llen(b"mlxq:recent") <= 500
        assert 0 < await r.pttl(Keys().affinity_advertisers("tiny")) <= 30_000
        assert remaining - buckets - history <= baseline, remaining - buckets - history - baseline
        assert rss_end <= rss_warm * 1.05
    finally:
        await r.aclose()
        worker.kill()
