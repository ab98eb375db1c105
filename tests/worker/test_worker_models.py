"""Several models in one worker process (MLXQ_MODELS): one engine, MLX thread and queue each; claims across
the queues; a dead engine takes only its own model down. Real Redis, a real arq worker, two real models."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.api.client import Client
from mlxq.api.errors import ConfigError, JobFailed, NoWorker
from mlxq.api.schema import ErrorCode, ModelState
from mlxq.engine.core.prompt import encode_prompt
from mlxq.worker.config import ServedModel, WorkerConfig, parse_models
from mlxq.worker.settings import check_config
from tests.support import RunningWorker, config_with, reference, start_worker

PROMPTS = ["Hello world", "Once upon a time", "the quick brown fox", "x y", "What is the queue?", "mlxq"]


@pytest.fixture(scope="module")
def references(tiny_model: Path, small_model: Path) -> dict[str, tuple[Any, Any]]:
    import mlx_lm

    return {"tiny": mlx_lm.load(str(tiny_model)), "small": mlx_lm.load(str(small_model))}


# Every way Python code makes MLX evaluate that can be wrapped in mlx 0.32: the explicit calls, and the array
# methods that evaluate implicitly. (The buffer protocol -- memoryview, np.asarray -- is C-level: not here.)
_EVALUATING_FUNCTIONS = ("eval", "async_eval", "synchronize")
_EVALUATING_METHODS = ("item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__", "__repr__")


@pytest.fixture
def evals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """The thread of every MLX evaluation while the test runs, and what evaluated."""
    seen: list[tuple[int, str]] = []

    def recording(fn: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((threading.get_ident(), name))
            return fn(*args, **kwargs)
        return call

    for name in _EVALUATING_FUNCTIONS:
        monkeypatch.setattr(mx, name, recording(getattr(mx, name), "mx." + name))
    for name in _EVALUATING_METHODS:
        monkeypatch.setattr(mx.array, name, recording(getattr(mx.array, name), "array." + name))
    return seen


def engine_threads(host: Any) -> dict[str, int]:
    """Each model's MLX thread."""
    return {name: s.engine.thread._thread_id for name, s in host.services.items()}


def assert_evaluated_only_on(seen: list[tuple[int, str]], threads: dict[str, int]) -> None:
    """Every evaluation ran on an engine's thread, and each engine's thread evaluated."""
    stray = sorted({what for thread, what in seen if thread not in threads.values()})
    assert not stray, f"MLX evaluated outside the engines' threads: {stray}"
    assert {thread for thread, _ in seen} == set(threads.values())


def record_steps(host: Any) -> dict[str, list[tuple[float, float]]]:
    """Each engine's steps as (start, end) on one clock, from its step hook (the worker's own hook still runs)."""
    steps: dict[str, list[tuple[float, float]]] = {}
    for name, service in host.services.items():
        spans = steps.setdefault(name, [])

        def on_step(seconds: float, hook: Any = service.engine.on_step, spans: Any = spans) -> None:
            end = time.perf_counter()  # the hook runs on the engine's thread, right after the step
            spans.append((end - seconds, end))
            hook(seconds)

        service.engine.on_step = on_step
    return steps


def overlapped(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    """Whether a step of ``a`` and a step of ``b`` ran at the same time."""
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


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
    assert WorkerConfig(models="/a=a,/b=b", capacity=8).arq_max_jobs == 2 * (8 + 2 + 8)  # jobs, and paused ones


def test_kv_quantization_is_given_for_every_model_or_per_model_by_name() -> None:
    big, small = ServedModel("/m/a", "big"), ServedModel("/m/b", "small")
    config = WorkerConfig.from_env({"MLXQ_MODELS": "/m/a=big,/m/b=small", "MLXQ_KV_BITS": "big=8, small=off",
                                    "MLXQ_KV_GROUP_SIZE": "32,small=128"})
    assert (config.kv_quant(big), config.kv_quant(small)) == ((8, 32), None)
    config = WorkerConfig.from_env({"MLXQ_MODELS": "/m/a=big,/m/b=small", "MLXQ_KV_BITS": "4,big=8"})
    assert (config.kv_quant(big), config.kv_quant(small)) == ((8, 64), (4, 64))  # a value without a name: the rest
    assert WorkerConfig.from_env({"MLXQ_KV_BITS": "8"}).kv_quant(small) == (8, 64)
    assert WorkerConfig.from_env({"MLXQ_KV_BITS": "off"}).kv_quant(small) is None
    assert WorkerConfig().kv_quant(small) is None


@pytest.mark.parametrize("env,message", [
    ({"MLXQ_KV_BITS": "big=3"}, "MLXQ_KV_BITS='big=3': big=3: expected 8, 4 or off"),
    ({"MLXQ_KV_BITS": "big=8,big=4"}, "MLXQ_KV_BITS='big=8,big=4': big is given twice"),
    ({"MLXQ_KV_BITS": "8,4"}, "MLXQ_KV_BITS='8,4': the value for the models not named is given twice"),
    ({"MLXQ_KV_BITS": "=8"}, "MLXQ_KV_BITS='=8': =8: expected model=value (a model's name before the =)"),
    ({"MLXQ_KV_GROUP_SIZE": "32,small=48"}, "MLXQ_KV_GROUP_SIZE='32,small=48': small=48: expected 32, 64, 128"),
], ids=["bits", "twice", "two_defaults", "no_name", "group_size"])
def test_a_bad_per_model_kv_setting_is_a_config_error_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        WorkerConfig.from_env({"MLXQ_MODELS": "/m/a=big,/m/b=small", **env})
    assert str(error.value) == message


def test_a_per_model_kv_setting_naming_a_model_not_served_is_a_config_error(tiny_model: Path) -> None:
    config = WorkerConfig.from_env({"MLXQ_MODELS": f"{tiny_model}=big,{tiny_model}=small",
                                    "MLXQ_KV_BITS": "big=8,smal=off"})
    with pytest.raises(ConfigError) as error:
        check_config(config)
    assert str(error.value) == "MLXQ_KV_BITS names smal, a model this worker does not serve (it serves big, small)"


async def test_one_model_quantized_beside_one_not_decodes_each_as_mlx_lm_and_keeps_its_own_disk_tier(
        worker_config: WorkerConfig, tiny_model: Path, tmp_path: Path, client: Client,
        references: dict[str, tuple[Any, Any]]) -> None:
    import mlx_lm

    from mlxq.engine.mlx.memory import measure_layout
    from mlxq.engine.mlx.prefix.directory import layout_key, model_key, namespace
    from mlxq.engine.mlx.quantized_cache import KVQuant
    from mlxq.worker.tools.tinymodel import ensure_model
    from tests.engine.test_engine_kv_quant import oracle

    kvq = ensure_model("tiny-kvq", root=tmp_path / "models")  # heads of 64 values: groups of 64 (tiny's are 16)
    quant = KVQuant(8, 64)
    config = config_with(worker_config, model="", model_name="", models=f"{kvq}=q,{tiny_model}=tiny", capacity=4,
                         kv_bits=WorkerConfig.from_env({"MLXQ_KV_BITS": "q=8"}).kv_bits,
                         kv_dir=str(tmp_path / "kv"), kv_disk_gb=0.25)
    running = await start_worker(config)
    try:
        jobs = [(model, prompt) for prompt in PROMPTS[:3] for model in ("q", "tiny")]
        results = await asyncio.gather(*(client.generate(model=m, prompt=p, max_tokens=8, timeout=120)
                                         for m, p in jobs))
        engines = {name: s.engine for name, s in running.host.services.items()}
    finally:
        await running.close()
    lms = {"q": mlx_lm.load(str(kvq)), "tiny": references["tiny"]}
    for (model, prompt), result in zip(jobs, results):
        tokens = encode_prompt(lms[model][1], prompt, None)
        expected = oracle(lms[model], tokens, quant, 8) if model == "q" else reference(lms[model], tokens, 8)
        assert result.token_ids == expected, (model, prompt)
    # Each engine's KV layout (what admission charges) and its disk tier's directory are its own model's.
    for name, path, kv in (("q", kvq, quant), ("tiny", tiny_model, None)):
        model = lms[name][0]
        scheduler = engines[name].scheduler
        assert scheduler.memory.layout.bytes_per_token == measure_layout(model, config.prefill_step_size,
                                                                         kv).bytes_per_token
        assert scheduler.prefix_cache.disk.dir == namespace(tmp_path / "kv", model_key(str(path)),
                                                            layout_key(model, kv))
    assert engines["q"].scheduler.memory.layout.bytes_per_token < measure_layout(lms["q"][0], 512).bytes_per_token


async def test_two_engines_generating_at_once_match_each_model_alone_on_their_own_threads(
        evals: list[tuple[int, str]], two_models: RunningWorker, client: Client,
        references: dict[str, tuple[Any, Any]]
) -> None:
    host = two_models.host
    assert [s.name for s in host.services.values()] == ["tiny", "small"]
    threads = engine_threads(host)
    assert len(set(threads.values())) == 2  # an MLX thread (and stream) each
    steps = record_steps(host)
    jobs = [(model, prompt, 6 + i) for i, prompt in enumerate(PROMPTS) for model in ("tiny", "small")]
    results = await asyncio.gather(*(client.generate(model=m, prompt=p, max_tokens=n, timeout=120)
                                     for m, p, n in jobs))
    assert_evaluated_only_on(list(evals), threads)  # from loading on (the references below evaluate here)
    assert overlapped(steps["tiny"], steps["small"]), "the two engines never stepped at the same time"
    # Read before the references below, which hold this loop (and the in-process worker's heartbeat) a while.
    (status,) = await client.workers()
    assert [(m.name, m.state) for m in status.models] == [("tiny", ModelState.SERVING), ("small", ModelState.SERVING)]
    for (model, prompt, n), result in zip(jobs, results):
        model_, tokenizer = references[model]
        assert result.token_ids == reference(references[model], encode_prompt(tokenizer, prompt, None), n), model


async def test_a_vision_engine_beside_a_text_engine_evaluates_only_on_its_own_thread(
        evals: list[tuple[int, str]], worker_config: WorkerConfig, tiny_vlm: Path, client: Client,
        references: dict[str, tuple[Any, Any]]
) -> None:
    from tests.vlm_support import Oracle, chat, data_url

    models = f"{worker_config.model}=tiny,{tiny_vlm}=vl"
    running = await start_worker(config_with(worker_config, model="", model_name="", models=models, capacity=4))
    try:
        host = running.host
        threads = engine_threads(host)
        steps = record_steps(host)
        looks = [chat("What is in this picture?", data_url(64, 40, 1)), chat("And this?", data_url(48, 64, 2)),
                 [{"role": "user", "content": "Tell me about the queue."}]]
        texts = PROMPTS[:3]
        results = await asyncio.gather(
            *(client.generate(model="vl", messages=m, max_tokens=8, timeout=120) for m in looks),
            *(client.generate(model="tiny", prompt=p, max_tokens=8, timeout=120) for p in texts))
        assert_evaluated_only_on(list(evals), threads)
        assert overlapped(steps["tiny"], steps["vl"]), "the two engines never stepped at the same time"
    finally:
        await running.close()
    oracle = Oracle(tiny_vlm)
    for messages, result in zip(looks, results[:3]):
        assert result.token_ids == oracle.tokens(messages, 8)
    tokenizer = references["tiny"][1]
    for prompt, result in zip(texts, results[3:]):
        assert result.token_ids == reference(references["tiny"], encode_prompt(tokenizer, prompt, None), 8)


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
import mlxq.worker.host

start = mlxq.worker.host.WorkerHost.start.__func__

async def doomed(cls, config):  # every engine's steps fail and its batch cannot be rebuilt: each engine dies
    host = await start(cls, config)
    for service in host.services.values():
        def broken(*_):
            raise RuntimeError("[metal] device lost")
        service.engine._make_backend = broken
        service.engine.scheduler.backend.step = broken
    return host

mlxq.worker.host.WorkerHost.start = classmethod(doomed)
from arq.cli import cli
cli.main(["mlxq.worker.Settings"])
"""


@pytest.mark.slow  # a fault or a whole program: out of the everyday run
async def test_the_process_exits_70_for_its_supervisor_once_every_engine_is_dead(redis_url: str, tiny_model: Path,
                                                                                 tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from mlxq.worker.host import ENGINE_DEAD_EXIT

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


async def test_the_workers_mlx_memory_and_cache_limits_reach_the_process_owner(
        worker_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlxq.worker.host
    from mlxq.engine.mlx.process import MLXLimits
    from mlxq.worker.config import WorkerConfig

    env = WorkerConfig.from_env({"MLXQ_MODEL": "x", "MLXQ_MLX_MEMORY_GB": "2", "MLXQ_MLX_CACHE_GB": "0.25"})
    assert env.mlx_limits == (2 << 30, 1 << 28)
    assert WorkerConfig.from_env({"MLXQ_MODEL": "x"}).mlx_limits == (None, None)
    seen: list[MLXLimits] = []
    real = mlxq.worker.host.mlx_process
    monkeypatch.setattr(mlxq.worker.host, "mlx_process", lambda limits=None: seen.append(limits) or real())
    running = await start_worker(config_with(worker_config, mlx_memory_gb=2.0, mlx_cache_gb=0.25))
    try:
        assert seen == [MLXLimits(memory_bytes=2 << 30, cache_bytes=1 << 28)]
    finally:
        await running.close()
