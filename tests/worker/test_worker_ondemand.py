"""On-demand loading (MLXQ_LOADABLE_MODELS, MLXQ_MODEL_MEMORY, MLXQ_MODEL_IDLE_S): a job for a model not loaded
loads it and completes; three models on a budget for two serve a mixed load, every job ending once; an idle
model unloads while the pinned one stays; a corrupt model fails its jobs and is not retried. Real Redis, a real
arq worker, real tiny models (copies of the tiny one under other names)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.api.client import Client
from mlxq.api.schema import ErrorCode, ModelState
from mlxq.worker.budget import weights_bytes
from tests.support import collect, config_with, start_worker, terminal, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def copies(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Three models (the tiny one's files under three names) and a corrupt one (its weights truncated)."""
    root = tmp_path_factory.mktemp("ondemand")
    found = {name: Path(shutil.copytree(tiny_model, root / name)) for name in ("a", "b", "c", "broken")}
    for weights in found["broken"].glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:200])
    yield found


def loadable(copies: dict[str, Path], *names: str) -> str:
    return ",".join(f"{copies[n]}={n}" for n in names)


def state(host: Any, name: str) -> ModelState:
    return host.services[name].state


async def record_of(client: Client, name: str, wanted: ModelState) -> Any:
    """The model's part of the one worker's health record once it shows ``wanted`` (a beat already under way when
    the state changed may still write the one before)."""
    for _ in range(500):
        (worker,) = await client.workers()
        found = {m.name: m for m in worker.models}[name]
        if found.state is wanted:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} never showed {wanted.value}: {found.state.value}")


async def run_job(client: Client, model: str, prompt: str = "Hello world", max_tokens: int = 6) -> list[Any]:
    rid = await client.submit(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, require_worker=True)
    return await collect(client, rid)


async def test_a_job_for_a_loadable_model_loads_it_and_an_idle_one_unloads_while_the_pinned_one_stays(
        worker_config: Any, copies: dict[str, Path], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    cleared: list[int] = []  # the thread of each mx.clear_cache() call
    clear_cache = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: (cleared.append(threading.get_ident()), clear_cache())[1])
    cfg = config_with(worker_config, loadable_models=loadable(copies, "a"), model_idle_s=0.5)
    running = await start_worker(cfg)
    try:
        host = running.host
        assert state(host, "a") is ModelState.UNLOADED and state(host, "tiny") is ModelState.SERVING
        models = await client.models()  # what /v1/models and require_worker read
        assert (models["a"].workers, models["a"].loadable, models["a"].offered) == (0, 1, True)
        assert (models["tiny"].workers, models["tiny"].loadable) == (1, 0)
        record = {m.name: m for m in (await client.workers())[0].models}
        assert record["a"].loadable and record["a"].weights_bytes == weights_bytes(str(copies["a"]))

        events = await run_job(client, "a")
        assert terminal(events).type == "done" and any(e.type == "token" for e in events)
        assert host.ondemand.loads == 1 and host.services["a"].load_s is not None

        model_thread = host.services["a"]._thread._thread_id
        await wait_for(lambda: host.ondemand.unloads == 1, "the idle model to unload", timeout=30)
        assert cleared and set(cleared) == {model_thread}  # its weights freed, MLX's cache cleared: on its thread
        assert state(host, "a") is ModelState.UNLOADED and state(host, "tiny") is ModelState.SERVING
        before, after = host.services["a"].before_load, host.services["a"].after_unload
        assert before is not None and after is not None
        assert after.active <= before.active + weights_bytes(str(copies["a"])) // 2  # its weights were freed
        assert terminal(await run_job(client, "tiny")).type == "done"  # the pinned model never left
        assert terminal(await run_job(client, "a")).type == "done"  # and the unloaded one loads again
        assert host.ondemand.loads == 2
        totals = host.metrics.totals()  # what Prometheus scrapes
        assert (totals["model_loads"], totals["model_load_failures"]) == (2, 0)
        assert totals["model_unloads"] == host.ondemand.unloads >= 1  # (it may be idle again by now)
    finally:
        await running.close()


async def test_three_models_on_a_budget_for_two_end_every_job_exactly_once(
        worker_config: Any, copies: dict[str, Path], client: Client) -> None:
    each = weights_bytes(str(copies["a"]))
    assert each
    pinned = weights_bytes(worker_config.model) or 0
    cfg = config_with(worker_config, loadable_models=loadable(copies, "a", "b", "c"),
                      model_memory=pinned + 2 * each + each // 2)
    running = await start_worker(cfg)
    try:
        host = running.host
        order = ["a", "b", "c", "a", "c", "b", "tiny", "c", "a", "b"] * 2
        jobs = [run_job(client, model, f"prompt {i} for {model}", 4 + i % 5) for i, model in enumerate(order)]
        results = await asyncio.gather(*jobs)
        for events in results:
            assert terminal(events).type == "done"  # exactly one terminal event each, and none failed
        assert host.ondemand.loads >= 3 and host.ondemand.unloads >= 1  # c came in only by unloading another
        assert host.ondemand.budget.in_use <= cfg.model_memory
        loaded = [n for n in "abc" if state(host, n) is ModelState.SERVING]
        assert len(loaded) <= 2
    finally:
        await running.close()


async def test_a_corrupt_loadable_model_fails_its_jobs_and_is_not_retried(
        worker_config: Any, copies: dict[str, Path], client: Client) -> None:
    cfg = config_with(worker_config, loadable_models=loadable(copies, "broken"))
    running = await start_worker(cfg)
    try:
        host = running.host
        for require in (True, False):  # the second: no live worker offers it any longer (it is load_failed)
            rid = await client.submit(model="broken", prompt="Hello", max_tokens=4, require_worker=require)
            end = terminal(await collect(client, rid))
            assert end.type == "error" and end.code is ErrorCode.MODEL_UNAVAILABLE
            assert end.message.startswith("model broken cannot be loaded: ")
        assert host.ondemand.load_failures == 1 and host.ondemand.loads == 0  # tried once, not in a loop
        record = await record_of(client, "broken", ModelState.LOAD_FAILED)
        assert record.error == host.services["broken"].load_error  # status says why
        assert not (await client.models())["broken"].offered
    finally:
        await running.close()


async def test_of_two_workers_that_can_load_a_model_one_loads_it_for_one_job(
        worker_config: Any, copies: dict[str, Path], client: Client) -> None:
    cfg = config_with(worker_config, loadable_models=loadable(copies, "a"))
    first = await start_worker(config_with(cfg, worker_id="od-first"))
    second = await start_worker(config_with(cfg, worker_id="od-second"))
    try:
        assert (await client.models())["a"].loadable == 2
        for _ in range(3):  # one job at a time: the one loaded has room for each
            assert terminal(await run_job(client, "a")).type == "done"
        assert first.host.ondemand.loads + second.host.ondemand.loads == 1
        models = await client.models()
        assert (models["a"].workers, models["a"].loadable) == (1, 1)
    finally:
        await second.close()
        await first.close()


async def test_a_load_in_progress_does_not_hold_up_the_other_models_jobs(
        worker_config: Any, copies: dict[str, Path], client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxq.engine.mlx import loader

    gate, load = threading.Event(), loader.load_model

    def held_load(path: str, *args: Any) -> Any:  # on the loading model's MLX thread: waits there for the test
        if path == str(copies["a"]):
            assert gate.wait(timeout=60)
        return load(path, *args)

    monkeypatch.setattr(loader, "load_model", held_load)
    running = await start_worker(config_with(worker_config, loadable_models=loadable(copies, "a")))
    try:
        host = running.host
        rid = await client.submit(model="a", prompt="Hello", max_tokens=4, require_worker=True)
        await wait_for(lambda: state(host, "a") is ModelState.LOADING, "the load to start")
        assert terminal(await run_job(client, "tiny", max_tokens=12)).type == "done"  # the pinned model streams on
        assert state(host, "a") is ModelState.LOADING  # while the load still waits
        record = {m.name: m for m in (await client.workers())[0].models}
        assert record["a"].state is ModelState.LOADING
        gate.set()
        assert terminal(await collect(client, rid)).type == "done"
    finally:
        gate.set()
        await running.close()
