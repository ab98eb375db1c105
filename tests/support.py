"""Helpers shared by tests: an in-process arq worker on the test's event loop; a benchmark's quick run."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest


class RunningWorker:
    """A real arq Worker running on the test's event loop."""

    def __init__(self, worker: Any, task: asyncio.Task[None]) -> None:
        self.worker = worker
        self.task = task

    @property
    def host(self) -> Any:
        """The worker's host (worker/host.py): claims, runs, the shared loops."""
        from mlxq.worker.arqseam import host_of

        return host_of(self.worker)

    @property
    def service(self) -> Any:
        """The one model it serves (worker/service.py)."""
        (service,) = self.host.services.values()
        return service

    async def close(self, drain_s: float = 10.0) -> None:
        # Like a SIGTERM with job_completion_wait: stop taking jobs and let running ones finish, since
        # arq's close() cancels whatever is still running (even a job recording its result).
        self.worker.allow_pick_jobs = False
        for _ in range(int(drain_s / 0.01)):
            if all(t.done() for t in self.worker.tasks.values()):
                break
            await asyncio.sleep(0.01)
        await self.worker.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def start_worker(config: Any, **overrides: Any) -> RunningWorker:
    from arq.worker import Worker

    from mlxq.worker.settings import worker_settings

    worker = Worker(**{**worker_settings(config), "handle_signals": False, **overrides})
    task = asyncio.create_task(worker.async_run())
    from mlxq.worker.arqseam import host_of

    for _ in range(600):
        if host_of(worker) is not None:
            return RunningWorker(worker, task)
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    raise RuntimeError("worker did not start")


def config_with(config: Any, **changes: Any) -> Any:
    return replace(config, **changes)


async def enqueue_raw(redis_url: str, payload: Any, job_id: str, model: str = "tiny", prefix: str = "mlxq") -> None:
    """Queue a job record around any payload, as a producer other than ``Client`` might."""
    import time

    import redis.asyncio as aredis

    from mlxq.api.protocol.jobrecord import job_record
    from mlxq.api.protocol.keys import Keys

    keys, now = Keys(prefix), int(time.time() * 1000)
    r = aredis.Redis.from_url(redis_url)
    try:
        await r.set(keys.job(job_id), job_record(payload, now), px=86_400_000)
        await r.zadd(keys.queue(model), {job_id: now})
    finally:
        await r.aclose()


# --- helpers the test modules share ----------------------------------------------------------------
def free_port() -> int:
    """A free loopback port (for a server the test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(predicate: Any, what: str = "the condition", timeout: float = 60) -> None:
    """Poll ``predicate`` until it holds (the timeout is a safety bound only)."""
    import time

    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def collect(client: Any, rid: str, timeout: float = 60) -> list[Any]:
    """Every event of job ``rid``, up to its terminal one."""
    return [ev async for ev in client.events(rid, timeout=timeout)]


def terminal(events: list[Any]) -> Any:
    """The one terminal event of a job's events, which is their last, their seqs 0, 1, 2, ..."""
    ends = [e for e in events if e.type in ("done", "error")]
    assert len(ends) == 1, f"expected exactly one terminal event, got {ends}"
    assert events[-1] is ends[0]
    assert [e.seq for e in events] == list(range(len(events)))
    return ends[0]


def text_of(events: list[Any]) -> str:
    return "".join(e.text for e in events if e.type == "token")


def slow_steps(running: RunningWorker, delay: float) -> Callable[[], None]:
    """Make every engine step take at least ``delay`` (still real MLX work), to land cancels mid-phase; the
    function returned puts the steps back to full speed (for what the test no longer times, e.g. references)."""
    import time

    backend = running.service.engine.scheduler.backend
    step = backend.step

    def slow() -> Any:
        time.sleep(delay)
        return step()

    def full_speed() -> None:
        backend.step = step  # one attribute write: the engine thread's next step reads it

    backend.step = slow
    return full_speed


def reference(lm: Any, prompt_tokens: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of mlx-lm's own single-request generator (the oracle). Greedy decoding's first ``k`` tokens
    do not depend on ``max_tokens``, so each prompt's longest run so far is kept (per model, the last few models)
    and a shorter or equal ask is its start: a test's requests are often another test's, or the same again."""
    model, tokenizer = lm
    entry = _REFERENCES.setdefault(id(model), (model, {}))
    if entry[0] is not model:  # another model under a recycled id
        entry = _REFERENCES[id(model)] = (model, {})
    while len(_REFERENCES) > 4:
        del _REFERENCES[next(iter(_REFERENCES))]
    key = tuple(prompt_tokens)
    known = entry[1].get(key)
    if known is not None and (known[0] >= max_tokens or len(known[1]) < known[0]):  # long enough, or ended
        return known[1][:max_tokens]
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out: list[int] = []
    for tok, _ in generate_step(mx.array(prompt_tokens), model, max_tokens=max_tokens):
        token = int(tok)
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    entry[1][key] = (max_tokens, out)
    return list(out)


# id(model) -> (the model, prompt -> (max_tokens asked, its greedy tokens)): reference()'s runs so far
_REFERENCES: dict[int, tuple[Any, dict[tuple[int, ...], tuple[int, list[int]]]]] = {}


def reference_text(lm: Any, tokens: list[int]) -> str:
    """Text as mlx-lm's streaming detokenizer renders it (what mlx_lm.generate prints)."""
    detok = lm[1].detokenizer
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return str(detok.text)


def quick_run_fixtures(run: Callable[[Path], int]) -> tuple[Any, Any]:
    """A benchmark module's two fixtures: ``quick_run``, one run of ``run(out)`` with its stdout captured
    (``(out, exit code, stdout)``), shared by the module's tests; and ``results``, its ``results.json``."""

    @pytest.fixture(scope="module")
    def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
        out = tmp_path_factory.mktemp("bench")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = run(out)
        return out, code, buf.getvalue()

    @pytest.fixture(scope="module")
    def results(quick_run: tuple[Path, int, str]) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((quick_run[0] / "results.json").read_text())
        return data

    return quick_run, results
