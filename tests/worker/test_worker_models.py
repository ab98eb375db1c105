"""Several models in one worker process (MLXQ_MODELS): one engine, MLX thread and queue each; claims across
the queues; a dead engine takes only its own model down. Real Redis, a real arq worker, two real models."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from api.client import Client
from api.errors import JobFailed, NoWorker
from api.schema import ErrorCode, ModelState
from engine.prompt import encode_prompt
from tests.support import RunningWorker, config_with, start_worker
from tests.worker.test_worker_queue import reference
from worker.config import ServedModel, WorkerConfig, parse_models

PROMPTS = ["Hello world", "Once upon a time", "the quick brown fox", "x y", "What is the queue?", "mlxq"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tinymodel import ensure_model

    return ensure_model("small", root=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def references(tiny_model: Path, small_model: Path) -> dict[str, tuple[Any, Any]]:
    import mlx_lm

    return {"tiny": mlx_lm.load(str(tiny_model)), "small": mlx_lm.load(str(small_model))}


@pytest.fixture
def evals() -> Iterator[list[int]]:
    """The thread of every explicit MLX evaluation (mx.eval, mx.async_eval) while the test runs."""
    seen: list[int] = []
    eval_, async_eval = mx.eval, mx.async_eval

    def recording(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(threading.get_ident())
            return fn(*args, **kwargs)
        return call

    mx.eval, mx.async_eval = recording(eval_), recording(async_eval)  # type: ignore[assignment]
    try:
        yield seen
    finally:
        mx.eval, mx.async_eval = eval_, async_eval  # type: ignore[assignment]


@pytest.fixture
async def two_models(worker_config: WorkerConfig, small_model: Path) -> AsyncIterator[RunningWorker]:
    models = f"{worker_config.model}=tiny,{small_model}=small"
    running = await start_worker(config_with(worker_config, model="", model_name="", models=models, capacity=4))
    try:
        yield running
    finally:
        await running.close()


def test_mlxq_models_names_each_model_by_its_alias_or_its_path() -> None:
    assert parse_models(" /m/a=alpha, /m/b ,,") == (ServedModel("/m/a", "alpha"), ServedModel("/m/b", "/m/b"))
    assert WorkerConfig(model="/m/x", model_name="x").served == (ServedModel("/m/x", "x"),)
    assert WorkerConfig(model="/m/x", models="/m/y=y").served == (ServedModel("/m/y", "y"),)  # MLXQ_MODELS wins
    assert WorkerConfig(models="/a=a,/b=b", capacity=8).arq_max_jobs == 2 * (8 + 2)


async def test_two_engines_generating_at_once_match_each_model_alone_on_their_own_threads(
        two_models: RunningWorker, client: Client, references: dict[str, tuple[Any, Any]], evals: list[int]
) -> None:
    host = two_models.host
    assert [s.name for s in host.services.values()] == ["tiny", "small"]
    threads = {s.engine.thread._thread_id for s in host.services.values()}
    assert len(threads) == 2  # an MLX thread (and stream) each
    jobs = [(model, prompt, 6 + i) for i, prompt in enumerate(PROMPTS) for model in ("tiny", "small")]
    results = await asyncio.gather(*(client.generate(model=m, prompt=p, max_tokens=n, timeout=120)
                                     for m, p, n in jobs))
    evaluated_on = set(evals)  # (the references below evaluate on this thread)
    assert evaluated_on and evaluated_on <= threads, "an MLX evaluation ran outside the engines' threads"
    for (model, prompt, n), result in zip(jobs, results):
        model_, tokenizer = references[model]
        assert result.token_ids == reference(references[model], encode_prompt(tokenizer, prompt, None), n), model
    steps = [s.engine.stats.steps for s in host.services.values()]
    assert all(n > 0 for n in steps)
    (status,) = await client.workers()
    assert [(m.name, m.state) for m in status.models] == [("tiny", ModelState.SERVING), ("small", ModelState.SERVING)]


async def test_a_dead_engine_takes_only_its_model_down(two_models: RunningWorker, client: Client) -> None:
    small = two_models.host.services["small"]

    def cannot_rebuild() -> Any:
        raise RuntimeError("[metal] device lost")

    def broken_step() -> Any:
        raise RuntimeError("[metal] command buffer failed")

    small.engine._make_backend = cannot_rebuild
    small.engine.scheduler.backend.step = broken_step
    with pytest.raises(JobFailed) as failed:
        await client.generate(model="small", prompt="doomed", max_tokens=4, timeout=60)
    assert failed.value.code is ErrorCode.ENGINE_ERROR
    for _ in range(500):
        if small.state is ModelState.DEAD:
            break
        await asyncio.sleep(0.01)
    assert small.state is ModelState.DEAD and small.room() == 0
    served = await client.generate(model="tiny", prompt="still here", max_tokens=5, timeout=60)
    assert served.usage.completion_tokens == 5 and not two_models.task.done()
    await two_models.host.health.beat()
    models = await client.models()
    assert models["small"].workers == 0 and models["small"].dead_on == [two_models.host.config.worker_id]
    assert models["tiny"].workers == 1
    with pytest.raises(NoWorker, match="models served now: 'tiny'"):
        await client.submit(model="small", prompt="anyone?", require_worker=True)


_DOOMED_WORKER = """
import sys
import worker.host

start = worker.host.WorkerHost.start.__func__

async def doomed(cls, config):  # every engine's steps fail and its batch cannot be rebuilt: each engine dies
    host = await start(cls, config)
    for service in host.services.values():
        def broken(*_):
            raise RuntimeError("[metal] device lost")
        service.engine._make_backend = broken
        service.engine.scheduler.backend.step = broken
    return host

worker.host.WorkerHost.start = classmethod(doomed)
from arq.cli import cli
cli.main(["worker.Settings"])
"""


async def test_the_process_exits_70_for_its_supervisor_once_every_engine_is_dead(redis_url: str, tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from worker.host import ENGINE_DEAD_EXIT

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MLXQ_MODELS": f"{tiny_model}=a,{tiny_model}=b", "MLXQ_REDIS_URL": redis_url,
           "MLXQ_PREFIX": "doomed"}
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_WORKER], cwd=root, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        async with Client(redis_url, prefix="doomed") as client:
            for _ in range(1200):
                if len(await client.models()) == 2:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(JobFailed) as a:
                await client.generate(model="a", prompt="hi", max_tokens=4, timeout=60)
            assert proc.poll() is None  # one engine dead: the process serves on
            with pytest.raises(JobFailed) as b:
                await client.generate(model="b", prompt="hi", max_tokens=4, timeout=60)
        assert a.value.code is b.value.code is ErrorCode.ENGINE_ERROR
        assert await asyncio.to_thread(proc.wait, 60) == ENGINE_DEAD_EXIT
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert f"every engine is dead; exiting with {ENGINE_DEAD_EXIT}" in (tmp_path / "worker.log").read_text()
