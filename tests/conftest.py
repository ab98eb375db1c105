"""Shared fixtures: a real Redis server started for the session, a generated tiny model, an in-process
arq worker serving it. Nothing here touches another Redis server or downloads anything."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

# Bytecode: where the environment turns its cache off (PYTHONDONTWRITEBYTECODE), every test process, and every
# worker and gateway process the tests start, compiled the project again, and pytest rewrote every test module's
# asserts again in each (a seventh of the everyday run's CPU here). The test run caches it (__pycache__, which git
# ignores), from here on and in the processes it starts.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from tests.support import RunningWorker, start_worker  # noqa: E402  (after the bytecode setting: it imports mlxq)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# No test writes the prefix cache's disk tier into the user's cache directory: workers made here (MLXQ_KV_DIR
# unset: the default directory) and the worker processes tests start (they inherit MLXQ_KV_DIR) use the session's.
_KV_DIR = Path(tempfile.mkdtemp(prefix="mlxq-kv-"))
atexit.register(shutil.rmtree, _KV_DIR, True)
os.environ.setdefault("MLXQ_KV_DIR", str(_KV_DIR))
try:
    import mlxq.engine.mlx.prefix.directory as kv_directory

    kv_directory.default_dir = lambda: _KV_DIR
except ImportError:  # a producer-only install: no engine, no disk tier
    pass

# Tiers: `pytest -m "not slow"` is the everyday run; the README's test command (and .ci/run) runs them all.
# Each test module marks its own tier (`pytestmark`): slow (long fault, soak and load runs, long engine runs,
# the benchmarks' bigger models, and those that build or run whole programs), e2e (a real Redis server, and
# workers, gateways or processes, take part) or unit. A module that mixes them leaves it out: its tests that use a
# Redis of the session or their own are e2e, those marked slow slow, the rest unit.
_E2E_FIXTURES = frozenset({"redis_server", "served", "gw", "d", "secured"})


# A test that needs a model (and so a worker: MLX, mlx-lm and arq, the worker extra) is skipped on a producer-only
# install, where the rest of tests/api still runs; one that needs a vision-language model (mlx-vlm, the vision
# extra), on a worker install without it.
_MODEL_FIXTURES = frozenset({"tiny_model", "tiny_think_model", "tiny_tools_model", "tiny_vlm", "tiny_embed_model"})
_VISION_FIXTURES = frozenset({"tiny_vlm"})


def _installed(*names: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in names)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``'s processes: one more than the cores, at least three, at most eight. Most tests wait on worker
    processes and Redis (a serial run keeps about 1.3 of 2 cores busy), and a file runs whole in one process
    (``--dist loadfile``: its module fixtures, the models it loads, load once)."""
    return min(8, max(3, (os.cpu_count() or 1) + 1))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    no_worker = None if _installed("mlx_lm", "arq") else pytest.mark.skip(
        reason="needs the worker extra (MLX, mlx-lm, arq)")
    no_vision = None if _installed("mlx_vlm") else pytest.mark.skip(reason="needs the vision extra (mlx-vlm)")
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if no_worker is not None and _MODEL_FIXTURES & uses:
            item.add_marker(no_worker)
        elif no_vision is not None and _VISION_FIXTURES & uses:
            item.add_marker(no_vision)
        _tier(item, bool(_E2E_FIXTURES & uses))
    # Files with slow tests first: each file runs whole in one process (``--dist loadfile``), and the longest ones
    # (minutes, in tests/worker) started last would run on alone after the rest had ended.
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)


def _tier(item: pytest.Item, uses_redis: bool) -> None:
    """Marks the tier of a test whose module leaves it out; refuses a unit test that is also e2e or slow (marks
    add up: a module's ``unit`` would keep its slow tests in ``-m unit``, the quick tier)."""
    unit, e2e, slow = (item.get_closest_marker(name) is not None for name in ("unit", "e2e", "slow"))
    if unit and (uses_redis or e2e):
        raise pytest.UsageError(f"{item.nodeid} is marked unit but uses a Redis server (mark it e2e)")
    if unit and slow:
        raise pytest.UsageError(f"{item.nodeid} is marked unit and slow (leave its module's pytestmark out)")
    if not (unit or e2e):
        if uses_redis:
            item.add_marker(pytest.mark.e2e)
        elif not slow:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Any]:
    from mlxq.worker.tools.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: Any) -> str:
    """The session server, emptied before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return str(redis_server.url)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxq.worker.tools.tinymodel import ensure_model

    return ensure_model("tiny", root=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small generated model (another vocabulary than the tiny one's), read-only: one for the session."""
    from mlxq.worker.tools.tinymodel import ensure_model

    return ensure_model("small", root=tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def tiny_think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with think markers and a template that opens a think block (worker/tools/tinymodel.py)."""
    from mlxq.worker.tools.tinymodel import ensure_model

    return ensure_model("tiny-think", root=tmp_path_factory.mktemp("think"))


@pytest.fixture(scope="session")
def tiny_tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with tool-call markers and a template that renders tools (mlx-lm parses its calls with its
    json_tools parser)."""
    from mlxq.worker.tools.tinymodel import ensure_model

    return ensure_model("tiny-tools", root=tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="session")
def tiny_embed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated tiny embedding model of the Qwen3-Embedding kind (a qwen3 decoder, sentence-transformers'
    last-token pooling files, a tokenizer that appends <|endoftext|>)."""
    from mlxq.worker.tools.tinymodel import ensure_model

    return ensure_model("tiny-embed", root=tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated tiny qwen2_vl in mlx-vlm's format (worker/tools/tinyvlm.py)."""
    from mlxq.worker.tools.tinyvlm import ensure_vlm

    return ensure_vlm(root=tmp_path_factory.mktemp("vlm"))


@pytest.fixture
def worker_config(redis_url: str, tiny_model: Path) -> Any:
    from mlxq.worker.config import WorkerConfig

    return WorkerConfig(
        model=str(tiny_model), model_name="tiny", redis_url=redis_url, capacity=8,
        poll_delay_s=0.25, cancel_poll_s=0.1, drain_timeout_s=5.0,
    )


@pytest.fixture
async def worker(worker_config: Any) -> AsyncIterator[RunningWorker]:
    running = await start_worker(worker_config)
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Any]:
    from mlxq.api.client import Client

    async with Client(redis_url) as c:
        yield c
