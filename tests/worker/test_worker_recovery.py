"""Nothing lost, nothing hung: SIGKILLed workers, SIGTERM drains and Redis restarts, with worker processes.

Every job must end with exactly one terminal event after its last ``reset``, and a re-run's greedy text
must continue what subscribers already saw (the partial text before a reset is a prefix of the final one).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from api.client import Client
from api.schema import DoneEvent, Event, FinishReason
from worker.process import WorkerProcess
from worker.redis_server import RedisServer

FAST_RECOVERY = {"MLXQ_LEASE_TTL": "2", "MLXQ_REAP_INTERVAL": "0.5", "MLXQ_CANCEL_POLL": "0.1"}


@dataclass
class Follower:
    """Everything one subscriber saw of a job, with arrival times."""

    rid: str
    events: list[Event] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.events if e.type == "token")

    def runs(self) -> list[str]:
        """Text of each run, split at reset events."""
        runs = [""]
        for e in self.events:
            if e.type == "reset":
                runs.append("")
            elif e.type == "token":
                runs[-1] += e.text
        return runs

    def first_time(self, kind: str) -> float | None:
        return next((t for e, t in zip(self.events, self.times) if e.type == kind), None)


def check_one_terminal(f: Follower) -> Event:
    ends = [i for i, e in enumerate(f.events) if e.type in ("done", "error")]
    assert ends == [len(f.events) - 1], f"{f.rid}: terminal events at {ends} of {[e.type for e in f.events]}"
    assert [e.seq for e in f.events] == list(range(len(f.events)))
    return f.events[-1]


async def follow(client: Client, f: Follower, timeout: float) -> None:
    async for ev in client.events(f.rid, timeout=timeout):
        f.events.append(ev)
        f.times.append(time.monotonic())


async def wait_until(predicate: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tinymodel import ensure_model

    return ensure_model("small", root=tmp_path_factory.mktemp("small"))


@pytest.fixture
def spawn(redis_url: str, small_model: Path, tmp_path: Path) -> Any:
    procs: list[WorkerProcess] = []

    def start(name: str, url: str = redis_url, **env: str) -> WorkerProcess:
        base = {"MLXQ_MODEL": str(small_model), "MLXQ_MODEL_NAME": "small", "MLXQ_REDIS_URL": url,
                "MLXQ_BATCH_CAPACITY": "8", **FAST_RECOVERY, **env}
        proc = WorkerProcess(base, tmp_path / f"{name}.log").start()
        procs.append(proc)
        proc.wait_ready(timeout=120)
        return proc

    yield start
    for proc in procs:
        proc.kill()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Client]:
    async with Client(redis_url) as c:
        yield c


async def submit_and_follow(client: Client, n: int, max_tokens: int, timeout: float = 90
                            ) -> tuple[list[Follower], asyncio.Future[Any]]:
    rids = [await client.submit(model="small", prompt=f"job {i}: the quick brown fox", max_tokens=max_tokens)
            for i in range(n)]
    followers = [Follower(rid) for rid in rids]
    tasks = asyncio.gather(*(follow(client, f, timeout) for f in followers))
    return followers, tasks


async def test_sigkill_mid_decode_jobs_reset_and_finish_on_another_worker(spawn: Any, client: Client) -> None:
    first = spawn("a")
    followers, tasks = await submit_and_follow(client, 5, max_tokens=120)
    await wait_until(lambda: all(f.tokens() >= 3 for f in followers), 60, "every job decoding")
    first.kill()
    killed_at = time.monotonic()
    spawn("b")
    await asyncio.wait_for(tasks, 120)
    recovery = []
    for f in followers:
        end = check_one_terminal(f)
        assert isinstance(end, DoneEvent) and end.finish_reason is FinishReason.LENGTH
        reset_at = f.first_time("reset")
        assert reset_at is not None, f"{f.rid}: no reset after its worker died"
        recovery.append(reset_at - killed_at)
        before, *_, final = f.runs()
        assert len(before) > 0 and final.startswith(before)  # the re-run continues what was seen
        assert end.usage.completion_tokens == 120
    print(f"SIGKILL recovery (kill -> reset): max {max(recovery):.2f}s")
    assert max(recovery) < 15


async def test_sigterm_drains_short_jobs_and_requeues_long_ones(spawn: Any, client: Client) -> None:
    # The drain must outlast the short jobs' remaining ~10 steps on a slow, shared machine (~0.15 s each
    # at worst here), and end well before the long jobs' ~200 steps.
    first = spawn("a", MLXQ_DRAIN_TIMEOUT="5")
    short, short_tasks = await submit_and_follow(client, 2, max_tokens=12)
    long, long_tasks = await submit_and_follow(client, 3, max_tokens=200)
    await wait_until(lambda: all(f.tokens() >= 2 for f in long), 60, "long jobs decoding")
    first.signal(signal.SIGTERM)
    await asyncio.wait_for(short_tasks, 60)
    for f in short:
        assert [e.type for e in f.events].count("reset") == 0
        assert isinstance(check_one_terminal(f), DoneEvent)
    assert first.proc is not None
    assert await asyncio.to_thread(first.proc.wait, 60) == 0
    log = first.log_path.read_text()
    assert "Traceback" not in log
    assert "handed back to the queue" in log
    spawn("b")
    await asyncio.wait_for(long_tasks, 120)
    for f in long:
        end = check_one_terminal(f)
        assert isinstance(end, DoneEvent) and end.usage.completion_tokens == 200
        before, *_, final = f.runs()
        assert [e.type for e in f.events].count("reset") == 1
        assert final.startswith(before)


async def test_worker_and_client_survive_a_redis_restart(small_model: Path, tmp_path: Path) -> None:
    server = RedisServer(appendonly=True, directory=str(tmp_path / "redis")).start()
    worker = None
    try:
        env = {"MLXQ_MODEL": str(small_model), "MLXQ_MODEL_NAME": "small", "MLXQ_REDIS_URL": server.url,
               **FAST_RECOVERY, "MLXQ_LEASE_TTL": "5"}
        worker = WorkerProcess(env, tmp_path / "w.log").start()
        worker.wait_ready(timeout=120)
        async with Client(server.url) as client:
            followers, tasks = await submit_and_follow(client, 3, max_tokens=150)
            await wait_until(lambda: all(f.tokens() >= 3 for f in followers), 60, "decoding")
            await asyncio.to_thread(server.restart)
            await asyncio.wait_for(tasks, 120)
            for f in followers:
                check_one_terminal(f)
            after = await client.generate(model="small", prompt="after the restart", max_tokens=5, timeout=60)
            assert after.usage.completion_tokens == 5
        assert worker.proc is not None and worker.proc.poll() is None, worker.tail()
    finally:
        if worker is not None:
            worker.kill()
        server.close()
